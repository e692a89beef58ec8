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
def test_gather_and_scatter_match_torch(dtype: torch.dtype, slabs_n: int, pool: int, elems: int, n: int) -> None:
    gen = torch.Generator().manual_seed(slabs_n * 1000 + elems)
    slabs = rand((slabs_n, pool, elems), dtype, gen)
    ids = torch.randperm(pool, generator=gen)[:n].to(DEVICE)
    want = torch.full((n + 1, slabs_n, elems), float("nan"), dtype=dtype, device=DEVICE)
    got = want.clone()
    kernels.gather_torch(slabs, ids, want)
    kernels.gather_triton(slabs, ids, got)
    assert torch.equal(want[:n], got[:n])
    assert torch.equal(want[:n], slabs[:, ids].transpose(0, 1))
    assert got[n].isnan().all(), "gather wrote past its pages"
    base = rand((slabs_n, pool, elems), dtype, gen)
    a, b = base.clone(), base.clone()
    kernels.scatter_torch(want, ids, a)
    kernels.scatter_triton(want, ids, b)
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
