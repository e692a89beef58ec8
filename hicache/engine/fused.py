"""Fewer, larger launches for the engine's decoders.

A forward of a few tokens (a decode step, a restored request's tail) is set by its kernels'
count, not by its bytes: replayed in a CUDA graph each small kernel still costs the GPU a
few microseconds. Three fusions, each tested against transformers' own code:

* :func:`rms_norm_triton`, one launch per RMSNorm (:func:`fuse_norms`);
* :func:`qkv_write_triton`, the attention prologue in one launch: the per-head query and
  key norms, the rotary embedding and the K/V writes into the pool, after one GEMM for the
  three projections (:func:`fuse_layers`);
* :func:`silu_mul_triton`, the MLP's activation in one launch, after one GEMM for the gate
  and up projections (:func:`fuse_layers`).

Each kernel rounds where torch rounds (float32 statistics and products, each result
rounded to the input's dtype as transformers' code does), so outputs agree within a rounding
of the largest value. A Qwen3 layer has four norms (transformers' ``RMSNorm.forward`` is six
elementwise kernels); its prologue was about sixteen kernels (norms, ``rotate_half``'s
slices and ``cat``, products and sums, the pool writes). Together the fusions take the
Qwen3-8B forward of a restored tail from about 2,260 kernels to about 530
(``bench/probes/forward_profile.py``; figures in docs/RESULTS.md).
"""

from __future__ import annotations

import os
import types
from typing import Any

import torch
import torch.nn.functional as F

from hicache.engine.attention import MAX_QUERY_TOKENS, paged_attention_triton
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


# --- the attention prologue and the MLP ------------------------------------------------------

ATTENTION_CLASSES = frozenset({"Qwen3Attention", "Qwen2Attention", "LlamaAttention"})
MLP_CLASSES = frozenset({"Qwen3MLP", "Qwen2MLP", "LlamaMLP"})
_SILU = frozenset({"silu", "swish"})


def _kernels_run(x: torch.Tensor) -> bool:
    """Triton runs on ``x``'s device: CUDA, or the CPU interpreter (tests)."""
    return HAVE_TRITON and (x.is_cuda or os.environ.get("TRITON_INTERPRET") == "1")


def rope_torch(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """transformers' rotary embedding of ``x`` (``[..., D]``; ``cos``/``sin`` broadcast to it):
    ``x * cos + rotate_half(x) * sin``, each product rounded to ``x.dtype``."""
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return (x * cos) + (rotated * sin)


def qkv_write_torch(
    qkv: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    norm_weights: torch.Tensor | None,
    eps: float,
    heads: int,
    kv_heads: int,
    k_pool: torch.Tensor,
    v_pool: torch.Tensor,
    slots: torch.Tensor,
) -> torch.Tensor:
    """The reference of :func:`qkv_write_triton`, as transformers computes it: per token
    row of ``qkv`` (``[N, (heads + 2 * kv_heads) * D]``), the query and key heads
    RMS-normalised over ``D`` (if ``norm_weights``, ``[2, D]``: the query norm's weight,
    then the key norm's) and rotated by ``cos``/``sin``
    (``[N, D]``); keys and values written to ``k_pool``/``v_pool`` (``[slots, kv_heads, D]``)
    at ``slots`` (``[N]``). Returns the queries, ``[N, heads, D]``."""
    n, d = qkv.shape[0], k_pool.shape[-1]
    q, k, v = torch.split(qkv.view(n, heads + 2 * kv_heads, d), [heads, kv_heads, kv_heads], dim=1)
    if norm_weights is not None:
        q, k = rms_norm_torch(q, norm_weights[0], eps), rms_norm_torch(k, norm_weights[1], eps)
    cos, sin = cos[:, None, :], sin[:, None, :]
    q, k = rope_torch(q, cos, sin), rope_torch(k, cos, sin)
    k_pool[slots] = k.to(k_pool.dtype)
    v_pool[slots] = v.to(v_pool.dtype)
    return q.contiguous()


def silu_mul_torch(gate_up: torch.Tensor) -> torch.Tensor:
    """``silu(gate) * up`` of ``gate_up = [gate | up]`` (last dim), as transformers' MLP
    computes it (each op rounded to the input's dtype)."""
    gate, up = gate_up.chunk(2, dim=-1)
    return F.silu(gate) * up


if HAVE_TRITON:

    @triton.jit
    def _qkv_write_kernel(
        qkv_ptr,  # [N, (HQ + 2 * H) * D], last dim contiguous
        cos_ptr,  # [N, D], contiguous
        sin_ptr,
        nw_ptr,  # [2, D]: the query norm's weight, then the key norm's (unused without NORM)
        q_out_ptr,  # [N, HQ, D], contiguous
        k_ptr,  # [slots, H, D], last dim contiguous
        v_ptr,
        slots_ptr,  # int64 [N]
        stride_qkv,
        sk_slot,
        sk_h,
        sv_slot,
        sv_h,
        eps,
        HQ: tl.constexpr,
        H: tl.constexpr,
        HEAD_DIM: tl.constexpr,
        NORM: tl.constexpr,
    ):
        row = tl.program_id(0).to(tl.int64)
        head = tl.program_id(1)
        HALF: tl.constexpr = HEAD_DIM // 2
        d = tl.arange(0, HALF)
        src = qkv_ptr + row * stride_qkv + head * HEAD_DIM
        x1 = tl.load(src + d)
        x2 = tl.load(src + HALF + d)
        dtype = x1.dtype
        if head < HQ + H:  # a query or key head: normalise, rotate
            if NORM:
                f1 = x1.to(tl.float32)
                f2 = x2.to(tl.float32)
                r = tl.math.rsqrt((tl.sum(f1 * f1, 0) + tl.sum(f2 * f2, 0)) / HEAD_DIM + eps)
                w_ptr = nw_ptr + (head >= HQ).to(tl.int32) * HEAD_DIM
                w1 = tl.load(w_ptr + d).to(tl.float32)
                w2 = tl.load(w_ptr + HALF + d).to(tl.float32)
                x1 = (w1 * (f1 * r).to(dtype).to(tl.float32)).to(dtype)
                x2 = (w2 * (f2 * r).to(dtype).to(tl.float32)).to(dtype)
            c1 = tl.load(cos_ptr + row * HEAD_DIM + d).to(tl.float32)
            c2 = tl.load(cos_ptr + row * HEAD_DIM + HALF + d).to(tl.float32)
            s1 = tl.load(sin_ptr + row * HEAD_DIM + d).to(tl.float32)
            s2 = tl.load(sin_ptr + row * HEAD_DIM + HALF + d).to(tl.float32)
            a1 = x1.to(tl.float32)
            a2 = x2.to(tl.float32)
            # x * cos + rotate_half(x) * sin, each product and the sum rounded as torch does
            o1 = ((a1 * c1).to(dtype).to(tl.float32) + (-a2 * s1).to(dtype).to(tl.float32)).to(dtype)
            o2 = ((a2 * c2).to(dtype).to(tl.float32) + (a1 * s2).to(dtype).to(tl.float32)).to(dtype)
            # NOTE: one name per pointer type: a name bound in both branches of a runtime
            # `if` must have one type, and the pools' dtype may differ from the queries'
            if head < HQ:
                q_dst = q_out_ptr + (row * HQ + head) * HEAD_DIM
                tl.store(q_dst + d, o1)
                tl.store(q_dst + HALF + d, o2)
            else:
                k_dst = k_ptr + tl.load(slots_ptr + row) * sk_slot + (head - HQ) * sk_h
                tl.store(k_dst + d, o1.to(k_ptr.dtype.element_ty))
                tl.store(k_dst + HALF + d, o2.to(k_ptr.dtype.element_ty))
        else:  # a value head: into the pool as it is
            v_dst = v_ptr + tl.load(slots_ptr + row) * sv_slot + (head - HQ - H) * sv_h
            tl.store(v_dst + d, x1.to(v_ptr.dtype.element_ty))
            tl.store(v_dst + HALF + d, x2.to(v_ptr.dtype.element_ty))

    @triton.jit
    def _silu_mul_kernel(gu_ptr, out_ptr, stride_gu, stride_out, N, BLOCK: tl.constexpr):
        row = tl.program_id(0).to(tl.int64)
        cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
        ok = cols < N
        g = tl.load(gu_ptr + row * stride_gu + cols, mask=ok, other=0.0)
        u = tl.load(gu_ptr + row * stride_gu + N + cols, mask=ok, other=0.0)
        gf = g.to(tl.float32)
        s = (gf / (1.0 + tl.exp(-gf))).to(g.dtype)
        tl.store(out_ptr + row * stride_out + cols, (s.to(tl.float32) * u.to(tl.float32)).to(g.dtype), mask=ok)


def qkv_write_triton(
    qkv: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    norm_weights: torch.Tensor | None,
    eps: float,
    heads: int,
    kv_heads: int,
    k_pool: torch.Tensor,
    v_pool: torch.Tensor,
    slots: torch.Tensor,
) -> torch.Tensor:
    """:func:`qkv_write_torch` in one launch, one program per (token, head): the query
    and key norms, the rotary embedding and the K/V writes into the pool that transformers
    and the engine's attention do in about sixteen kernels per layer."""
    if not HAVE_TRITON:
        raise ConfigError("triton is not installed")
    n, d = qkv.shape[0], k_pool.shape[-1]
    problems = []
    if qkv.dim() != 2 or qkv.shape[1] != (heads + 2 * kv_heads) * d or qkv.stride(-1) != 1:
        problems.append(f"qkv {tuple(qkv.shape)} is not [N, {(heads + 2 * kv_heads) * d}] with rows contiguous")
    if cos.shape != (n, d) or sin.shape != (n, d) or cos.dtype != qkv.dtype or sin.dtype != qkv.dtype:
        problems.append(f"cos/sin {tuple(cos.shape)} {cos.dtype} are not [{n}, {d}] {qkv.dtype}")
    if d < 2 or d & (d - 1):
        problems.append(f"head dim {d} is not a power of two")
    if k_pool.shape != v_pool.shape or k_pool.dim() != 3 or k_pool.shape[1] != kv_heads:
        problems.append(f"pools {tuple(k_pool.shape)}, {tuple(v_pool.shape)} are not [slots, {kv_heads}, {d}]")
    elif k_pool.stride(-1) != 1 or v_pool.stride(-1) != 1:
        problems.append("the pools' last dim is not contiguous")
    if slots.shape != (n,) or slots.dtype != torch.int64:
        problems.append(f"slots {tuple(slots.shape)} {slots.dtype} are not [{n}] int64")
    if norm_weights is not None and (norm_weights.shape != (2, d) or not norm_weights.is_contiguous()):
        problems.append(f"norm weights {tuple(norm_weights.shape)} are not [2, {d}], contiguous")
    if problems:
        raise ConfigError("qkv_write: " + "; ".join(problems))
    out = torch.empty(n, heads, d, dtype=qkv.dtype, device=qkv.device)
    if n:
        _qkv_write_kernel[(n, heads + 2 * kv_heads)](
            qkv, cos.contiguous(), sin.contiguous(), norm_weights if norm_weights is not None else cos, out,
            k_pool, v_pool, slots.contiguous(), qkv.stride(0),
            k_pool.stride(0), k_pool.stride(1), v_pool.stride(0), v_pool.stride(1), float(eps),
            HQ=heads, H=kv_heads, HEAD_DIM=d, NORM=norm_weights is not None, num_warps=1,
        )  # fmt: skip
    return out


def silu_mul_triton(gate_up: torch.Tensor) -> torch.Tensor:
    """:func:`silu_mul_torch` in one launch (any leading shape; ``gate_up``'s last dim even)."""
    if not HAVE_TRITON:
        raise ConfigError("triton is not installed")
    if gate_up.shape[-1] % 2:
        raise ConfigError(f"silu_mul: the last dim ({gate_up.shape[-1]}) is not [gate | up]")
    n = gate_up.shape[-1] // 2
    rows = gate_up.reshape(-1, 2 * n)
    if rows.numel() and rows.stride(-1) != 1:
        rows = rows.contiguous()
    out = torch.empty(rows.shape[0], n, dtype=gate_up.dtype, device=gate_up.device)
    if rows.shape[0] and n:
        block = min(1024, triton.next_power_of_2(n))
        _silu_mul_kernel[(rows.shape[0], triton.cdiv(n, block))](
            rows, out, rows.stride(0), out.stride(0), n, BLOCK=block, num_warps=4
        )
    return out.view(*gate_up.shape[:-1], n)


def _joined(*linears: Any) -> tuple[torch.Tensor, torch.Tensor | None] | None:
    """One weight (and bias) for ``linears`` side by side (rows stacked); each module's own
    weight becomes a view of it, so the model holds the bytes once. None (nothing changed)
    where some have a bias and some not."""
    biases = [m.bias for m in linears]
    if any(b is None for b in biases) and not all(b is None for b in biases):
        return None
    weight = torch.cat([m.weight.detach() for m in linears])
    bias = None if biases[0] is None else torch.cat([b.detach() for b in biases])
    at = 0
    for m in linears:
        rows = m.weight.shape[0]
        m.weight = torch.nn.Parameter(weight[at : at + rows], requires_grad=m.weight.requires_grad)
        if bias is not None:
            m.bias = torch.nn.Parameter(bias[at : at + rows], requires_grad=m.bias.requires_grad)
        at += rows
    return weight, bias


def _joined_norms(attn: Any) -> tuple[torch.Tensor | None, float]:
    """The query and key norms' weights as one ``[2, D]`` tensor (each norm's weight a view
    of it) and their epsilon; ``(None, 0.0)`` where the attention has no such norms."""
    q_norm, k_norm = getattr(attn, "q_norm", None), getattr(attn, "k_norm", None)
    if q_norm is None or k_norm is None:
        return None, 0.0
    weights = torch.stack([q_norm.weight.detach(), k_norm.weight.detach()])
    q_norm.weight = torch.nn.Parameter(weights[0], requires_grad=q_norm.weight.requires_grad)
    k_norm.weight = torch.nn.Parameter(weights[1], requires_grad=k_norm.weight.requires_grad)
    return weights, float(q_norm.variance_epsilon)


def _intact(joined: torch.Tensor | None, parts: list[torch.Tensor | None]) -> bool:
    """``parts`` are still views of ``joined``, side by side in order: nothing was rebound
    (``load_state_dict(assign=True)``, a copy), moved or cast since fusing."""
    if joined is None:
        return all(p is None for p in parts)
    at, size = joined.data_ptr(), joined.element_size()
    for p in parts:
        if p is None or p.data_ptr() != at or p.dtype != joined.dtype or p.device != joined.device:
            return False
        at += p.numel() * size
    return True


def _unfuse(module: Any) -> Any:
    """Back to transformers' code for good, the joined copies dropped: the module's weights
    are no longer views of them. Returns its plain forward."""
    plain = module._hicache_plain
    for name in [n for n in vars(module) if n.startswith("_hicache_")]:
        delattr(module, name)
    del module.forward  # the instance's: the class's own forward again
    return plain


def _attention_intact(attn: Any) -> bool:
    q, k, v = attn.q_proj, attn.k_proj, attn.v_proj
    norms = [attn.q_norm.weight, attn.k_norm.weight] if attn._hicache_norms is not None else []
    return (
        _intact(attn._hicache_qkv, [q.weight, k.weight, v.weight])
        and _intact(attn._hicache_qkv_bias, [q.bias, k.bias, v.bias])
        and (attn._hicache_norms is None or _intact(attn._hicache_norms, norms))
    )


def _fused_attention(
    self: Any,
    hidden_states: torch.Tensor,
    position_embeddings: tuple[torch.Tensor, torch.Tensor] | None = None,
    attention_mask: torch.Tensor | None = None,
    *args: Any,
    **kwargs: Any,
) -> tuple[torch.Tensor, None]:
    if not _attention_intact(self):
        return _unfuse(self)(hidden_states, position_embeddings, attention_mask, *args, **kwargs)  # type: ignore[no-any-return]
    batch = kwargs.get("hicache_batch")
    if (
        batch is None
        or batch.read_slots is None  # a fresh prefill: SDPA over the new tokens, as transformers does
        or batch.attention != "paged"
        or hidden_states.dim() != 3
        or hidden_states.shape[1] > MAX_QUERY_TOKENS
        or position_embeddings is None
        or position_embeddings[0].shape[-1] != self.head_dim
        or self._hicache_qkv.device != hidden_states.device
        or self._hicache_qkv.dtype != hidden_states.dtype
    ):
        return self._hicache_plain(hidden_states, position_embeddings, attention_mask, *args, **kwargs)  # type: ignore[no-any-return]
    b, q, _ = hidden_states.shape
    qkv = F.linear(hidden_states, self._hicache_qkv, self._hicache_qkv_bias).view(b * q, -1)
    layer = int(self.layer_idx)
    if batch.layer_ready is not None:  # a restore still landing: this layer's pages first
        batch.layer_ready[layer].wait(torch.cuda.current_stream())
    buf = batch.pool.buffer
    kv_heads, d = buf.shape[-2], buf.shape[-1]
    cos, sin = (t.expand(b, q, d).reshape(b * q, d) for t in position_embeddings)
    k_pool, v_pool = buf[0, layer].view(-1, kv_heads, d), buf[1, layer].view(-1, kv_heads, d)
    query = qkv_write_triton(
        qkv, cos, sin, self._hicache_norms, self._hicache_eps, self._hicache_heads, kv_heads, k_pool, v_pool,
        batch.write_slots.reshape(-1),
    )  # fmt: skip
    query = query.view(b, q, -1, d).transpose(1, 2)  # [B, Hq, q, D], strided
    out = paged_attention_triton(query, k_pool, v_pool, batch.read_slots, batch.ctx, self.scaling)
    return self.o_proj(out.reshape(b, q, -1)), None


def _fused_mlp(self: Any, x: torch.Tensor) -> torch.Tensor:
    gate, up = self.gate_proj, self.up_proj
    if not (
        _intact(self._hicache_gate_up, [gate.weight, up.weight])
        and _intact(self._hicache_gate_up_bias, [gate.bias, up.bias])
    ):
        return _unfuse(self)(x)  # type: ignore[no-any-return]
    if not _kernels_run(x) or self._hicache_gate_up.device != x.device or self._hicache_gate_up.dtype != x.dtype:
        return self._hicache_plain(x)  # type: ignore[no-any-return]
    gate_up = F.linear(x, self._hicache_gate_up, self._hicache_gate_up_bias)
    return self.down_proj(silu_mul_triton(gate_up))  # type: ignore[no-any-return]


def fuse_layers(net: torch.nn.Module) -> int:
    """Fewer, larger launches in ``net``'s decoder layers, for the forwards of a few tokens
    whose kernels, not their bytes, set the time (decode, a restored request's tail):

    * attention (classes in :data:`ATTENTION_CLASSES`): one GEMM for the query, key and value
      projections, then :func:`qkv_write_triton`, then the paged kernel. Only where the
      batch attends with ``"paged"`` over a cached context with at most
      ``MAX_QUERY_TOKENS`` new tokens; every other forward runs transformers' code;
    * the MLP (classes in :data:`MLP_CLASSES` with a SiLU gate): one GEMM for the gate and
      up projections, then :func:`silu_mul_triton`, on every forward where Triton runs.

    The projections' weights become views of the joined ones (no second copy). An attention
    whose head dim is not a power of two, or whose projections have a bias only in part,
    stays as it is. Returns how many modules were patched; a no-op without Triton. Fuse
    after moving and loading the model: a module whose weights are later rebound, moved or
    cast (no longer views of the joined ones) goes back to transformers' code at its next
    forward and drops the joined copies; in-place loads (``load_state_dict``) keep it fused."""
    if not HAVE_TRITON:
        return 0
    count = 0
    for each in net.modules():
        module: Any = each  # transformers' modules: attributes by family
        name = type(module).__name__
        if name in ATTENTION_CLASSES and "forward" not in vars(module) and hasattr(module, "o_proj"):
            d = int(module.head_dim)
            if d < 2 or d & (d - 1):  # the prologue kernel's rows are powers of two
                continue
            joined = _joined(module.q_proj, module.k_proj, module.v_proj)
            if joined is None:
                continue
            module._hicache_qkv, module._hicache_qkv_bias = joined
            module._hicache_heads = module.q_proj.weight.shape[0] // d
            module._hicache_norms, module._hicache_eps = _joined_norms(module)
            module._hicache_plain = module.forward
            module.forward = types.MethodType(_fused_attention, module)
            count += 1
        elif name in MLP_CLASSES and "forward" not in vars(module):
            act = getattr(getattr(module, "config", None), "hidden_act", None)
            if act not in _SILU:
                continue
            joined = _joined(module.gate_proj, module.up_proj)
            if joined is None:
                continue
            module._hicache_gate_up, module._hicache_gate_up_bias = joined
            module._hicache_plain = module.forward
            module.forward = types.MethodType(_fused_mlp, module)
            count += 1
    return count
