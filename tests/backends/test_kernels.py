"""Triton gather/scatter equal their torch twins exactly (run under TRITON_INTERPRET=1 on
CPU), on random data, odd shapes and every supported dtype."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from hicache.backends import kernels
from hicache.errors import ConfigError

pytestmark = pytest.mark.skipif(not kernels.HAVE_TRITON, reason="triton not installed")
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def rand(shape: tuple[int, ...], dtype: torch.dtype, gen: torch.Generator) -> torch.Tensor:
    return torch.randn(shape, generator=gen).to(dtype).to(DEVICE)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize(("slabs_n", "pool", "elems", "n"), [(2, 5, 3, 2), (6, 13, 97, 7), (4, 9, 1030, 9)])
@pytest.mark.parametrize(("block", "warps"), [(None, None), (64, None), (64, 1), (None, 2)])
def test_gather_and_scatter_match_torch(
    dtype: torch.dtype, slabs_n: int, pool: int, elems: int, n: int, block: int | None, warps: int | None
) -> None:
    """Any block size and warp count (``None``: the default) moves exactly the rows asked for."""
    gen = torch.Generator().manual_seed(slabs_n * 1000 + elems)
    slabs = rand((slabs_n, pool, elems), dtype, gen)
    ids = torch.randperm(pool, generator=gen)[:n].to(DEVICE)
    want = torch.full((n + 1, slabs_n, elems), float("nan"), dtype=dtype, device=DEVICE)
    got = want.clone()
    kernels.gather_torch(slabs, ids, want)
    kernels.gather_triton(slabs, ids, got, block=block, warps=warps)
    assert torch.equal(want[:n], got[:n])
    assert torch.equal(want[:n], slabs[:, ids].transpose(0, 1))
    assert got[n].isnan().all(), "gather wrote past its pages"
    base = rand((slabs_n, pool, elems), dtype, gen)
    a, b = base.clone(), base.clone()
    kernels.scatter_torch(want, ids, a)
    kernels.scatter_triton(want, ids, b, block=block, warps=warps)
    assert torch.equal(a, b)
    untouched = torch.ones(pool, dtype=torch.bool)
    untouched[ids.cpu()] = False
    assert torch.equal(b[:, untouched.to(DEVICE)], base[:, untouched.to(DEVICE)]), "scatter touched other pages"


def test_launchers_refuse_bad_arguments() -> None:
    slabs = torch.zeros(2, 4, 8, device=DEVICE)
    packed = torch.zeros(2, 2, 8, device=DEVICE)
    with pytest.raises(ConfigError, match="int64"):
        kernels.gather_triton(slabs, torch.tensor([0, 1], dtype=torch.int32, device=DEVICE), packed)
    with pytest.raises(ConfigError, match="dtype"):
        kernels.gather_triton(slabs, torch.tensor([0, 1], device=DEVICE), packed.half())
    with pytest.raises(ConfigError, match="contiguous"):
        kernels.scatter_triton(
            packed, torch.tensor([0, 1], device=DEVICE), torch.zeros(2, 8, 4, device=DEVICE).transpose(1, 2)
        )
    with pytest.raises(ConfigError, match="does not fit"):
        kernels.gather_triton(slabs, torch.tensor([0, 1, 2], device=DEVICE), packed)
    ids = torch.tensor([0, 1], device=DEVICE)
    for block in (0, 3, -4):
        with pytest.raises(ConfigError, match=rf"block must be a power of two, got {block}$"):
            kernels.gather_triton(slabs, ids, packed, block=block)
    for warps in (0, 3, -2):
        with pytest.raises(ConfigError, match=rf"warps must be a power of two, got {warps}$"):
            kernels.scatter_triton(packed, ids, slabs, warps=warps)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("layers", [(0, 3), (1, 2), (2, 3)])
@pytest.mark.parametrize("programs", [None, 3])
def test_layer_ranged_load_matches_torch_and_only_its_layers(
    dtype: torch.dtype, layers: tuple[int, int], programs: int | None
) -> None:
    """L2 slabs [P2, 2*L, E] (pinned host memory on CUDA, read in place) into L1 slabs
    [2*L, P1, E]: the K and V slabs of the given layers of the given pages, nothing else."""
    gen = torch.Generator().manual_seed(layers[0] * 10 + layers[1])
    n_layers, l2_pages, l1_pages, elems, n = 3, 11, 9, 97, 5
    src = torch.randn((l2_pages, 2 * n_layers, elems), generator=gen).to(dtype)
    if DEVICE == "cuda":
        src = src.pin_memory()
    src_ids = torch.randperm(l2_pages, generator=gen)[:n].to(DEVICE)
    dst_ids = torch.randperm(l1_pages, generator=gen)[:n].to(DEVICE)
    base = rand((2 * n_layers, l1_pages, elems), dtype, gen)
    a, b = base.clone(), base.clone()
    kernels.load_layers_torch(src, src_ids, a, dst_ids, layers)
    kernels.load_layers_triton(src, src_ids, b, dst_ids, layers, programs=programs)
    if DEVICE == "cuda":
        torch.cuda.synchronize()
    assert torch.equal(a, b)
    want = base.clone()
    for i in range(n):
        for kv in range(2):
            for layer in range(*layers):
                slab = kv * n_layers + layer
                want[slab, int(dst_ids[i])] = src[int(src_ids[i]), slab].to(DEVICE)
    assert torch.equal(b, want)


def test_layer_ranged_load_refuses_bad_arguments() -> None:
    src = torch.zeros(4, 6, 8)
    dst = torch.zeros(6, 5, 8, device=DEVICE)
    ids = torch.tensor([0, 1], device=DEVICE)
    with pytest.raises(ConfigError, match="outside"):
        kernels.load_layers_triton(src, ids, dst, ids, (2, 4))
    with pytest.raises(ConfigError, match="source pages"):
        kernels.load_layers_triton(src, ids[:1], dst, ids, (0, 1))
    with pytest.raises(ConfigError, match="dtype"):
        kernels.load_layers_triton(src.half(), ids, dst, ids, (0, 1))
    with pytest.raises(ConfigError, match=r"\[P2, S, E\]"):
        kernels.load_layers_triton(src[:, :4], ids, dst, ids, (0, 1))


@pytest.mark.parametrize("pool_pages", [5, 32, 40])
def test_warming_the_layered_load_launches_each_group_at_both_row_residues(
    monkeypatch: pytest.MonkeyPatch, pool_pages: int
) -> None:
    """Every group is launched with 1 page and with up to 8 (Triton specializes the row
    count by divisibility by 16), into a scratch pool whose page count is divisible by 16
    exactly when the real pool's is; the real pool is never written."""
    calls: list[tuple[tuple[int, int], int, int]] = []  # (layers, pages, scratch pool pages)
    real = kernels.load_layers_triton

    def spy(src: Any, ids: Any, dst: torch.Tensor, dst_ids: torch.Tensor, layers: Any, **kw: Any) -> None:
        calls.append((layers, dst_ids.numel(), dst.shape[1]))
        real(src, ids, dst, dst_ids, layers, **kw)

    monkeypatch.setattr(kernels, "load_layers_triton", spy)
    dst = torch.randn(2 * 6, pool_pages, 16).to(DEVICE)
    before = dst.clone()
    groups = [(0, 1), (1, 3), (3, 6)]
    n = kernels.warm_load_layers(dst, groups, programs=2)
    sizes = [1, min(8, pool_pages)]
    assert n == len(calls) == len(groups) * len(sizes)
    assert [(c[0], c[1]) for c in calls] == [(g, k) for g in groups for k in sizes]
    scratch = {c[2] for c in calls}
    assert len(scratch) == 1 and (scratch.pop() % 16 == 0) == (pool_pages % 16 == 0)
    assert torch.equal(dst, before)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(
    ("slabs_n", "pool", "l2", "elems", "n"), [(2, 5, 7, 3, 2), (6, 13, 11, 97, 7), (4, 9, 12, 1030, 9)]
)
def test_gather_and_scatter_through_packed_ids_match_torch(
    dtype: torch.dtype, slabs_n: int, pool: int, l2: int, elems: int, n: int
) -> None:
    """The direct path's kernels: L1 pages straight into L2 pages ``packed_ids`` (and
    back), equal to the torch twins, every other L2 row and L1 page untouched."""
    gen = torch.Generator().manual_seed(slabs_n * 100 + n)
    slabs = rand((slabs_n, pool, elems), dtype, gen)
    ids = torch.randperm(pool, generator=gen)[:n].to(DEVICE)
    packed_ids = torch.randperm(l2, generator=gen)[:n].to(DEVICE)
    host = torch.randn((l2, slabs_n, elems), generator=gen).to(dtype)
    if DEVICE == "cuda":
        host = host.pin_memory()
    want, got = host.clone(), host.clone()
    if DEVICE == "cuda":
        got = got.pin_memory()
    kernels.gather_torch(slabs.cpu(), ids.cpu(), want, packed_ids.cpu())
    kernels.gather_triton(slabs, ids, got, packed_ids)
    if DEVICE == "cuda":
        torch.cuda.synchronize()
    assert torch.equal(want, got)
    rest = [r for r in range(l2) if r not in packed_ids.tolist()]
    assert torch.equal(got[rest], host[rest]), "gather wrote other L2 rows"
    base = rand((slabs_n, pool, elems), dtype, gen)
    a, b = base.clone().cpu(), base.clone()
    kernels.scatter_torch(host, ids.cpu(), a, packed_ids.cpu())
    kernels.scatter_triton(host, ids, b, packed_ids)
    assert torch.equal(a, b.cpu())
    untouched = torch.ones(pool, dtype=torch.bool)
    untouched[ids.cpu()] = False
    assert torch.equal(b.cpu()[:, untouched], base.cpu()[:, untouched]), "scatter touched other pages"


def test_launchers_refuse_packed_ids_that_do_not_fit() -> None:
    slabs = torch.zeros(2, 4, 8, device=DEVICE)
    host = torch.zeros(5, 2, 8)
    ids = torch.tensor([0, 1], device=DEVICE)
    with pytest.raises(ConfigError, match="packed pages"):
        kernels.gather_triton(slabs, ids, host.to(DEVICE), ids[:1])
    if DEVICE == "cuda":
        with pytest.raises(ConfigError, match="pinned"):
            kernels.gather_triton(slabs, ids, host, ids)  # pageable host memory


@pytest.mark.parametrize("layers", [(0, 3), (1, 2), (2, 3)])
@pytest.mark.parametrize("programs", [None, 2])
def test_compact_layer_load_matches_torch(layers: tuple[int, int], programs: int | None) -> None:
    """A compact workspace ``[n, 2*(hi-lo), E]`` (K slabs of the layers, then V) into
    L1: those layers of those pages, nothing else."""
    gen = torch.Generator().manual_seed(layers[0] * 7 + layers[1])
    n_layers, l1_pages, elems, n = 3, 9, 33, 5
    count = layers[1] - layers[0]
    src = rand((n, 2 * count, elems), torch.float32, gen)
    rows = torch.arange(n, device=DEVICE)
    dst_ids = torch.randperm(l1_pages, generator=gen)[:n].to(DEVICE)
    base = rand((2 * n_layers, l1_pages, elems), torch.float32, gen)
    a, b = base.clone(), base.clone()
    kernels.load_layers_torch(src, rows, a, dst_ids, layers, compact=True)
    kernels.load_layers_triton(src, rows, b, dst_ids, layers, programs=programs, compact=True)
    want = base.clone()
    for i in range(n):
        for kv in range(2):
            for x in range(count):
                want[kv * n_layers + layers[0] + x, int(dst_ids[i])] = src[i, kv * count + x]
    assert torch.equal(a, want) and torch.equal(b, want)
    with pytest.raises(ConfigError, match="compact workspace"):
        kernels.load_layers_triton(src[:, :1], rows, b, dst_ids, layers, compact=True)


def test_warming_with_an_l2_source_also_launches_the_zero_copy_variant(monkeypatch: pytest.MonkeyPatch) -> None:
    """Given L2's slabs, every group and size is launched from them too (fragmented
    layered restores read L2 in place); neither pool is written."""
    calls: list[bool] = []
    real = kernels.load_layers_triton

    def spy(*args: Any, **kw: Any) -> None:
        calls.append(bool(kw.get("compact")))
        real(*args, **kw)

    monkeypatch.setattr(kernels, "load_layers_triton", spy)
    dst = torch.randn(2 * 4, 20, 8).to(DEVICE)
    src = torch.randn(6, 2 * 4, 8)
    if DEVICE == "cuda":
        src = src.pin_memory()
    before_dst, before_src = dst.clone(), src.clone()
    n = kernels.warm_load_layers(dst, [(0, 1), (1, 4)], src=src)
    assert n == len(calls) == 8 and calls.count(True) == 4
    assert torch.equal(dst, before_dst) and torch.equal(src, before_src)


# The upload's CPU run is the interpreter's; on a GPU machine its CUDA run is in the GPU suite.
ON = [
    pytest.param("cpu", marks=pytest.mark.skipif(DEVICE == "cuda", reason="Triton interprets only without CUDA")),
    pytest.param("cuda", marks=[pytest.mark.gpu, pytest.mark.skipif(DEVICE != "cuda", reason="needs CUDA")]),
]


@pytest.mark.parametrize("device", ON)
@pytest.mark.parametrize("n", [1, 15, 16, 17, 1023, 1024, 1025, 3000])
def test_upload_copies_exactly_its_elements(n: int, device: str) -> None:
    """The forward's metadata upload (a kernel, not a DMA) copies every element, at block
    edges too, and writes nothing past them."""
    gen = torch.Generator().manual_seed(n)
    src = torch.randint(-(2**62), 2**62, (n,), generator=gen, dtype=torch.int64)
    if device == "cuda":
        src = src.pin_memory()
    dst = torch.full((n + 5,), -7, dtype=torch.int64, device=device)
    kernels.upload_triton(dst[:n], src)
    assert torch.equal(dst[:n].cpu(), src.cpu())
    assert (dst[n:] == -7).all(), "the upload wrote past its elements"
    kernels.upload_triton(dst[:0], src[:0])  # nothing to copy is no launch and no error


@pytest.mark.parametrize("device", ON)
def test_upload_refuses_bad_arguments(device: str) -> None:
    dst = torch.zeros(8, dtype=torch.int64, device=device)
    src = torch.zeros(8, dtype=torch.int64)
    with pytest.raises(ConfigError, match="one length"):
        kernels.upload_triton(dst[:4], src)
    with pytest.raises(ConfigError, match="dtype"):
        kernels.upload_triton(dst, src.int())
    with pytest.raises(ConfigError, match="1-D"):
        kernels.upload_triton(dst.view(2, 4), src.view(2, 4))
    with pytest.raises(ConfigError, match="contiguous"):
        kernels.upload_triton(dst[::2], src[::2])
    if device == "cuda":
        with pytest.raises(ConfigError, match="pinned"):
            kernels.upload_triton(dst, src)
