"""Attention of a few new tokens over a long paged context, read straight from the L1 pool.

A restored request's tail (a partial page and the question) and every decode step attend
with a handful of queries over thousands of cached keys. SDPA kernels give such a call a
few dozen thread blocks, each walking the whole context (``bench/probes/rss_shapes.py``
times them), and the engine first gathers K/V out of the pool into new tensors.
``paged_attention_triton`` is split-K ("flash decoding"):

* pass 1, one program per ``(sequence, K/V head, key split, query-row block)``: loads the
  ``g * q`` query rows that share the K/V head (``g`` query heads per K/V head, folded like
  ``_folded`` so K/V are read once per head), walks its split of the context reading K/V
  rows through ``read_slots`` (no gather copy), and keeps an online softmax; writes the
  split's normalised output and log-sum-exp;
* pass 2, one program per query row, merges its splits (16 at a time) and writes
  ``[B, q, Hq, D]``, the layout transformers expects back from an attention function.

Masking follows :func:`visible`: query ``i`` of a sequence with ``ctx``
context tokens (its ``q`` new ones last) sees keys ``0 .. ctx - q + i``; keys at ``>= ctx``
(graph padding) are never read. Every launch parameter depends on shapes only, and ``ctx``
is read on the device, so the call can be captured in a CUDA graph and replayed with other
context lengths. :func:`paged_attention_torch` is the twin (gather + SDPA): the fallback and
the test oracle. Offsets are int64 (pools over 2**31 elements work).
"""

from __future__ import annotations

import functools
from typing import Any

import torch
import torch.nn.functional as F

from hicache.errors import ConfigError

try:  # Triton is optional: without it only the torch twin is available.
    import triton
    import triton.language as tl

    HAVE_TRITON = True
except ImportError:  # pragma: no cover - exercised on machines without triton
    HAVE_TRITON = False

MAX_QUERY_TOKENS = 64  # longer calls (prefills over a cached prefix) go to SDPA's own kernels


def _check(
    query: torch.Tensor, k_pool: torch.Tensor, v_pool: torch.Tensor, read_slots: torch.Tensor, ctx: torch.Tensor
) -> None:
    if query.dim() != 4 or k_pool.dim() != 3 or k_pool.shape != v_pool.shape:
        raise ConfigError(
            f"query must be [B, Hq, q, D] and the pools [slots, H, D]; got {tuple(query.shape)}, "
            f"{tuple(k_pool.shape)}, {tuple(v_pool.shape)}"
        )
    b, hq, _, d = query.shape
    h = k_pool.shape[1]
    if k_pool.shape[2] != d or hq % h:
        raise ConfigError(f"{hq} query heads of dim {d} cannot attend over {h} K/V heads of dim {k_pool.shape[2]}")
    if read_slots.dim() != 2 or read_slots.shape[0] != b or ctx.shape != (b,):
        raise ConfigError(
            f"read_slots must be [{b}, T] and ctx [{b}]; got {tuple(read_slots.shape)}, {tuple(ctx.shape)}"
        )
    if read_slots.dtype != torch.int64 or ctx.dtype != torch.int64:
        raise ConfigError(f"read_slots and ctx must be int64, got {read_slots.dtype}, {ctx.dtype}")
    devices = {t.device for t in (query, k_pool, v_pool, read_slots, ctx)}
    if len(devices) != 1:
        raise ConfigError(f"query, pools, read_slots and ctx must share a device, got {sorted(map(str, devices))}")


def visible(ctx: torch.Tensor, q: int, t: int) -> torch.Tensor:
    """``[B, 1, q, t]``: query ``i`` of a sequence with ``ctx`` context tokens (its ``q`` new
    ones last) sees keys ``0 .. ctx - q + i``; padding (keys at ``>= ctx``) is never seen."""
    rows = ctx.view(-1, 1, 1) - q + torch.arange(q, device=ctx.device).view(1, q, 1)
    return (torch.arange(t, device=ctx.device).view(1, 1, t) <= rows).unsqueeze(1)


def paged_attention_torch(
    query: torch.Tensor,
    k_pool: torch.Tensor,
    v_pool: torch.Tensor,
    read_slots: torch.Tensor,
    ctx: torch.Tensor,
    scale: float | None = None,
) -> torch.Tensor:
    """``[B, q, Hq, D]``: ``query`` (``[B, Hq, q, D]``) over the keys and values at
    ``read_slots`` (``[B, T]``) of ``k_pool``/``v_pool`` (``[slots, H, D]``), sequence ``b``
    seeing its first ``ctx[b]`` keys causally (torch twin: gather, then SDPA)."""
    _check(query, k_pool, v_pool, read_slots, ctx)
    k = k_pool[read_slots].transpose(1, 2).to(query.dtype)
    v = v_pool[read_slots].transpose(1, 2).to(query.dtype)
    mask = visible(ctx, query.shape[2], read_slots.shape[1])
    out = F.scaled_dot_product_attention(query, k, v, attn_mask=mask, scale=scale, enable_gqa=True)
    return out.transpose(1, 2).contiguous()


@functools.cache
def _programs_wanted(device: torch.device) -> int:
    """Enough programs for two waves over the device's multiprocessors."""
    if device.type == "cuda":
        return 2 * int(torch.cuda.get_device_properties(device).multi_processor_count)
    return 8


if HAVE_TRITON:

    @triton.jit
    def _split_kernel(
        q_ptr,  # [B, Hq, q, D], last dim contiguous
        k_ptr,  # [slots, H, D], last dim contiguous
        v_ptr,
        read_ptr,  # int64 [B, T], contiguous
        ctx_ptr,  # int64 [B]
        acc_ptr,  # fp32 [B * H * splits * R, BLOCK_D]: each split's normalised output
        lse_ptr,  # fp32 [B * H * splits * R]: each split's log-sum-exp (-inf: saw no key)
        sq_b,
        sq_h,
        sq_t,
        sk_slot,
        sk_h,
        sv_slot,
        sv_h,
        T,
        Q,  # new tokens per sequence
        G,  # query heads per K/V head
        H,  # K/V heads
        R,  # rows per (sequence, K/V head) = G * Q
        SPLITS,
        CHUNK,  # keys per split, a multiple of BLOCK_N
        scale,
        HEAD_DIM: tl.constexpr,
        BLOCK_D: tl.constexpr,
        BLOCK_M: tl.constexpr,
        BLOCK_N: tl.constexpr,
        PRECISION: tl.constexpr,
    ):
        pid_bh = tl.program_id(0)
        split = tl.program_id(1)
        b = (pid_bh // H).to(tl.int64)
        h = (pid_bh % H).to(tl.int64)
        rows = tl.program_id(2) * BLOCK_M + tl.arange(0, BLOCK_M)
        row_ok = rows < R
        head = h * G + rows // Q
        tok = rows % Q
        d = tl.arange(0, BLOCK_D)
        d_ok = d < HEAD_DIM
        qv = tl.load(
            q_ptr + b * sq_b + head[:, None] * sq_h + tok[:, None] * sq_t + d[None, :],
            mask=row_ok[:, None] & d_ok[None, :],
            other=0.0,
        )
        c = tl.load(ctx_ptr + b)
        limit = c - Q + tok  # the last key each row sees
        start = split * CHUNK
        end = tl.minimum(start + CHUNK, c)
        m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
        l_i = tl.zeros([BLOCK_M], tl.float32)
        acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
        for n0 in range(start, end, BLOCK_N):
            n = n0 + tl.arange(0, BLOCK_N)
            n_ok = n < end
            slot = tl.load(read_ptr + b * T + n, mask=n_ok, other=0).to(tl.int64)
            kv_ok = n_ok[:, None] & d_ok[None, :]
            k = tl.load(k_ptr + slot[:, None] * sk_slot + h * sk_h + d[None, :], mask=kv_ok, other=0.0)
            s = tl.dot(qv, tl.trans(k.to(qv.dtype)), input_precision=PRECISION) * scale
            s = tl.where(n_ok[None, :] & (n[None, :] <= limit[:, None]), s, float("-inf"))
            m_new = tl.maximum(m_i, tl.max(s, 1))
            m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
            p = tl.exp(s - m_safe[:, None])
            alpha = tl.exp(m_i - m_safe)
            l_i = l_i * alpha + tl.sum(p, 1)
            v = tl.load(v_ptr + slot[:, None] * sv_slot + h * sv_h + d[None, :], mask=kv_ok, other=0.0)
            acc = acc * alpha[:, None] + tl.dot(p.to(qv.dtype), v.to(qv.dtype), input_precision=PRECISION)
            m_i = m_new
        seen = l_i > 0
        lse = tl.where(seen, m_i + tl.log(tl.where(seen, l_i, 1.0)), float("-inf"))
        out = acc / tl.where(seen, l_i, 1.0)[:, None]
        idx = (pid_bh.to(tl.int64) * SPLITS + split) * R + rows
        tl.store(acc_ptr + idx[:, None] * BLOCK_D + d[None, :], out, mask=row_ok[:, None])
        tl.store(lse_ptr + idx, lse, mask=row_ok)

    @triton.jit
    def _merge_kernel(
        acc_ptr,
        lse_ptr,
        out_ptr,  # [B, q, Hq, D], contiguous
        Q,
        G,
        H,
        R,
        SPLITS,
        HEAD_DIM: tl.constexpr,
        BLOCK_D: tl.constexpr,
        BLOCK_S: tl.constexpr,  # splits merged per step (loaded together)
    ):
        # one program per (sequence, K/V head, row): its splits, BLOCK_S at a time
        pid = tl.program_id(0).to(tl.int64)
        row = pid % R
        bh = pid // R
        b = bh // H
        h = bh % H
        d = tl.arange(0, BLOCK_D)
        top = float("-inf")
        den = 0.0
        acc = tl.zeros([BLOCK_D], tl.float32)
        for s0 in range(0, SPLITS, BLOCK_S):
            s = s0 + tl.arange(0, BLOCK_S)
            s_ok = s < SPLITS
            idx = (bh * SPLITS + s) * R + row
            lse = tl.load(lse_ptr + idx, mask=s_ok, other=float("-inf"))
            part = tl.load(acc_ptr + idx[:, None] * BLOCK_D + d[None, :], mask=s_ok[:, None], other=0.0)
            new = tl.maximum(top, tl.max(lse, 0))
            safe = tl.where(new == float("-inf"), 0.0, new)
            old_w = tl.exp(top - safe)
            w = tl.exp(lse - safe)
            den = den * old_w + tl.sum(w, 0)
            acc = acc * old_w + tl.sum(w[:, None] * part, 0)
            top = new
        out = acc / tl.where(den > 0, den, 1.0)
        head = h * G + row // Q
        tok = row % Q
        dst = ((b * Q + tok) * (H * G) + head) * HEAD_DIM + d
        tl.store(out_ptr + dst, out.to(out_ptr.dtype.element_ty), mask=d < HEAD_DIM)


def paged_attention_triton(
    query: torch.Tensor,
    k_pool: torch.Tensor,
    v_pool: torch.Tensor,
    read_slots: torch.Tensor,
    ctx: torch.Tensor,
    scale: float | None = None,
) -> torch.Tensor:
    """:func:`paged_attention_torch` in two Triton launches (split-K over the context)."""
    if not HAVE_TRITON:
        raise ConfigError("triton is not installed")
    _check(query, k_pool, v_pool, read_slots, ctx)
    b, hq, q, d = query.shape
    h = k_pool.shape[1]
    g, t = hq // h, read_slots.shape[1]
    if query.stride(-1) != 1:
        query = query.contiguous()
    if k_pool.stride(-1) != 1 or v_pool.stride(-1) != 1 or not read_slots.is_contiguous():
        raise ConfigError("the pools' last dim and read_slots must be contiguous")
    out = torch.empty(b, q, hq, d, dtype=query.dtype, device=query.device)
    r = g * q
    block_d = triton.next_power_of_2(d)
    block_m = max(16, min(64, triton.next_power_of_2(r)))
    block_n = 64 if block_d <= 128 else 32
    m_blocks = triton.cdiv(r, block_m)
    splits = max(1, min(triton.cdiv(t, block_n), triton.cdiv(_programs_wanted(query.device), b * h * m_blocks)))
    chunk = triton.cdiv(triton.cdiv(t, splits), block_n) * block_n
    splits = triton.cdiv(t, chunk)
    acc = torch.empty(b * h * splits * r, block_d, dtype=torch.float32, device=query.device)
    lse = torch.empty(b * h * splits * r, dtype=torch.float32, device=query.device)
    precision = "ieee" if query.dtype == torch.float32 else "tf32"
    scale = d**-0.5 if scale is None else scale
    kw: dict[str, Any] = dict(HEAD_DIM=d, BLOCK_D=block_d, BLOCK_M=block_m)
    _split_kernel[(b * h, splits, m_blocks)](
        query, k_pool, v_pool, read_slots, ctx, acc, lse,
        query.stride(0), query.stride(1), query.stride(2),
        k_pool.stride(0), k_pool.stride(1), v_pool.stride(0), v_pool.stride(1),
        t, q, g, h, r, splits, chunk, scale,
        BLOCK_N=block_n, PRECISION=precision, num_warps=4, **kw,
    )  # fmt: skip
    _merge_kernel[(b * h * r,)](acc, lse, out, q, g, h, r, splits, HEAD_DIM=d, BLOCK_D=block_d, BLOCK_S=16, num_warps=2)
    return out
