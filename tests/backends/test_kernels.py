"""Triton gather/scatter equal their torch twins exactly (run under TRITON_INTERPRET=1 on
CPU), on random data, odd shapes and every supported dtype."""

from __future__ import annotations

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
