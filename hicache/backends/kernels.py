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


def _check(slabs: torch.Tensor, ids: torch.Tensor, packed: torch.Tensor) -> None:
    if slabs.dim() != 3 or packed.dim() != 3:
        raise ConfigError(
            f"slabs must be [S, P, E] and packed [n, S, E]; got {tuple(slabs.shape)}, {tuple(packed.shape)}"
        )
    s, _, e = slabs.shape
    if packed.shape[1:] != (s, e) or packed.shape[0] < ids.numel():
        raise ConfigError(
            f"packed {tuple(packed.shape)} does not fit {ids.numel()} pages of slabs {tuple(slabs.shape)}"
        )
    if slabs.dtype != packed.dtype:
        raise ConfigError(f"dtype mismatch: slabs {slabs.dtype}, packed {packed.dtype}")
    if slabs.device != packed.device or ids.device != slabs.device:
        raise ConfigError(f"devices differ: slabs {slabs.device}, packed {packed.device}, ids {ids.device}")
    if ids.dtype != torch.int64 or ids.dim() != 1:
        raise ConfigError(f"ids must be a 1-D int64 tensor, got {ids.dtype} {tuple(ids.shape)}")
    if not (slabs.is_contiguous() and packed.is_contiguous() and ids.is_contiguous()):
        raise ConfigError("slabs, packed and ids must be contiguous")


def gather_torch(slabs: torch.Tensor, ids: torch.Tensor, packed: torch.Tensor) -> None:
    """``packed[i, s] = slabs[s, ids[i]]`` for ``i < len(ids)`` (torch twin)."""
    _check(slabs, ids, packed)
    packed[: ids.numel()].copy_(slabs.index_select(1, ids).transpose(0, 1))


def scatter_torch(packed: torch.Tensor, ids: torch.Tensor, slabs: torch.Tensor) -> None:
    """``slabs[s, ids[i]] = packed[i, s]`` for ``i < len(ids)`` (torch twin)."""
    _check(slabs, ids, packed)
    slabs.index_copy_(1, ids, packed[: ids.numel()].transpose(0, 1))


if HAVE_TRITON:

    @triton.jit
    def _gather_kernel(
        slabs_ptr,  # L1 slabs [S, P, E], contiguous
        ids_ptr,  # int64 [n]: physical L1 page of logical page i
        packed_ptr,  # packed [n, S, E], contiguous
        pool_pages,  # P
        num_slabs,  # S = 2 * layers
        page_elements,  # E
        BLOCK: tl.constexpr,  # elements per program along E
    ):
        row = tl.program_id(0).to(tl.int64)  # i * S + s
        col = tl.program_id(1).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
        mask = col < page_elements
        page = row // num_slabs
        slab = row % num_slabs
        phys = tl.load(ids_ptr + page).to(tl.int64)
        src = (slab * pool_pages + phys) * page_elements + col
        vals = tl.load(slabs_ptr + src, mask=mask)
        tl.store(packed_ptr + row * page_elements + col, vals, mask=mask)

    @triton.jit
    def _scatter_kernel(
        packed_ptr,  # packed [n, S, E], contiguous
        ids_ptr,  # int64 [n]: physical L1 page of logical page i
        slabs_ptr,  # L1 slabs [S, P, E], contiguous
        pool_pages,  # P
        num_slabs,  # S = 2 * layers
        page_elements,  # E
        BLOCK: tl.constexpr,  # elements per program along E
    ):
        row = tl.program_id(0).to(tl.int64)
        col = tl.program_id(1).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
        mask = col < page_elements
        page = row // num_slabs
        slab = row % num_slabs
        phys = tl.load(ids_ptr + page).to(tl.int64)
        vals = tl.load(packed_ptr + row * page_elements + col, mask=mask)
        tl.store(slabs_ptr + (slab * pool_pages + phys) * page_elements + col, vals, mask=mask)


def _launch(kernel: Any, a: torch.Tensor, ids: torch.Tensor, b: torch.Tensor, slabs: torch.Tensor) -> None:
    if not HAVE_TRITON:
        raise ConfigError("triton is not installed")
    n = ids.numel()
    if n == 0:
        return
    s, p, e = slabs.shape
    block = min(4096, triton.next_power_of_2(e))
    grid = (n * s, triton.cdiv(e, block))
    kernel[grid](a, ids, b, p, s, e, BLOCK=block, num_warps=4 if block <= 1024 else 8)


def gather_triton(slabs: torch.Tensor, ids: torch.Tensor, packed: torch.Tensor) -> None:
    """``packed[i, s] = slabs[s, ids[i]]`` with one Triton launch."""
    _check(slabs, ids, packed)
    _launch(_gather_kernel, slabs, ids, packed, slabs)


def scatter_triton(packed: torch.Tensor, ids: torch.Tensor, slabs: torch.Tensor) -> None:
    """``slabs[s, ids[i]] = packed[i, s]`` with one Triton launch."""
    _check(slabs, ids, packed)
    _launch(_scatter_kernel, packed, ids, slabs, slabs)


# -- layer-ranged loads straight from L2 (zero-copy reads of pinned host memory) -----------
#
# A restore that hands its pages to the model layer by layer (attention of layer l waits only
# for layer l) needs the H2D in layer order. L2 is page-major (one DMA per run), so layer l
# of n pages is 2n strided pieces. ``load_layers_triton`` reads them where they lie: on CUDA
# the source is pinned host memory, which the kernel reads over PCIe through its unified
# address (no staging copy, no DMA engine); under TRITON_INTERPRET=1 everything is on CPU.
# It is a building block, measured by ``bench/layer_load.py``; no restore path uses it yet.


def _check_load(
    src: torch.Tensor, src_ids: torch.Tensor, dst: torch.Tensor, dst_ids: torch.Tensor, layers: tuple[int, int]
) -> None:
    if src.dim() != 3 or dst.dim() != 3 or src.shape[1] != dst.shape[0] or src.shape[2] != dst.shape[2]:
        raise ConfigError(
            f"src must be L2 slabs [P2, S, E] and dst L1 slabs [S, P1, E]; got {tuple(src.shape)}, {tuple(dst.shape)}"
        )
    if src.shape[1] % 2:
        raise ConfigError(f"S = 2 * layers must be even, got {src.shape[1]}")
    lo, hi = layers
    if not 0 <= lo < hi <= src.shape[1] // 2:
        raise ConfigError(f"layers [{lo}, {hi}) outside [0, {src.shape[1] // 2})")
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
    src: torch.Tensor, src_ids: torch.Tensor, dst: torch.Tensor, dst_ids: torch.Tensor, layers: tuple[int, int]
) -> None:
    """``dst[kv * L + l, dst_ids[i]] = src[src_ids[i], kv * L + l]`` for K/V ``kv`` and
    layers ``l`` in ``[layers[0], layers[1])`` (torch twin; the source is gathered on its
    own device first)."""
    _check_load(src, src_ids, dst, dst_ids, layers)
    half = src.shape[1] // 2

    def slabs(device: torch.device) -> torch.Tensor:  # made where used: no upload, no host wait
        k = torch.arange(*layers, device=device)
        return torch.cat([k, k + half])

    rows = src.index_select(0, src_ids.to(src.device)).index_select(1, slabs(src.device))
    dst[slabs(dst.device).view(-1, 1), dst_ids.view(1, -1)] = rows.transpose(0, 1).to(dst.device)


if HAVE_TRITON:

    @triton.jit
    def _load_kernel(
        src_ptr,  # L2 slabs [P2, S, E], contiguous (pinned host memory on CUDA)
        src_ids_ptr,  # int64 [n]: L2 page of page i
        dst_ptr,  # L1 slabs [S, P1, E], contiguous
        dst_ids_ptr,  # int64 [n]: L1 page of page i
        dst_pages,  # P1
        half,  # S // 2 = layers
        layer_lo,
        layer_count,
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
            slab = kv * half + layer_lo + row % layer_count
            src_page = tl.load(src_ids_ptr + i).to(tl.int64)
            dst_page = tl.load(dst_ids_ptr + i).to(tl.int64)
            vals = tl.load(src_ptr + (src_page * 2 * half + slab) * page_elements + col, mask=mask)
            tl.store(dst_ptr + (slab * dst_pages + dst_page) * page_elements + col, vals, mask=mask)


def load_layers_triton(
    src: torch.Tensor,
    src_ids: torch.Tensor,
    dst: torch.Tensor,
    dst_ids: torch.Tensor,
    layers: tuple[int, int],
    *,
    programs: int | None = None,
) -> None:
    """:func:`load_layers_torch` in one Triton launch that reads ``src`` where it lies.
    ``src`` may also be a device buffer of the same layout (a packed workspace). With
    ``programs``, at most that many programs per column block loop over the rows (a load
    that runs beside a forward then takes only a few SMs)."""
    if not HAVE_TRITON:
        raise ConfigError("triton is not installed")
    _check_load(src, src_ids, dst, dst_ids, layers)
    if dst.is_cuda and not src.is_cuda and not src.is_pinned():
        raise ConfigError("a CUDA load reads host memory in place: src must be pinned (an L2 HostPool's slabs)")
    if programs is not None and programs < 1:
        raise ConfigError(f"programs must be >= 1, got {programs}")
    n = dst_ids.numel()
    if n == 0:
        return
    s, p, e = dst.shape
    count = layers[1] - layers[0]
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
        layers[0],
        count,
        e,
        rows,
        BLOCK=block,
        num_warps=4 if block <= 1024 else 8,
    )


def warm_load_layers(dst: torch.Tensor, groups: Sequence[tuple[int, int]], *, programs: int | None = None) -> int:
    """Compile every variant of :func:`load_layers_triton` that a layered H2D into ``dst``
    (L1's slabs, ``[S, P, E]``) by ``groups`` of layers can launch; returns the launches.

    Triton specializes integer arguments on divisibility by 16 (and on equality to 1), so
    the first launch with a new row count (``2 * pages * layers``) may compile afresh, on
    the host, between the copy's timing events: a transfer's cost sample then holds a
    compile (the likely reason why, with the layered restore on, an H200 soak's cost policy
    restored 1 of 6,101 requests: a 1 s sample rules restores out). Each group is
    launched with 1 page and with 8 (row counts ``2 * count`` and ``16 * count``: both
    residues) from a packed workspace into a scratch pool of ``dst``'s layout whose page
    count specializes as ``P`` does. ``dst`` is never written."""
    s, p, e = dst.shape
    pages = p if p <= 17 else (16 if p % 16 == 0 else 17)
    scratch = torch.empty((s, pages, e), dtype=dst.dtype, device=dst.device)
    sizes = sorted({1, min(8, pages)})
    src = torch.zeros((sizes[-1], s, e), dtype=dst.dtype, device=dst.device)
    launches = 0
    for layers in groups:
        for n in sizes:
            ids = torch.arange(n, device=dst.device)
            load_layers_triton(src[:n], ids, scratch, ids, layers, programs=programs)
            launches += 1
    return launches
