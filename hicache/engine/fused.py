"""RMSNorm in one kernel for the engine's decoders.

A restored request's tail and every decode step run a few rows through each norm, and a Qwen3
layer has four of them (input, post-attention, and the per-head query and key norms).
transformers' ``RMSNorm.forward`` is six elementwise kernels (cast, square, mean, rsqrt,
scale, weight); replayed in a CUDA graph each still costs the GPU a few microseconds, about
a thousand of them per forward of a 36-layer model. :func:`rms_norm_triton` is one launch
that computes the same formula in the same precisions (float32 statistics, the normalised
row rounded to the input's dtype before the weight multiplies it); :func:`fuse_norms` puts
it under a model's norm modules. :func:`rms_norm_torch` is the reference it is tested against.
"""

from __future__ import annotations

import types
from typing import Any

import torch

from hicache.errors import ConfigError

try:  # Triton is optional: without it the norms stay as transformers wrote them.
    import triton
    import triton.language as tl

    HAVE_TRITON = True
except ImportError:  # pragma: no cover - exercised on machines without triton
    HAVE_TRITON = False

# The norm classes of the families the engine builds whose forward is the formula below.
NORM_CLASSES = frozenset({"Qwen3RMSNorm", "Qwen2RMSNorm", "LlamaRMSNorm"})
MAX_WIDTH = 1 << 16  # one program holds a whole row


def rms_norm_torch(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """transformers' RMSNorm: float32 statistics, the row rounded to ``x.dtype``, times ``weight``."""
    h = x.to(torch.float32)
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    return weight * h.to(x.dtype)


if HAVE_TRITON:

    @triton.jit
    def _rms_norm_kernel(x_ptr, w_ptr, out_ptr, stride_x, stride_out, N, eps, BLOCK: tl.constexpr):
        row = tl.program_id(0).to(tl.int64)
        cols = tl.arange(0, BLOCK)
        ok = cols < N
        x = tl.load(x_ptr + row * stride_x + cols, mask=ok, other=0.0).to(tl.float32)
        var = tl.sum(x * x, 0) / N
        h = (x * tl.math.rsqrt(var + eps)).to(out_ptr.dtype.element_ty)
        w = tl.load(w_ptr + cols, mask=ok, other=0.0)
        y = w.to(tl.float32) * h.to(tl.float32)
        tl.store(out_ptr + row * stride_out + cols, y.to(out_ptr.dtype.element_ty), mask=ok)


def rms_norm_triton(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """:func:`rms_norm_torch` in one launch, one program per row (any leading shape; the
    last dim must be ``weight``'s length and no wider than :data:`MAX_WIDTH`)."""
    if not HAVE_TRITON:
        raise ConfigError("triton is not installed")
    n = x.shape[-1]
    if weight.shape != (n,) or weight.dtype != x.dtype or weight.device != x.device:
        raise ConfigError(
            f"rms_norm: weight {tuple(weight.shape)} {weight.dtype} on {weight.device} for rows of {n} "
            f"{x.dtype} on {x.device}"
        )
    if n > MAX_WIDTH:
        raise ConfigError(f"rms_norm: rows of {n} elements exceed {MAX_WIDTH}")
    rows = x.reshape(-1, n)
    if rows.numel() and rows.stride(-1) != 1:
        rows = rows.contiguous()
    out = torch.empty(rows.shape, dtype=x.dtype, device=x.device)
    if rows.shape[0]:
        block = triton.next_power_of_2(n)
        warps = max(1, min(8, block // 512))
        _rms_norm_kernel[(rows.shape[0],)](
            rows, weight.contiguous(), out, rows.stride(0), out.stride(0), n, float(eps), BLOCK=block, num_warps=warps
        )
    return out.view(x.shape)


def _fused_forward(self: Any, hidden_states: torch.Tensor) -> torch.Tensor:
    if hidden_states.dtype != self.weight.dtype or not hidden_states.is_cuda or hidden_states.shape[-1] > MAX_WIDTH:
        return rms_norm_torch(hidden_states, self.weight, self.variance_epsilon)
    return rms_norm_triton(hidden_states, self.weight, self.variance_epsilon)


def fuse_norms(net: torch.nn.Module) -> int:
    """Run ``net``'s RMSNorm modules (classes in :data:`NORM_CLASSES`) through
    :func:`rms_norm_triton`; returns how many. A no-op without Triton."""
    if not HAVE_TRITON:
        return 0
    count = 0
    for module in net.modules():
        if type(module).__name__ in NORM_CLASSES and hasattr(module, "variance_epsilon"):
            module.forward = types.MethodType(_fused_forward, module)
            count += 1
    return count
