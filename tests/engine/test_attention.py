"""The paged split-K attention kernel against its torch twin (gather + SDPA).

On a machine without CUDA the kernel runs under TRITON_INTERPRET=1 (tests/conftest.py), in
float32 and float16: the interpreter of Triton 3.9 computes bfloat16 dots wrongly on CPU, so
bfloat16 is checked on CUDA only (here when CUDA is present, and in tests/gpu).
"""

from __future__ import annotations

import os

import pytest
import torch

from hicache.engine import attention as paged
from hicache.errors import ConfigError

pytestmark = pytest.mark.skipif(not paged.HAVE_TRITON, reason="needs triton")
CUDA = torch.cuda.is_available()
DEVICE = "cuda" if CUDA else "cpu"
if not CUDA and os.environ.get("TRITON_INTERPRET") != "1":  # pragma: no cover
    pytestmark = pytest.mark.skip(reason="Triton on CPU needs TRITON_INTERPRET=1")

DTYPES = [torch.float32, torch.float16] + ([torch.bfloat16] if CUDA else [])


def case(
    b: int, hq: int, h: int, q: int, d: int, t: int, dtype: torch.dtype, seed: int = 0
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """A query in transformers' layout (a transposed view), pools with more slots than any
    context, scattered read slots, and per-sequence context lengths below ``t`` (padding)."""
    g = torch.Generator().manual_seed(seed)
    slots = 3 * t + 17
    k_pool = torch.randn(slots, h, d, generator=g).to(DEVICE, dtype)
    v_pool = torch.randn(slots, h, d, generator=g).to(DEVICE, dtype)
    read = torch.stack([torch.randperm(slots, generator=g)[:t] for _ in range(b)]).to(DEVICE)
    ctx = torch.randint(q, t + 1, (b,), generator=g)
    ctx[0] = t  # one sequence fills the padded length
    query = torch.randn(b, q, hq, d, generator=g).to(DEVICE, dtype).transpose(1, 2)
    return query, k_pool, v_pool, read, ctx.to(DEVICE)


def tolerance(dtype: torch.dtype) -> float:
    return {torch.float32: 1e-5, torch.float16: 2e-3}.get(dtype, 2e-2)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize(
    "shape",
    [
        (1, 4, 2, 3, 16, 40),  # a short tail, grouped heads
        (3, 8, 2, 1, 16, 70),  # a decode batch
        (2, 4, 4, 5, 24, 33),  # no grouping; a head dim that is not a power of two
        (1, 4, 1, 40, 16, 300),  # 160 query rows: several row blocks and several key splits
        (2, 6, 2, 7, 32, 129),  # three heads per group, a context one past a block
    ],
)
def test_kernel_equals_gather_and_sdpa(shape: tuple[int, int, int, int, int, int], dtype: torch.dtype) -> None:
    b, hq, h, q, d, t = shape
    query, k_pool, v_pool, read, ctx = case(b, hq, h, q, d, t, dtype)
    got = paged.paged_attention_triton(query, k_pool, v_pool, read, ctx, 0.3)
    want = paged.paged_attention_torch(query, k_pool, v_pool, read, ctx, 0.3)
    assert got.shape == want.shape and got.dtype == dtype and got.is_contiguous()
    torch.testing.assert_close(got, want, rtol=tolerance(dtype), atol=tolerance(dtype))


def test_many_key_splits_merge_in_several_steps(monkeypatch: pytest.MonkeyPatch) -> None:
    """More key splits than the merge takes in one step (16): as on a big GPU."""
    monkeypatch.setattr(paged, "_programs_wanted", lambda device: 512)
    query, k_pool, v_pool, read, ctx = case(1, 4, 2, 3, 16, 1300, torch.float32, seed=5)
    ctx[0] = 1300
    got = paged.paged_attention_triton(query, k_pool, v_pool, read, ctx, 0.3)
    want = paged.paged_attention_torch(query, k_pool, v_pool, read, ctx, 0.3)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def test_keys_past_the_context_are_never_read() -> None:
    """Graph padding: the slots past each sequence's context may hold anything (NaN here)."""
    query, k_pool, v_pool, read, ctx = case(2, 4, 2, 3, 16, 90, torch.float32)
    ctx = torch.tensor([90, 41], device=DEVICE)
    want = paged.paged_attention_triton(query, k_pool, v_pool, read, ctx)
    poisoned = read[1, 41:]
    k_pool[poisoned] = float("nan")
    v_pool[poisoned] = float("nan")
    got = paged.paged_attention_triton(query, k_pool, v_pool, read[:, :], ctx)
    torch.testing.assert_close(got[1], want[1], rtol=0, atol=0)
    assert not torch.isnan(got[1]).any()


def test_default_scale_is_one_over_sqrt_head_dim() -> None:
    query, k_pool, v_pool, read, ctx = case(1, 4, 2, 2, 16, 50, torch.float32, seed=3)
    got = paged.paged_attention_triton(query, k_pool, v_pool, read, ctx)
    torch.testing.assert_close(got, paged.paged_attention_triton(query, k_pool, v_pool, read, ctx, 0.25))


def test_bad_inputs_are_refused() -> None:
    query, k_pool, v_pool, read, ctx = case(2, 4, 2, 2, 16, 20, torch.float32)
    with pytest.raises(ConfigError, match="query heads"):
        paged.paged_attention_triton(query[:, :3], k_pool, v_pool, read, ctx)
    with pytest.raises(ConfigError, match="read_slots must be"):
        paged.paged_attention_triton(query, k_pool, v_pool, read[:1], ctx)
    with pytest.raises(ConfigError, match="int64"):
        paged.paged_attention_triton(query, k_pool, v_pool, read.int(), ctx)
    with pytest.raises(ConfigError, match=r"\[slots, H, D\]"):
        paged.paged_attention_triton(query, k_pool, v_pool[:, :1], read, ctx)
