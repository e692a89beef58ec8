"""The one-kernel RMSNorm against transformers' formula, and its installation in a model.

On CPU the kernel runs under TRITON_INTERPRET=1 (tests/conftest.py) in float32 and float16;
bfloat16 is checked on CUDA only (the interpreter rounds bfloat16 differently from the GPU).
"""

from __future__ import annotations

import os

import pytest
import torch

from hicache.backends.pools import DevicePool
from hicache.engine import ModelRunner, build_model, fused, kv_geometry
from hicache.errors import ConfigError

CUDA = torch.cuda.is_available()
DEVICE = "cuda" if CUDA else "cpu"
RUNS = fused.HAVE_TRITON and (CUDA or os.environ.get("TRITON_INTERPRET") == "1")
needs_kernel = pytest.mark.skipif(not RUNS, reason="needs triton on CUDA or TRITON_INTERPRET=1")
DTYPES = [torch.float32, torch.float16] + ([torch.bfloat16] if CUDA else [])


def reference(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """transformers' Qwen3RMSNorm.forward, spelled out (not the module's own helper)."""
    h = x.to(torch.float32)
    variance = h.pow(2).mean(-1, keepdim=True)
    h = h * torch.rsqrt(variance + eps)
    return weight * h.to(x.dtype)


@needs_kernel
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("shape", [(3, 4096), (2, 5, 4, 128), (1, 100), (7, 1)], ids=str)
def test_kernel_matches_the_formula(dtype: torch.dtype, shape: tuple[int, ...]) -> None:
    """Every element within one rounding of transformers' result, for rows of any width
    (powers of two and not) and leading shapes (the per-head query/key norms are 4-D)."""
    g = torch.Generator().manual_seed(len(shape) * 31 + shape[-1])
    x = (3 * torch.randn(shape, generator=g)).to(DEVICE, dtype)
    w = torch.randn(shape[-1], generator=g).to(DEVICE, dtype)
    got = fused.rms_norm_triton(x, w, 1e-6)
    want = reference(x, w, 1e-6)
    assert got.shape == x.shape and got.dtype == dtype
    ulp = {torch.float32: 1e-6, torch.float16: 1e-3, torch.bfloat16: 8e-3}[dtype]
    torch.testing.assert_close(got.float(), want.float(), rtol=ulp, atol=ulp)


@needs_kernel
def test_kernel_normalises_each_row_on_its_own() -> None:
    """Rows of very different scales each come out at unit RMS (times the weight): a
    kernel that mixed rows, or read past a row's end, would not."""
    x = torch.stack([torch.full((64,), 1e-3), torch.full((64,), 50.0), torch.arange(64.0)]).to(DEVICE)
    w = torch.ones(64, device=DEVICE)
    out = fused.rms_norm_triton(x, w, 0.0)
    rms = out.pow(2).mean(-1).sqrt()
    torch.testing.assert_close(rms, torch.ones(3, device=DEVICE), rtol=1e-5, atol=1e-5)
    assert torch.all(out[2, 1:] > out[2, :-1])  # order within a row kept


@needs_kernel
def test_kernel_reads_strided_rows() -> None:
    """A view whose rows are not contiguous (a transposed tensor) gives the same result as
    its contiguous copy; the input is not modified."""
    base = torch.randn(128, 6, device=DEVICE)
    view = base.t()  # rows of 128, stride 1 apart: not contiguous
    before = base.clone()
    w = torch.randn(128, device=DEVICE)
    torch.testing.assert_close(fused.rms_norm_triton(view, w, 1e-6), reference(view.contiguous(), w, 1e-6))
    assert torch.equal(base, before)


@needs_kernel
def test_kernel_accepts_no_rows() -> None:
    """Zero rows in, zero rows out (no launch)."""
    out = fused.rms_norm_triton(torch.empty(0, 32, device=DEVICE), torch.ones(32, device=DEVICE), 1e-6)
    assert out.shape == (0, 32)


@pytest.mark.skipif(not fused.HAVE_TRITON, reason="needs triton")
@pytest.mark.parametrize(
    ("x", "w", "match"),
    [
        (torch.ones(2, 8), torch.ones(4), r"weight \(4,\)"),
        (torch.ones(2, 8), torch.ones(8, dtype=torch.float16), "float16"),
        (torch.ones(1, fused.MAX_WIDTH + 1), torch.ones(fused.MAX_WIDTH + 1), "exceed"),
    ],
    ids=["width", "dtype", "too-wide"],
)
def test_kernel_refuses_mismatched_weights(x: torch.Tensor, w: torch.Tensor, match: str) -> None:
    """A weight of another length or dtype, or a row too wide for one program, is a
    ConfigError naming it, before any launch."""
    with pytest.raises(ConfigError, match=match):
        fused.rms_norm_triton(x, w, 1e-6)


@pytest.mark.skipif(not fused.HAVE_TRITON, reason="needs triton")
def test_fuse_norms_patches_every_norm_and_keeps_the_output() -> None:
    """Every RMSNorm of a Qwen3 model (four per layer and the final one) is patched, and
    the model's logits are unchanged on CPU (where the patched forward is the formula)."""
    net = build_model("tiny", fused_norms=False)
    layers = int(net.config.num_hidden_layers)  # type: ignore[union-attr, arg-type]
    pool = DevicePool.allocate(kv_geometry(net, 4), 4, "cpu")
    seq = [([5, 17, 3, 99, 42, 7], [0, 1], 0)]
    before = ModelRunner(net, pool, attention="gqa").forward(seq)
    assert fused.fuse_norms(net) == 4 * layers + 1
    patched = [m for m in net.modules() if type(m).__name__ == "Qwen3RMSNorm"]
    assert len(patched) == 4 * layers + 1
    assert all(m.forward.__func__ is fused._fused_forward for m in patched)  # type: ignore[attr-defined]
    assert torch.equal(ModelRunner(net, pool, attention="gqa").forward(seq), before)


def test_build_model_fuses_only_where_asked() -> None:
    """``fused_norms=None`` fuses on CUDA only; False never; True patches on any device."""
    plain = build_model("tiny")
    assert not any("forward" in vars(m) for m in plain.modules())
    if fused.HAVE_TRITON:
        forced = build_model("tiny", fused_norms=True)
        assert sum("forward" in vars(m) for m in forced.modules()) == 4 * int(forced.config.num_hidden_layers) + 1  # type: ignore[union-attr, arg-type]
