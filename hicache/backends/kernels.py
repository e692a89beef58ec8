"""Gather L1 pages into a packed page-major buffer, and scatter them back (DESIGN.md §6).

Views (``E = page_size * kv_heads * head_dim`` elements, ``S = 2 * layers`` slabs)::

    L1 slabs   [S, P, E]        slab s of physical page p at ((s * P) + p) * E
    packed     [n, S, E]        logical page i, slab s at ((i * S) + s) * E  (= L2 page layout)

gather: ``packed[i, s] = slabs[s, ids[i]]``; scatter: ``slabs[s, ids[i]] = packed[i, s]``.
The Triton kernels give each program one ``(i, s)`` row and a BLOCK of its E elements, so
every load and store is contiguous; offsets are int64 (pools over 2**31 elements work).
Each kernel has a torch twin (``*_torch``): the fallback and the test oracle.
"""

from __future__ import annotations

import contextlib
from collections.abc import Sequence
from typing import Any

import torch

from hicache.errors import ConfigError

try:  # Triton is optional: without it only the torch twins are available.
    import triton
    import triton.language as tl

    HAVE_TRITON = True
except ImportError:  # pragma: no cover - exercised on machines without triton
    HAVE_TRITON = False


def _check(slabs: torch.Tensor, ids: torch.Tensor, packed: torch.Tensor, packed_ids: torch.Tensor | None) -> None:
    if slabs.dim() != 3 or packed.dim() != 3:
        raise ConfigError(
            f"slabs must be [S, P, E] and packed [n, S, E]; got {tuple(slabs.shape)}, {tuple(packed.shape)}"
        )
    s, _, e = slabs.shape
    if packed.shape[1:] != (s, e) or (packed_ids is None and packed.shape[0] < ids.numel()):
        raise ConfigError(
            f"packed {tuple(packed.shape)} does not fit {ids.numel()} pages of slabs {tuple(slabs.shape)}"
        )
    if slabs.dtype != packed.dtype:
        raise ConfigError(f"dtype mismatch: slabs {slabs.dtype}, packed {packed.dtype}")
    for name, t in (("ids", ids), ("packed_ids", packed_ids)):
        if t is None:
            continue
        if t.dtype != torch.int64 or t.dim() != 1:
            raise ConfigError(f"{name} must be a 1-D int64 tensor, got {t.dtype} {tuple(t.shape)}")
        if t.device != slabs.device:
            raise ConfigError(f"{name} must be on {slabs.device}, got {t.device}")
    if packed_ids is not None and packed_ids.numel() != ids.numel():
        raise ConfigError(f"{ids.numel()} pages for {packed_ids.numel()} packed pages")
    if packed.device != slabs.device and not (packed_ids is not None and packed.is_pinned() and slabs.is_cuda):
        raise ConfigError(
            f"devices differ: slabs {slabs.device}, packed {packed.device} (only a pinned L2 pool, "
            "addressed by page ids, may be read or written in place)"
        )
    if not (slabs.is_contiguous() and packed.is_contiguous() and ids.is_contiguous()):
        raise ConfigError("slabs, packed and ids must be contiguous")
    if packed_ids is not None and not packed_ids.is_contiguous():
        raise ConfigError("packed_ids must be contiguous")


def gather_torch(
    slabs: torch.Tensor, ids: torch.Tensor, packed: torch.Tensor, packed_ids: torch.Tensor | None = None
) -> None:
    """``packed[i, s] = slabs[s, ids[i]]`` for ``i < len(ids)``; with ``packed_ids``,
    ``packed[packed_ids[i], s]`` (torch twin; one device only)."""
    _check(slabs, ids, packed, packed_ids)
    rows = slabs.index_select(1, ids).transpose(0, 1)
    if packed_ids is None:
        packed[: ids.numel()].copy_(rows)
    else:
        packed.index_copy_(0, packed_ids, rows.to(packed.device))


def scatter_torch(
    packed: torch.Tensor, ids: torch.Tensor, slabs: torch.Tensor, packed_ids: torch.Tensor | None = None
) -> None:
    """``slabs[s, ids[i]] = packed[i, s]`` for ``i < len(ids)``; with ``packed_ids``, from
    ``packed[packed_ids[i], s]`` (torch twin; one device only)."""
    _check(slabs, ids, packed, packed_ids)
    rows = packed[: ids.numel()] if packed_ids is None else packed.index_select(0, packed_ids.to(packed.device))
    slabs.index_copy_(1, ids, rows.to(slabs.device).transpose(0, 1))


if HAVE_TRITON:

    @triton.jit
    def _gather_kernel(
        slabs_ptr,  # L1 slabs [S, P, E], contiguous
        ids_ptr,  # int64 [n]: physical L1 page of logical page i
        packed_ptr,  # packed [n, S, E] (or, with PACKED_IDS, L2 slabs [P2, S, E]), contiguous
        packed_ids_ptr,  # int64 [n]: row of packed for page i (read only with PACKED_IDS)
        pool_pages,  # P
        num_slabs,  # S = 2 * layers
        page_elements,  # E
        PACKED_IDS: tl.constexpr,  # packed rows are addressed through packed_ids
        BLOCK: tl.constexpr,  # elements per program along E
    ):
        row = tl.program_id(0).to(tl.int64)  # i * S + s
        col = tl.program_id(1).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
        mask = col < page_elements
        page = row // num_slabs
        slab = row % num_slabs
        phys = tl.load(ids_ptr + page).to(tl.int64)
        if PACKED_IDS:  # noqa: SIM108 (a constexpr branch, resolved at compile time)
            out = tl.load(packed_ids_ptr + page).to(tl.int64) * num_slabs + slab
        else:
            out = row
        vals = tl.load(slabs_ptr + (slab * pool_pages + phys) * page_elements + col, mask=mask)
        tl.store(packed_ptr + out * page_elements + col, vals, mask=mask)

    @triton.jit
    def _scatter_kernel(
        packed_ptr,  # packed [n, S, E] (or, with PACKED_IDS, L2 slabs [P2, S, E]), contiguous
        ids_ptr,  # int64 [n]: physical L1 page of logical page i
        slabs_ptr,  # L1 slabs [S, P, E], contiguous
        packed_ids_ptr,  # int64 [n]: row of packed for page i (read only with PACKED_IDS)
        pool_pages,  # P
        num_slabs,  # S = 2 * layers
        page_elements,  # E
        PACKED_IDS: tl.constexpr,  # packed rows are addressed through packed_ids
        BLOCK: tl.constexpr,  # elements per program along E
    ):
        row = tl.program_id(0).to(tl.int64)
        col = tl.program_id(1).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
        mask = col < page_elements
        page = row // num_slabs
        slab = row % num_slabs
        phys = tl.load(ids_ptr + page).to(tl.int64)
        if PACKED_IDS:  # noqa: SIM108 (a constexpr branch, resolved at compile time)
            src = tl.load(packed_ids_ptr + page).to(tl.int64) * num_slabs + slab
        else:
            src = row
        vals = tl.load(packed_ptr + src * page_elements + col, mask=mask)
        tl.store(slabs_ptr + (slab * pool_pages + phys) * page_elements + col, vals, mask=mask)


# Elements per program along E, and warps per program: bench/probes/transfer_probe.py sweeps
# both (device time, launches queued); 2048 x 8 warps led its sweep at 64 and 256 Qwen3-8B
# pages on an H200. bench/transfer.py times blocks 1024 and 16384 beside it in every run.
BLOCK = 2048
WARPS = 8


def _launch(
    kernel: Any,
    a: torch.Tensor,
    ids: torch.Tensor,
    b: torch.Tensor,
    slabs: torch.Tensor,
    packed_ids: Any,
    block: int | None,
    warps: int | None = None,
) -> None:
    if not HAVE_TRITON:
        raise ConfigError("triton is not installed")
    for name, value in (("block", block), ("warps", warps)):
        if value is not None and (value < 1 or value & (value - 1)):
            raise ConfigError(f"{name} must be a power of two, got {value}")
    n = ids.numel()
    if n == 0:
        return
    s, p, e = slabs.shape
    block = min(block or BLOCK, triton.next_power_of_2(e))
    grid = (n * s, triton.cdiv(e, block))
    kernel[grid](
        a,
        ids,
        b,
        ids if packed_ids is None else packed_ids,
        p,
        s,
        e,
        PACKED_IDS=packed_ids is not None,
        BLOCK=block,
        num_warps=warps or (4 if block <= 1024 else max(WARPS, block // 1024)),
    )


def gather_triton(
    slabs: torch.Tensor,
    ids: torch.Tensor,
    packed: torch.Tensor,
    packed_ids: torch.Tensor | None = None,
    *,
    block: int | None = None,
    warps: int | None = None,
) -> None:
    """:func:`gather_torch` with one Triton launch. With ``packed_ids``, ``packed`` may be
    the pinned L2 pool itself: the kernel writes host memory in place (a D2H without DMA).
    ``block``: elements per program (a power of two; default :data:`BLOCK`); ``warps``:
    warps per program (default from the block)."""
    _check(slabs, ids, packed, packed_ids)
    _launch(_gather_kernel, slabs, ids, packed, slabs, packed_ids, block, warps)


def scatter_triton(
    packed: torch.Tensor,
    ids: torch.Tensor,
    slabs: torch.Tensor,
    packed_ids: torch.Tensor | None = None,
    *,
    block: int | None = None,
    warps: int | None = None,
) -> None:
    """:func:`scatter_torch` with one Triton launch. With ``packed_ids``, ``packed`` may be
    the pinned L2 pool itself: the kernel reads host memory in place (an H2D without DMA)."""
    _check(slabs, ids, packed, packed_ids)
    _launch(_scatter_kernel, packed, ids, slabs, slabs, packed_ids, block, warps)


# -- layer-ranged loads (the layered H2D) ---------------------------------------------------
#
# A restore that hands its pages to the model layer by layer (attention of layer l waits only
# for layer l) needs the H2D in layer order. L2 is page-major (one DMA per run), so layer l
# of n pages is 2n strided pieces. ``load_layers_triton`` moves layers ``[lo, hi)`` of n
# pages into L1 from either
#
#   src [P2, 2*L, E]        the pinned L2 pool, read in place over PCIe (zero-copy), or
#   src [n, 2*(hi-lo), E]   a compact device workspace (``compact``): per page the K slabs of
#                           those layers, then their V slabs (what strided DMAs put there).


def _check_load(
    src: torch.Tensor,
    src_ids: torch.Tensor,
    dst: torch.Tensor,
    dst_ids: torch.Tensor,
    layers: tuple[int, int],
    compact: bool,
) -> None:
    if dst.dim() != 3 or dst.shape[0] % 2:
        raise ConfigError(f"dst must be L1 slabs [S, P1, E] with S = 2 * layers, got {tuple(dst.shape)}")
    lo, hi = layers
    if not 0 <= lo < hi <= dst.shape[0] // 2:
        raise ConfigError(f"layers [{lo}, {hi}) outside [0, {dst.shape[0] // 2})")
    want = 2 * (hi - lo) if compact else dst.shape[0]
    if src.dim() != 3 or src.shape[1] != want or src.shape[2] != dst.shape[2]:
        raise ConfigError(
            f"src must be {'a compact workspace [n, 2*(hi-lo), E]' if compact else 'L2 slabs [P2, S, E]'} for dst "
            f"[S, P1, E] = {tuple(dst.shape)} and layers {layers}; got {tuple(src.shape)}"
        )
    if src.dtype != dst.dtype:
        raise ConfigError(f"dtype mismatch: src {src.dtype}, dst {dst.dtype}")
    for name, ids in (("src_ids", src_ids), ("dst_ids", dst_ids)):
        if ids.dtype != torch.int64 or ids.dim() != 1 or not ids.is_contiguous():
            raise ConfigError(f"{name} must be a contiguous 1-D int64 tensor, got {ids.dtype} {tuple(ids.shape)}")
        if ids.device != dst.device:
            raise ConfigError(f"{name} must be on {dst.device}, got {ids.device}")
    if src_ids.numel() != dst_ids.numel():
        raise ConfigError(f"{src_ids.numel()} source pages for {dst_ids.numel()} destination pages")
    if not (src.is_contiguous() and dst.is_contiguous()):
        raise ConfigError("src and dst must be contiguous")


def load_layers_torch(
    src: torch.Tensor,
    src_ids: torch.Tensor,
    dst: torch.Tensor,
    dst_ids: torch.Tensor,
    layers: tuple[int, int],
    *,
    compact: bool = False,
) -> None:
    """``dst[kv * L + l, dst_ids[i]] = src[src_ids[i], kv * L + l]`` for K/V ``kv`` and
    layers ``l`` in ``[layers[0], layers[1])``; a ``compact`` source holds only those
    layers (``src[i, kv * (hi - lo) + l - lo]``). Torch twin; the source is gathered on its
    own device first."""
    _check_load(src, src_ids, dst, dst_ids, layers, compact)
    half = dst.shape[0] // 2
    lo, hi = layers

    def slabs(device: torch.device, base: int, stride: int) -> torch.Tensor:  # made where used: no upload
        k = torch.arange(base, base + hi - lo, device=device)
        return torch.cat([k, k + stride])

    picked = slabs(src.device, 0, hi - lo) if compact else slabs(src.device, lo, half)
    rows = src.index_select(0, src_ids.to(src.device)).index_select(1, picked)
    dst[slabs(dst.device, lo, half).view(-1, 1), dst_ids.view(1, -1)] = rows.transpose(0, 1).to(dst.device)


if HAVE_TRITON:

    @triton.jit
    def _load_kernel(
        src_ptr,  # L2 slabs [P2, S, E] (pinned host memory on CUDA) or a compact [n, 2*count, E]
        src_ids_ptr,  # int64 [n]: source page (row) of page i
        dst_ptr,  # L1 slabs [S, P1, E], contiguous
        dst_ids_ptr,  # int64 [n]: L1 page of page i
        dst_pages,  # P1
        half,  # S // 2 = layers
        layer_lo,
        layer_count,
        src_half,  # slabs per K (or V) in a source page: layers, or layer_count if compact
        src_lo,  # the first layer's index among them: layer_lo, or 0 if compact
        page_elements,  # E
        rows,  # n * 2 * layer_count
        BLOCK: tl.constexpr,
    ):
        # rows r = pid, pid + programs, ...: a grid smaller than the rows leaves SMs to others
        col = tl.program_id(1).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
        mask = col < page_elements
        for r in range(tl.program_id(0), rows, tl.num_programs(0)):
            row = tl.cast(r, tl.int64)  # (i * 2 + kv) * layer_count + (layer - layer_lo)
            i = row // (2 * layer_count)
            kv = (row // layer_count) % 2
            layer = row % layer_count
            src_page = tl.load(src_ids_ptr + i).to(tl.int64)
            dst_page = tl.load(dst_ids_ptr + i).to(tl.int64)
            src_slab = src_page * 2 * src_half + kv * src_half + src_lo + layer
            vals = tl.load(src_ptr + src_slab * page_elements + col, mask=mask)
            dst_slab = kv * half + layer_lo + layer
            tl.store(dst_ptr + (dst_slab * dst_pages + dst_page) * page_elements + col, vals, mask=mask)


def load_layers_triton(
    src: torch.Tensor,
    src_ids: torch.Tensor,
    dst: torch.Tensor,
    dst_ids: torch.Tensor,
    layers: tuple[int, int],
    *,
    programs: int | None = None,
    compact: bool = False,
) -> None:
    """:func:`load_layers_torch` in one Triton launch that reads ``src`` where it lies.
    With ``programs``, at most that many programs per column block loop over the rows (a
    load that runs beside a forward then takes only a few SMs)."""
    if not HAVE_TRITON:
        raise ConfigError("triton is not installed")
    _check_load(src, src_ids, dst, dst_ids, layers, compact)
    if dst.is_cuda and not src.is_cuda and not src.is_pinned():
        raise ConfigError("a CUDA load reads host memory in place: src must be pinned (an L2 HostPool's slabs)")
    if programs is not None and programs < 1:
        raise ConfigError(f"programs must be >= 1, got {programs}")
    n = dst_ids.numel()
    if n == 0:
        return
    s, p, e = dst.shape
    lo, hi = layers
    count = hi - lo
    rows = n * 2 * count
    block = min(4096, triton.next_power_of_2(e))
    grid = (min(rows, programs or rows), triton.cdiv(e, block))
    _load_kernel[grid](
        src,
        src_ids,
        dst,
        dst_ids,
        p,
        s // 2,
        lo,
        count,
        count if compact else s // 2,
        0 if compact else lo,
        e,
        rows,
        BLOCK=block,
        num_warps=4 if block <= 1024 else 8,
    )


if HAVE_TRITON:

    @triton.jit
    def _upload_kernel(src_ptr, dst_ptr, n, BLOCK: tl.constexpr):
        at = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
        mask = at < n
        tl.store(dst_ptr + at, tl.load(src_ptr + at, mask=mask), mask=mask)


UPLOAD_BLOCK = 1024


def upload_triton(dst: torch.Tensor, src: torch.Tensor) -> None:
    """``dst.copy_(src)`` for a small pinned host ``src`` and a device ``dst`` (1-D, same
    dtype and length), by the SMs reading ``src`` in place instead of by a DMA.

    NOTE: a DMA queues on the copy engine behind every copy issued before it, so a
    forward's few bytes of metadata uploaded while a restore streams hundreds of MiB H2D
    would start only once the restore had landed (the layered prefill ran after the whole
    copy, and decode stalled beside it). A kernel queues only behind its own stream."""
    if not HAVE_TRITON:
        raise ConfigError("triton is not installed")
    if dst.dim() != 1 or src.dim() != 1 or dst.numel() != src.numel() or dst.dtype != src.dtype:
        raise ConfigError(
            f"upload needs 1-D tensors of one length and dtype, got {src.dtype} {tuple(src.shape)} -> "
            f"{dst.dtype} {tuple(dst.shape)}"
        )
    if not (dst.is_contiguous() and src.is_contiguous()):
        raise ConfigError("upload needs contiguous tensors")
    if dst.is_cuda and not src.is_cuda and not src.is_pinned():
        raise ConfigError("a CUDA upload reads host memory in place: src must be pinned")
    upload_unchecked(dst, src)


def upload_unchecked(dst: torch.Tensor, src: torch.Tensor) -> None:
    """:func:`upload_triton` without its checks, for a caller that uploads every forward
    from one buffer it checked once (the model runner's pinned staging buffer).

    NOTE: Triton launches on the current device; the caller keeps ``src`` alive (and
    unchanged) until the kernel has run, e.g. behind an event recorded after this call."""
    n = dst.numel()
    if not n:
        return
    with torch.cuda.device(dst.device) if dst.is_cuda else contextlib.nullcontext():
        _upload_kernel[(triton.cdiv(n, UPLOAD_BLOCK),)](src, dst, n, BLOCK=UPLOAD_BLOCK, num_warps=4)


def warm_load_layers(
    dst: torch.Tensor,
    groups: Sequence[tuple[int, int]],
    *,
    programs: int | None = None,
    src: torch.Tensor | None = None,
) -> int:
    """Compile every variant of :func:`load_layers_triton` that a layered H2D into ``dst``
    (L1's slabs, ``[S, P, E]``) by ``groups`` of layers can launch; returns the launches.

    Triton specializes integer arguments on divisibility by 16 (and on equality to 1), so
    the first launch with a new row count (``2 * pages * layers``) may compile afresh, on
    the host, between the copy's timing events, and a transfer's cost sample then holds a
    compile. Each group is launched from a compact workspace with 1 page and with 8 (row
    counts ``2 * count`` and ``16 * count``: both residues), and, given ``src`` (the L2
    pool's slabs, read in place for fragmented pages), from it as well, into a scratch pool
    of ``dst``'s layout whose page count specializes as ``P`` does. ``dst`` and ``src``
    are never written."""
    s, p, e = dst.shape
    pages = p if p <= 17 else (16 if p % 16 == 0 else 17)
    scratch = torch.empty((s, pages, e), dtype=dst.dtype, device=dst.device)
    sizes = sorted({1, min(8, pages)})
    if src is not None:
        sizes = sorted({min(n, src.shape[0]) for n in sizes})
    work = torch.zeros((sizes[-1], s, e), dtype=dst.dtype, device=dst.device)
    launches = 0
    for lo, hi in groups:
        for n in sizes:
            ids = torch.arange(n, device=dst.device)
            compact = work.view(-1)[: n * 2 * (hi - lo) * e].view(n, 2 * (hi - lo), e)
            load_layers_triton(compact, ids, scratch, ids, (lo, hi), programs=programs, compact=True)
            launches += 1
            if src is not None:
                load_layers_triton(src, ids, scratch, ids, (lo, hi), programs=programs)
                launches += 1
    return launches
