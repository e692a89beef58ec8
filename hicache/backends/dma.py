"""Strided host -> device copies on the copy engine (``cudaMemcpy2DAsync``).

A layer of a page-major L2 run is ``n`` rows of one slab each, a whole page apart: torch's
``copy_`` of such a view first makes it contiguous on the host (a CPU copy into pageable
memory, then a synchronous upload). ``cudaMemcpy2DAsync`` hands the copy engine the pitch
instead, so each layer of a run is one DMA that leaves the SMs to the forward it overlaps.
The runtime is reached through ``cuda.bindings`` (NVIDIA's CUDA Python), an optional
dependency: :data:`AVAILABLE` says whether it is installed and usable here.
"""

from __future__ import annotations

import ctypes
import functools
from collections.abc import Sequence
from typing import Any

import torch

from hicache.errors import ConfigError

try:  # optional: the layer-pipelined restore needs it, nothing else does
    from cuda.bindings import runtime as _rt

    _H2D: Any = _rt.cudaMemcpyKind.cudaMemcpyHostToDevice
    _ANY: Any = _rt.cudaMemcpyKind.cudaMemcpyDefault
    _OK: Any = _rt.cudaError_t.cudaSuccess
    AVAILABLE = True
except ImportError:  # pragma: no cover - machines without cuda-python
    _rt = None
    AVAILABLE = False

try:  # the driver's stream memory operations (value waits and writes)
    from cuda.bindings import driver as _drv

    _GEQ: Any = _drv.CUstreamWaitValue_flags.CU_STREAM_WAIT_VALUE_GEQ
    _DRV_OK: Any = _drv.CUresult.CUDA_SUCCESS
except ImportError:  # pragma: no cover - machines without cuda-python
    _drv = None


def _rows(t: torch.Tensor) -> tuple[int, int, int]:
    """(rows, bytes per row, pitch in bytes) of a 2-D view whose rows are contiguous."""
    if t.dim() != 2 or (t.shape[1] > 1 and t.stride(1) != 1):
        raise ConfigError(f"a row copy needs a 2-D view with contiguous rows, got {tuple(t.shape)} {t.stride()}")
    size = t.element_size()
    return t.shape[0], t.shape[1] * size, t.stride(0) * size


def check_rows(dst: torch.Tensor, src: torch.Tensor) -> tuple[int, int, int, int]:
    """Check a :func:`copy_rows` of ``src`` into ``dst``; returns (rows, bytes per row,
    destination pitch, source pitch), pitches in bytes."""
    if not AVAILABLE:
        raise ConfigError("row copies need cuda-python (pip install cuda-bindings)")
    if not dst.is_cuda or src.is_cuda or not src.is_pinned():
        raise ConfigError("copy_rows copies pinned host memory to the device")
    if dst.dtype != src.dtype or dst.shape != src.shape:
        raise ConfigError(f"copy_rows: {src.dtype} {tuple(src.shape)} into {dst.dtype} {tuple(dst.shape)}")
    rows, width, spitch = _rows(src)
    _, _, dpitch = _rows(dst)
    return rows, width, max(dpitch, width), max(spitch, width)


def copy_rows(dst: torch.Tensor, src: torch.Tensor, stream: Any) -> None:
    """``dst.copy_(src)`` for 2-D views with contiguous rows and any row pitch: ``src`` in
    pinned host memory, ``dst`` on the device; one DMA queued on ``stream``
    (a ``torch.cuda.Stream``). Nothing waits for it: order later work after ``stream``."""
    rows, width, dpitch, spitch = check_rows(dst, src)
    copy_rows_raw(dst.data_ptr(), dpitch, src.data_ptr(), spitch, width, rows, stream)


def copy_rows_raw(dst: int, dpitch: int, src: int, spitch: int, width: int, rows: int, stream: Any) -> None:
    """:func:`copy_rows` on addresses (bytes), unchecked: for callers that checked the
    buffers once and issue many copies into them (a layered H2D issues ~20 per restore,
    and the checks cost more host time than the call itself)."""
    if rows == 0 or width == 0:
        return
    (err,) = _rt.cudaMemcpy2DAsync(dst, dpitch, src, spitch, width, rows, _H2D, stream.cuda_stream)
    if err != _OK:
        raise RuntimeError(f"cudaMemcpy2DAsync failed: {err!r}")


def copy_rows_device(dst: int, dpitch: int, src: int, spitch: int, width: int, rows: int, stream: Any) -> None:
    """:func:`copy_rows_raw` between two device addresses: on the copy engine (no SMs), so a
    forward running beside it keeps them; unchecked."""
    if rows == 0 or width == 0:
        return
    (err,) = _rt.cudaMemcpy2DAsync(dst, dpitch, src, spitch, width, rows, _ANY, stream.cuda_stream)
    if err != _OK:
        raise RuntimeError(f"cudaMemcpy2DAsync failed: {err!r}")


def copy_rows_host(dst: int, dpitch: int, src: int, spitch: int, width: int, rows: int) -> None:
    """:func:`copy_rows_raw` between host addresses, synchronously (what a layered H2D does
    on a machine without CUDA, so its address arithmetic runs in CPU tests)."""
    for r in range(rows):
        ctypes.memmove(dst + r * dpitch, src + r * spitch, width)


def copy_pages(
    dst: int,
    dpage: int,
    dpitch: int,
    src: int,
    spage: int,
    spitch: int,
    width: int,
    rows: int,
    pairs: Sequence[tuple[int, int]],
    stream: Any,
) -> None:
    """One strided DMA per ``(dst_page, src_page)`` pair: ``rows`` rows of ``width`` bytes,
    page ``i`` of a side starting ``i * page`` bytes past its base and its rows ``pitch``
    apart (direction by unified addressing). Between the L1 pool (a page is one row per
    layer and K/V, a slab apart) and page-major L2 this moves pages on the copy engine
    alone: no kernel, no workspace. ``stream`` None: a host copy (CPU, for tests)."""
    if stream is None:
        for d, s in pairs:
            copy_rows_host(dst + d * dpage, dpitch, src + s * spage, spitch, width, rows)
        return
    memcpy, handle = _rt.cudaMemcpy2DAsync, stream.cuda_stream
    for d, s in pairs:
        (err,) = memcpy(dst + d * dpage, dpitch, src + s * spage, spitch, width, rows, _ANY, handle)
        if err != _OK:
            raise RuntimeError(f"cudaMemcpy2DAsync failed: {err!r}")


def copy_raw(dst: int, src: int, nbytes: int, stream: Any) -> None:
    """``nbytes`` from address ``src`` to ``dst`` (device or pinned host memory, direction
    inferred through unified addressing), one DMA queued on ``stream``; unchecked. Its host
    cost is a fraction of a ``Tensor.copy_`` (no views, no dispatch): transfers that issue
    one DMA per run of fragmented L2 pages issue many."""
    if nbytes == 0:
        return
    (err,) = _rt.cudaMemcpyAsync(dst, src, nbytes, _ANY, stream.cuda_stream)
    if err != _OK:
        raise RuntimeError(f"cudaMemcpyAsync failed: {err!r}")


@functools.cache
def _batch_attrs() -> Any:
    """The one attribute set of a batch: each copy reads its source in stream order."""
    attrs = _rt.cudaMemcpyAttributes()
    attrs.srcAccessOrder = _rt.cudaMemcpySrcAccessOrder.cudaMemcpySrcAccessOrderStream
    return attrs


# cudaMemcpyBatchAsync (CUDA 12.8+): many copies in one call, which the driver hands the copy
# engine back to back. One call per run of fragmented pages leaves a gap of a few microseconds
# between copies (0.93-0.95 of a plain copy for 2.25 MiB runs on an H200); a batch does not
# (bench/results/copy_overhead-*.txt). None where the runtime lacks it or refused it once.
_BATCH: Any = getattr(_rt, "cudaMemcpyBatchAsync", None) if AVAILABLE else None


def batch_usable() -> bool:
    """Whether :func:`copy_batch` queues one batched call (else one call per copy)."""
    return _BATCH is not None


def copy_batch(copies: Sequence[tuple[int, int, int]], stream: Any) -> None:
    """``(dst, src, nbytes)`` copies between device and pinned host addresses, queued on
    ``stream`` in one ``cudaMemcpyBatchAsync`` (the copies may run in any order among
    themselves; the batch as a whole in stream order). Without it, or if the runtime
    refuses the call (it is then not tried again), one :func:`copy_raw` each. ``stream``
    None: host copies (CPU, for tests of the address arithmetic)."""
    global _BATCH
    if stream is None:
        for dst, src, nbytes in copies:
            ctypes.memmove(dst, src, nbytes)
        return
    copies = [c for c in copies if c[2]]
    if len(copies) > 1 and _BATCH is not None:
        attrs = [_batch_attrs()]
        dsts, srcs, sizes = (list(x) for x in zip(*copies, strict=True))
        try:
            out = _BATCH(dsts, srcs, sizes, len(copies), attrs, [0], 1, stream.cuda_stream)
        except TypeError:  # CUDA 12.8-12.9 bindings: a failure-index argument before the stream
            out = _BATCH(dsts, srcs, sizes, len(copies), attrs, [0], 1, 0, stream.cuda_stream)
        err = out[0] if isinstance(out, tuple) else out
        if err == _OK:
            return
        # NOTE: a refused batch may have queued some of its copies; queuing them again below
        # is harmless (same bytes to the same place, in stream order).
        _BATCH = None
    for dst, src, nbytes in copies:
        copy_raw(dst, src, nbytes, stream)


def new_stream(device: torch.device) -> Any:
    """A CUDA stream of its own (``torch.cuda.ExternalStream``, non-blocking), or ``None``
    without cuda-python. ``torch.cuda.Stream()`` hands out one of a fixed pool of streams in
    turn, so two of them can be the same stream; and torch keys the cuBLAS workspace by
    stream, so two graphs captured on one stream share it.

    NOTE: never destroyed: torch's caching allocator keeps blocks (and records events) by
    stream for as long as the process lives; keep it for reuse instead."""
    if not AVAILABLE:
        return None
    with torch.cuda.device(device):
        err, handle = _rt.cudaStreamCreateWithFlags(_rt.cudaStreamNonBlocking)
    if err != _OK:
        raise RuntimeError(f"cudaStreamCreateWithFlags failed: {err!r}")
    return torch.cuda.ExternalStream(int(handle), device=device)  # type: ignore[no-untyped-call]


def values_usable() -> bool:
    """Whether :func:`wait_value` and :func:`write_value` can be called here (cuda-python's
    driver bindings; whether the device runs them is for the caller to try)."""
    return _drv is not None and torch.cuda.is_available()


def write_value(stream: Any, addr: int, value: int) -> None:
    """Queue on ``stream``: write the 32-bit ``value`` at device address ``addr`` once the
    work queued before it has completed (``cuStreamWriteValue32``)."""
    (err,) = _drv.cuStreamWriteValue32(stream.cuda_stream, addr, value, 0)
    if err != _DRV_OK:
        raise RuntimeError(f"cuStreamWriteValue32 failed: {err!r}")


def wait_value(stream: Any, addr: int, value: int) -> None:
    """Queue on ``stream``: wait until the 32-bit word at device address ``addr`` is at least
    ``value`` (``cuStreamWaitValue32``). Unlike an event wait, which waits for the event's
    record made before it was queued (or before its graph was launched), this waits for a
    write made at any time, before or after: a forward can be launched before the copies it
    waits for are queued. Captured in a CUDA graph it waits on every replay."""
    (err,) = _drv.cuStreamWaitValue32(stream.cuda_stream, addr, value, _GEQ)
    if err != _DRV_OK:
        raise RuntimeError(f"cuStreamWaitValue32 failed: {err!r}")
