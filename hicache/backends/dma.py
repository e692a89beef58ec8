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
import logging
from collections.abc import Sequence
from typing import Any

import numpy as np
import torch

from hicache.errors import ConfigError

log = logging.getLogger(__name__)

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
    *,
    batched: bool = True,
) -> None:
    """One strided DMA per ``(dst_page, src_page)`` pair: ``rows`` rows of ``width`` bytes,
    page ``i`` of a side starting ``i * page`` bytes past its base and its rows ``pitch``
    apart (direction by unified addressing), queued as :func:`copy_rows_batch` does. Between
    the L1 pool (a page is one row per layer and K/V, a slab apart) and page-major L2 this
    moves pages on the copy engine alone: no kernel, no workspace. ``stream`` None: a host
    copy (CPU, for tests)."""
    copies = [(dst + d * dpage, dpitch, src + s * spage, spitch, width, rows) for d, s in pairs]
    copy_rows_batch(copies, stream, batched=batched)


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


# cuMemcpy3DBatchAsync (CUDA 12.8+): many strided copies in one driver call. A restore issues
# one 2-D DMA per page (the copy path) or per row of a layer group (layered), dozens to
# hundreds per transfer at several microseconds of host time each, with a gap on the copy
# engine between calls; one batched call queues them all (bench/probes/row_batch.py).
# The call takes an array of CUDA_MEMCPY3D_BATCH_OP (112 bytes, the layout below: checked
# against cuda-python's own struct in tests/gpu/test_transfer_gpu.py) filled with numpy, and
# goes through ctypes: cuda-python would take one Python object per copy.
_OP = np.dtype(
    {
        "names": ["src_type", "src", "src_row", "src_height", "dst_type", "dst", "dst_row", "dst_height",
                  "width", "height", "depth", "order"],
        "formats": ["<u4", "<u8", "<u8", "<u8", "<u4", "<u8", "<u8", "<u8", "<u8", "<u8", "<u8", "<u4"],
        "offsets": [0, 8, 16, 24, 40, 48, 56, 64, 80, 88, 96, 104],
        "itemsize": 112,
    }
)  # fmt: skip
_POINTER = 1  # CU_MEMCPY_OPERAND_TYPE_POINTER
_STREAM_ORDER = 1  # CU_MEMCPY_SRC_ACCESS_ORDER_STREAM
# The batch function as of CUDA 12.8 (its ABI: a failure index before the flags), whatever
# the driver's version: cuGetProcAddress hands out the version asked for.
_BATCH3D_FN = ctypes.CFUNCTYPE(
    ctypes.c_int, ctypes.c_size_t, ctypes.c_void_p, ctypes.POINTER(ctypes.c_size_t), ctypes.c_ulonglong, ctypes.c_void_p
)
_batch3d: Any = None  # resolved at first use; False where the driver lacks it or refused a batch
Rows = tuple[int, int, int, int, int, int]  # dst, dst pitch, src, src pitch, bytes per row, rows


def _resolve_batch3d() -> Any:
    global _batch3d
    if _batch3d is None:
        _batch3d = False
        if _drv is not None:
            try:
                flags = _drv.CUdriverProcAddress_flags.CU_GET_PROC_ADDRESS_DEFAULT
                out = _drv.cuGetProcAddress(b"cuMemcpy3DBatchAsync", 12080, flags)
                if out[0] == _DRV_OK and int(out[1]):
                    _batch3d = _BATCH3D_FN(int(out[1]))
            except Exception:  # bindings without the symbol or the call: one call per copy
                _batch3d = False
    return _batch3d


def rows_batch_usable() -> bool:
    """Whether :func:`copy_rows_batch` can queue its copies in one driver call here."""
    return bool(_resolve_batch3d()) if AVAILABLE and torch.cuda.is_available() else False


def ops(copies: Sequence[Rows]) -> np.ndarray:
    """The CUDA_MEMCPY3D_BATCH_OP array of ``copies`` (each a 2-D copy, depth 1)."""
    a = np.asarray(copies, dtype=np.uint64).reshape(-1, 6)
    out = np.zeros(len(a), dtype=_OP)
    out["src_type"] = out["dst_type"] = _POINTER
    out["dst"], out["dst_row"], out["src"], out["src_row"] = a[:, 0], a[:, 1], a[:, 2], a[:, 3]
    out["width"], out["height"] = a[:, 4], a[:, 5]
    out["src_height"] = out["dst_height"] = a[:, 5]
    out["depth"] = 1
    out["order"] = _STREAM_ORDER
    return out


def copy_rows_batch(copies: Sequence[Rows], stream: Any, *, batched: bool = True) -> None:
    """``(dst, dpitch, src, spitch, width, rows)`` 2-D copies between device and pinned host
    addresses (direction by unified addressing), queued on ``stream``: in one
    ``cuMemcpy3DBatchAsync`` where the driver has it and ``batched`` (the copies may run in
    any order among themselves, the batch as a whole in stream order), else one
    ``cudaMemcpy2DAsync`` each. Empty copies are skipped. If the driver refuses a batch it
    is not tried again (NOTE: a refused batch may have queued some of its copies; queuing
    them again is harmless: same bytes to the same place, in stream order). ``stream``
    None: host copies (CPU, for tests of the address arithmetic)."""
    global _batch3d
    if stream is None:
        for dst, dpitch, src, spitch, width, rows in copies:
            copy_rows_host(dst, dpitch, src, spitch, width, rows)
        return
    copies = [c for c in copies if c[4] and c[5]]
    fn = _resolve_batch3d() if batched and len(copies) > 1 else None
    if fn:
        table = ops(copies)
        failed = ctypes.c_size_t(0)
        err = fn(len(copies), table.ctypes.data, ctypes.byref(failed), 0, stream.cuda_stream)
        if err == 0:
            return
        log.warning("cuMemcpy3DBatchAsync refused %d copies (CUresult %d): one call each from now on", len(copies), err)
        _batch3d = False
    handle = stream.cuda_stream
    for dst, dpitch, src, spitch, width, rows in copies:
        (err,) = _rt.cudaMemcpy2DAsync(dst, dpitch, src, spitch, width, rows, _ANY, handle)
        if err != _OK:
            raise RuntimeError(f"cudaMemcpy2DAsync failed: {err!r}")


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
