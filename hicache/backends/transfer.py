"""L1 <-> L2 transfers (DESIGN.md §6): three paths, chosen per transfer.

``direct`` (Triton; transfers up to ``direct_max_bytes``, or fragmented L2 pages whose runs
are too short for a DMA each): one kernel moves the pages between L1 and the pinned L2 pool
in place, reading or writing host memory over PCIe through unified addressing. No
workspace, no DMA, one launch.

``ring`` (everything else), through a fixed ring of ``chunks`` device buffers of
``chunk_pages`` pages each, allocated once::

    D2H, per chunk of pages:  L1 --gather--> ring slot --1 DMA per run of L2 pages--> L2
    H2D, per chunk of pages:  L2 --1 DMA per run--> ring slot --scatter--> L1

A transfer larger than one chunk alternates two streams: gathers (scatters) on
``kernel_stream``, DMAs on ``stream``, so chunk i+1's gather overlaps chunk i's DMA::

    kernel_stream:  gather 0 | gather 1 | gather 2 ...      (slot k reused once its DMA ended)
    stream:                  |  DMA 0   |  DMA 1   | DMA 2 ...

A D2H of at least twice ``ring_head_pages`` pages moves that many first pages as the copy
path does, one strided DMA per page queued before the first gather is launched, so the copy
engine works while the host launches it and the kernel runs::

    kernel_stream:        | gather 0 | gather 1 ...
    stream:         head DMAs        | DMA 0    | DMA 1 ...

``layered`` (H2D with ``layer_events``, CUDA with cuda-python): per group of layers
(:meth:`TransferEngine.layer_groups`), strided DMAs of those layers into a ring slot in a
compact layout (rows of a group's layers of a page: wide), then out of the slot into L1;
fragmented L2 pages: one zero-copy load from L2 instead. Then the distinct events among
``layer_events[lo:hi]`` are recorded, each only after those layers of every page landed.
Out of the slot: into L1 pages forming at most ``d2d_runs`` runs (a restore of at least
``d2d_min_bytes``), row DMAs device to device (copy engine, no SMs), else one scatter with
at most ``scatter_programs`` programs. Row DMAs, and scatters with ``split_layered``, go on
``kernel_stream``, DMAs from L2 on ``stream``, so the copy from L2 runs from one group to
the next without waiting for the move out of a slot::

    stream:         DMA g0 | DMA g1 | DMA g2 | ...           (slot k refilled once moved out)
    kernel_stream:         | out 0  | out 1  | out 2 ...    (records g's layer events)

The rows of the DMAs from L2 are why: L2 keeps a page's layers together and L1 a layer's
pages, so a DMA straight from one into the other has rows of one layer of a page (32 KiB
for Qwen3-8B), and those run at 0.86-0.88 of a plain copy beside the forward the restore
overlaps, where rows of two layers or more keep its rate (bench/probes/copy_engines.py).

Otherwise, when the pages are at most ``straight_max_pages`` and form at most
``straight_runs`` runs consecutive in both pools (the L1 allocator hands out consecutive
pages when it can), or when the ring cannot be allocated, a layered H2D skips the ring: per
group, one strided DMA per run and per K/V row of each layer, straight into L1, then the
group's events, all on ``stream``. Below ``d2d_min_bytes`` the copy ends well before the
forward beside it and this path's lower host cost wins.

Streams: a transfer starts on ``stream`` behind the caller's current stream (pages and
page ids it produced are ready; pages it still reads are not overwritten) and ends there
(after its kernel-stream work), so transfers of one engine run in the order issued. The
caller makes its stream wait on the ticket's event (:meth:`DeviceTicket.wait_on_current_stream`)
before reading restored pages. Page ids go through persistent pinned and device buffers.

Fences: each transfer registers its pages with the pools (:class:`~hicache.backends.pools.PageFences`);
a transfer whose sources another backend still writes (or whose destinations it still
reads or writes) waits for it, or raises :class:`~hicache.backends.pools.PagesInFlightError`
with ``fences="raise"``. An allocation failure fails the ticket; it never raises.

On a CPU-only machine the same API runs synchronously (no streams; tickets finish at once).
"""

from __future__ import annotations

import contextlib
import functools
import itertools
import logging
import os
import statistics
import threading
import time
import warnings
from collections import deque
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

import torch

from hicache.backends import dma, kernels
from hicache.backends.faults import FaultInjector
from hicache.backends.pools import DevicePool, HostPool, PageFences, PagesInFlightError, check_pages, coalesce
from hicache.backends.ticket import Ticket
from hicache.core.interrupts import by_signal
from hicache.errors import ConfigError, MisuseError, PageOwnershipError
from hicache.spec.model import Direction

log = logging.getLogger(__name__)

TransferBackend = Literal["auto", "triton", "torch"]
FencePolicy = Literal["wait", "raise"]
Path = Literal["copy", "direct", "ring", "layered"]
Copy = Callable[[torch.Tensor, torch.Tensor, torch.Tensor], None]

GATHER: dict[str, Copy] = {"torch": kernels.gather_torch, "triton": kernels.gather_triton}
SCATTER: dict[str, Copy] = {"torch": kernels.scatter_torch, "triton": kernels.scatter_triton}
# Defaults: a ring of 4 x 64 MiB (256 MiB of device memory). A DMA of >= 16 pages of a
# Qwen3-8B-shaped model (36 MiB) runs within a few percent of the copy engine's peak, so
# 64 MiB chunks cost little per chunk, and 4 let gathers run ahead of the DMAs.
CHUNK_BYTES = 64 << 20
CHUNKS = 4
# Up to this many bytes a transfer goes direct (one kernel over PCIe): below it the fixed
# cost of the gather + DMA + events dominates. bench/transfer.py measures both paths per
# size on the GPU ("direct" and "ring" columns); set from there.
DIRECT_MAX_BYTES = 16 << 20
# Up to this many pages a transfer goes on the copy engine alone, one strided DMA per page
# (cuda-python). bench/transfer.py measures it ("copy" column) against the other paths.
COPY_MAX_PAGES = 32
# A D2H through the ring moves its first RING_HEAD_PAGES pages as the copy path does (one
# strided DMA per page, no ids, no kernel): the copy engine starts on them while the host
# uploads the page ids and launches the first gather, which it otherwise waited for. Enough
# pages to outlast that on a slow host (a page of Qwen3-8B takes ~45 us to copy): 64 pages
# went from 0.857 / 0.825 of a plain copy (consecutive / fragmented L2) to 0.878 / 0.841
# with 2, 0.903 / 0.865 with 4 and 0.909 / 0.901 with 8 on one H200 host
# (bench/probes/ring_head.py, docs/RESULTS.md).
RING_HEAD_PAGES = 8
# A layered H2D of at most STRAIGHT_MAX_PAGES pages whose pages form at most STRAIGHT_RUNS
# runs in both pools goes straight into L1: 2 x layers strided DMAs per run (rows of one
# page-layer, 32 KiB for Qwen3-8B), no ring and no scatter; beyond STRAIGHT_RUNS the DMA
# count grows with the runs. Alone it runs at 0.96 of a plain copy against 0.88 through the
# ring (bench/probes/layered_rate.py, 219 pages on an H200). The cap keeps one restore from
# holding the copy engine for longer than a few tens of milliseconds: longer restores go
# through the ring, chunk by chunk.
STRAIGHT_RUNS = 2
STRAIGHT_MAX_PAGES = 256
# A layered H2D through the ring moves each slot into L1 pages forming at most D2D_RUNS runs
# by row DMAs on the copy engine (2 x layers per run, device to device), on the kernel stream;
# more runs take the scatter kernel. Beside a forward its host-to-device DMAs then have rows
# of a layer group of a page (>= 64 KiB from groups of 2 layers), which keep the plain
# rate, where the straight path's 32 KiB rows drop to 0.86-0.88 of it
# (bench/probes/copy_engines.py, 219 pages on an H200). Preferred to the straight path when
# the ring can be had; the straight path is the fallback when it cannot.
D2D_RUNS = 2
# ... and only from this many bytes: below, the copy ends well before the forward beside it
# and the straight path's lower host cost wins (350 tokens of Qwen3-8B: 1.12x its floor
# straight, 1.20x by row DMAs; 3,500 tokens: 1.40x straight, 1.32x by row DMAs).
D2D_MIN_BYTES = 256 << 20
# The first layer group's size, doubling to MAX_LAYER_GROUP, and the last one's, halving down
# to it (layer_groups). A layered forward is faster per layer than the copy, so it catches up
# with it and then finishes each group that group's compute after the group lands: a small
# last group leaves it less to do after the copy. The first group's size barely moves the
# forward's end, but a one-layer first group cost the copy its rate: 3,500 tokens of Qwen3-8B
# took 10.08 ms of H2D service with groups 1, 2, 3, ..., 3, 2, 1 and 9.75 ms with 2, 4, ...,
# 4, 3, 2, 1, one run after the other on one H200 (docs/RESULTS.md).
LAYER_GROUP = 2
MAX_LAYER_GROUP = 4
LAST_LAYER_GROUP = 1
# torch.cuda's Stream and Event constructors are unannotated; use them through Any.
_Stream: Any = torch.cuda.Stream
_Event: Any = torch.cuda.Event


# torch's lookup of a device's current stream as a raw handle (what Triton's launcher calls)
_RAW_STREAM: Any = getattr(torch._C, "_cuda_getCurrentRawStream", None)
_STREAMS: dict[tuple[int, int], Any] = {}  # current_stream's: (device, raw handle) -> torch stream


def current_stream(device: int | None) -> Any:
    """``torch.cuda.current_stream(device)`` (None: the current device), each stream's
    object made once.

    NOTE: ``torch.cuda.current_stream`` builds a new Stream object per call (~6 us on a slow
    host, a fair part of a one-page transfer's host time); the raw handle under it costs
    ~0.3 us, and the object kept for it is the same stream as long as the handle is (torch
    never frees its pool's streams). Kept only where the object's handle is the one looked
    up; the table is emptied past 256 streams, so it cannot grow without bound."""
    if _RAW_STREAM is None:
        return torch.cuda.current_stream(device)
    if device is None:
        device = torch.cuda.current_device()
    key = (device, int(_RAW_STREAM(device)))
    stream = _STREAMS.get(key)
    if stream is None:
        stream = torch.cuda.current_stream(device)
        if int(stream.cuda_stream) == key[1]:
            if len(_STREAMS) >= 256:
                _STREAMS.clear()
            _STREAMS[key] = stream
    return stream


def layer_groups(layers: int, first: int, most: int, last: int | None = None) -> list[tuple[int, int]]:
    """The ``[lo, hi)`` layer ranges of a layered H2D, in order: sizes grow from ``first``
    by doubling to ``most``, the middle is cut into groups of at most ``most`` as even as
    can be, and sizes shrink the same way down to ``last`` at the end (default ``first``;
    1, 2, 4, 8, 7, 7, 4, 2, 1 for 36 layers from 1 to 8). Small first groups let the
    forward start early; small last ones leave it little to do after the last layer lands
    (when the copy is the slower, the forward waits on every group's end). Raises
    ConfigError unless every count is an int >= 1 and neither end is larger than ``most``."""
    ends = (first, most) if last is None else (first, most, last)
    if any(isinstance(v, bool) or not isinstance(v, int) or v < 1 for v in (layers, *ends)) or max(ends) > most:
        raise ConfigError(
            f"layer groups need ints >= 1 with first and last <= most; got layers {layers!r}, first {first!r}, "
            f"most {most!r}, last {last!r}"
        )
    head: list[int] = []
    tail: list[int] = []
    left, up, down = layers, first, first if last is None else last
    while left > 0 and (up < most or down < most or not head):
        if up < most or not head:
            head.append(min(up, left))
            left, up = left - head[-1], min(2 * up, most)
        if left > 0 and down < most:
            tail.append(min(down, left))
            left, down = left - tail[-1], min(2 * down, most)
    count = -(-left // most)
    share, extra = divmod(left, count) if count else (0, 0)
    middle = [share + 1] * extra + [share] * (count - extra)
    bounds = list(itertools.accumulate(head + middle + tail[::-1], initial=0))
    return list(itertools.pairwise(bounds))


def page_runs(pages: Sequence[int]) -> list[tuple[int, int]]:
    """``(first, end)`` index ranges over which ``pages`` step by one."""
    n = len(pages)
    if n and pages[n - 1] - pages[0] == n - 1 and list(pages) == list(range(pages[0], pages[0] + n)):
        return [(0, n)]
    return coalesce(pages, pages)


def _clip(runs: Sequence[tuple[int, int]], a: int, b: int) -> Iterator[tuple[int, int]]:
    """The parts of ``runs`` inside ``[a, b)``."""
    for first, end in runs:
        if end > a and first < b:
            yield max(first, a), min(end, b)


def _count(name: str, value: object) -> int:
    """``value`` if it is an int >= 0 (not a bool), else ConfigError naming ``name``."""
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise ConfigError(f"{name} must be an int >= 0, got {value!r}")
    return value


class _AllocationFailed(Exception):
    """Workspace or index memory could not be allocated (the ticket fails)."""


@dataclass(eq=False)
class DeviceTicket(Ticket):
    event: Any = None  # torch.cuda.Event recorded after the last copy (None once finished)
    keep: list[Any] = field(default_factory=list)
    stream: Any = None  # the stream ``event`` is recorded on
    flush: Callable[[], None] | None = None  # queues it, if its H2D was deferred (TransferEngine.deferring)
    queued: threading.Event | None = None  # a deferred H2D's: set once it is queued (or failed)

    def wait_on_current_stream(self) -> None:
        """Make the caller's current CUDA stream wait for this transfer (no CPU block)."""
        if self.flush is not None:
            self.flush()
        event = self.event
        if event is None:
            return
        current_stream(None).wait_event(event)

    def settle(self) -> bool:
        """Block until the copy itself has ended, without running completion work (safe
        from any thread: an I/O worker may call it before reading pages this wrote).
        Whether there was a copy on the device to wait for. A deferred H2D is queued first:
        by its own thread, which another thread waits for."""
        if self.flush is not None:
            self.flush()
        if self.queued is not None:
            self.queued.wait()
        event = self.event
        if event is None:
            return False
        event.synchronize()
        return True


class _Ring:
    """``count`` device workspace slots of ``pages`` pages, allocated once, with one
    "ready" and one "free" event per slot for the two-stream pipeline."""

    def __init__(self, geometry: Any, pages: int, count: int, device: torch.device, cuda: bool) -> None:
        g = geometry
        self.pages, self.count = pages, count
        self.memory = torch.empty((count * pages, 2 * g.num_layers, g.page_elements), dtype=g.dtype, device=device)
        self.nbytes = self.memory.numel() * self.memory.element_size()
        self.base, self.slot_bytes = self.memory.data_ptr(), self.nbytes // count
        self.ready: list[Any] = [_Event() for _ in range(count)] if cuda else []
        self.free: list[Any] = [_Event() for _ in range(count)] if cuda else []

    def slot(self, k: int) -> torch.Tensor:
        return self.memory[k * self.pages : (k + 1) * self.pages]

    def at(self, k: int) -> int:
        """The address of slot ``k`` (what DMAs into it need: no tensor view to build)."""
        return self.base + k * self.slot_bytes

    def flat(self, k: int, shape: tuple[int, int, int]) -> torch.Tensor:
        """Slot ``k`` seen as a contiguous ``shape`` (at most the slot's elements)."""
        size = self.memory[0].numel() * self.pages
        return self.memory.view(-1)[k * size : k * size + shape[0] * shape[1] * shape[2]].view(shape)


class _Ids:
    """Persistent page-id buffers: a pinned host ring the ids are written into and its
    device mirror they are uploaded to, on the transfer stream. A region is reused only
    once the transfer that uploaded it has ended (its event), so nothing is allocated per
    transfer and no upload reads ids a later transfer overwrote."""

    def __init__(self, capacity: int, device: torch.device, cuda: bool) -> None:
        self.capacity = capacity
        self.cuda = cuda
        self.host = torch.empty(capacity, dtype=torch.int64, pin_memory=cuda)
        self.np = self.host.numpy()
        # NOTE: zeroed: a kernel that ever read a region before its upload landed would
        # read page 0, never an address outside the pools.
        self.device = torch.zeros(capacity, dtype=torch.int64, device=device) if cuda else self.host
        self.arange = torch.arange(capacity, dtype=torch.int64, device=device)
        self.head = 0
        self.live: deque[tuple[int, int, Any]] = deque()  # (start, end, event), oldest first
        self.nbytes = capacity * 8 * (2 if cuda else 1) + capacity * 8

    def put(self, *lists: Sequence[int]) -> tuple[int, int]:
        """Write ``lists`` one after another into a free region; returns its start and
        length. Each list starts at an even index (16 bytes: Triton specializes pointers
        on that alignment, so an odd start would compile another kernel variant)."""
        n = sum(len(x) + (len(x) & 1) for x in lists)
        if n > self.capacity:
            raise PageOwnershipError(f"{n} page ids do not fit the index buffer of {self.capacity}")
        start = self.head
        if start + n > self.capacity:
            start = 0
        if self.cuda:
            self._reclaim(start, start + n)
        at = start
        for x in lists:
            self.np[at : at + len(x)] = x
            at += len(x) + (len(x) & 1)
        self.head = at
        return start, n

    def _reclaim(self, a: int, b: int) -> None:
        """Forget the regions in flight that have finished, oldest first, waiting for those
        that overlap ``[a, b)`` (rarely: only when uploads pile up past the capacity).

        NOTE: regions are taken in ring order and their transfers end in that order (one
        stream), so the ones ``[a, b)`` overlaps are the oldest: a prefix of ``live``."""
        while self.live:
            start, end, event = self.live[0]
            if start < b and a < end:
                event.synchronize()
            elif not event.query():
                break
            self.live.popleft()

    def upload(self, start: int, n: int, event: Any, stream: Any) -> torch.Tensor:
        """The device copy of ``[start, start + n)``, queued on ``stream`` (the current
        stream where cuda-python is missing); ``event`` is recorded after its last use."""
        if not self.cuda:
            return self.host[start : start + n]
        dev = self.device[start : start + n]
        if dma.AVAILABLE:
            dma.copy_raw(dev.data_ptr(), self.host.data_ptr() + 8 * start, 8 * n, stream)
        else:
            with torch.cuda.stream(stream):  # NOTE: the kernels that read them are ordered after it
                dev.copy_(self.host[start : start + n], non_blocking=True)
        self.live.append((start, start + n, event))
        return dev


class TransferEngine:
    """Moves pages between a :class:`DevicePool` (L1) and a :class:`HostPool` (L2).

    ``chunk_bytes`` and ``chunks`` size the ring (device memory ``chunks`` x whole pages of
    ``chunk_bytes``, at least one page each); ``direct_max_bytes`` is the size up to which a
    transfer goes direct (0: never); ``fences`` says what a transfer does about pages another
    backend still moves: ``wait`` for it, or ``raise`` :class:`PagesInFlightError`;
    ``split_layered`` runs a layered H2D's scatters on the kernel stream, so its DMAs never
    wait for a scatter; a layered H2D of at least ``d2d_min_bytes`` into L1 pages forming at
    most ``d2d_runs`` runs (0: never), from L2 pages it does not load in place (fragmented,
    Triton usable), goes through the ring and out of it by row DMAs;
    otherwise one of at most ``straight_max_pages`` pages forming at most ``straight_runs``
    runs (consecutive in L1 and in L2 alike) is copied straight into L1, without the ring
    (either 0: never), as is one that could go either way when the ring cannot be
    allocated (module docstring).
    """

    def __init__(
        self,
        l1: DevicePool,
        l2: HostPool,
        backend: TransferBackend = "auto",
        *,
        faults: FaultInjector | None = None,
        min_run_bytes: int = 256 * 1024,
        layer_group: int | None = None,
        max_layer_group: int | None = None,
        last_layer_group: int | None = None,
        scatter_programs: int = 32,
        chunk_bytes: int = CHUNK_BYTES,
        chunks: int = CHUNKS,
        direct_max_bytes: int = DIRECT_MAX_BYTES,
        copy_max_pages: int | None = None,
        fences: FencePolicy = "wait",
        split_layered: bool = False,
        straight_runs: int = STRAIGHT_RUNS,
        straight_max_pages: int = STRAIGHT_MAX_PAGES,
        d2d_runs: int = D2D_RUNS,
        d2d_min_bytes: int = D2D_MIN_BYTES,
        ring_head_pages: int | None = None,
    ) -> None:
        max_layer_group = MAX_LAYER_GROUP if max_layer_group is None else max_layer_group
        # the ends' defaults fit under a smaller largest group given alone
        cap = max_layer_group if isinstance(max_layer_group, int) else LAYER_GROUP
        layer_group = min(LAYER_GROUP, cap) if layer_group is None else layer_group
        last_layer_group = min(LAST_LAYER_GROUP, cap) if last_layer_group is None else last_layer_group
        if backend not in ("auto", "triton", "torch"):
            raise ConfigError(f"transfer backend must be auto, triton or torch; got {backend!r}")
        if l1.geometry != l2.geometry:
            raise ConfigError("L1 and L2 pools have different geometries")
        groups = (layer_group, last_layer_group, max_layer_group)
        if any(isinstance(v, bool) or not isinstance(v, int) for v in (*groups, scatter_programs)):
            raise ConfigError(f"layer groups and scatter_programs must be ints, got {groups} and {scatter_programs!r}")
        if min(*groups, scatter_programs) < 1 or max_layer_group < max(layer_group, last_layer_group):
            raise ConfigError(
                "need 1 <= layer_group, last_layer_group <= max_layer_group and scatter_programs >= 1, got "
                f"{layer_group}, {last_layer_group}, {max_layer_group}, {scatter_programs}"
            )
        if chunk_bytes < 1 or chunks < 2 or direct_max_bytes < 0:
            raise ConfigError(
                f"need chunk_bytes >= 1, chunks >= 2, direct_max_bytes >= 0; got {chunk_bytes}, {chunks}, "
                f"{direct_max_bytes}"
            )
        if fences not in ("wait", "raise"):
            raise ConfigError(f"fences must be 'wait' or 'raise', got {fences!r}")
        self.l1 = l1
        self.l2 = l2
        self.geometry = g = l1.geometry
        self.bytes_per_page = g.bytes_per_page
        self._slab = g.page_elements * l1.buffer.element_size()  # one layer's K (or V) of a page
        storage = l1.buffer.untyped_storage()
        self._l1_memory = (storage.data_ptr(), storage.nbytes())
        self.requested = backend
        self.cuda = l1.device.type == "cuda"
        self.triton_usable = kernels.HAVE_TRITON and (self.cuda or os.environ.get("TRITON_INTERPRET") == "1")
        if backend == "triton" and not self.triton_usable:
            raise ConfigError("transfer backend 'triton' needs triton and a CUDA device (or TRITON_INTERPRET=1)")
        self.stream: Any = _Stream(device=l1.device) if self.cuda else None
        index: int | None = l1.device.index  # None: the current device, where the pool was made
        self._device = torch.cuda.current_device() if self.cuda and index is None else index
        self._caller: Any = _Event() if self.cuda else None  # _wait_caller's
        # a page's rows in each pool, for _copy_pairs: (base, page step, row pitch) of L1 and
        # of L2, the row width and the row count (the pools never move: _transfer checks L1's)
        width, rows = self._slab, 2 * g.num_layers
        self._page_rows = (
            (l1.slabs.data_ptr(), width, l1.num_pages * width),
            (l2.slabs.data_ptr(), rows * width, width),
            width,
            rows,
        )
        self._kernel_stream: Any = None
        self.faults = faults or FaultInjector()
        # Fragmented L2 pages: one DMA per run of consecutive pages when runs average at
        # least this many bytes (each DMA is then near full speed); otherwise direct.
        self.min_run_bytes = min_run_bytes
        self.layer_group = layer_group
        self.max_layer_group = max_layer_group
        self.last_layer_group = last_layer_group
        self.scatter_programs = scatter_programs
        pages = max(1, min(chunk_bytes // g.bytes_per_page, l1.num_pages, l2.num_pages))
        self.chunk_pages = pages - (pages & 1) if pages > 1 else 1  # even: id slices stay 16-byte aligned
        self.chunks = chunks
        self.direct_max_bytes = direct_max_bytes
        # NOTE: the SMs reach L2 in place only when it is pinned (mapped into the device's
        # address space); Triton then takes its address like a device pointer. On CPU
        # (Triton interpreted) only an explicit "triton" goes direct: there it is a test.
        self.direct_usable = self.triton_usable and (
            backend != "torch" and l2.pinned if self.cuda else backend == "triton"
        )
        # One strided DMA per page on the copy engine (cuda-python): no SMs, no workspace.
        # On CPU only when asked for (tests of its address arithmetic).
        if copy_max_pages is not None and copy_max_pages < 0:
            raise ConfigError(f"copy_max_pages must be >= 0, got {copy_max_pages}")
        self.straight_runs = straight_runs  # the properties check them (here and when set later)
        self.straight_max_pages = straight_max_pages
        self.straight = 0  # layered H2Ds that went straight into L1
        self.d2d_runs = d2d_runs
        self.d2d_min_bytes = d2d_min_bytes
        self.d2d = 0  # layered H2Ds whose slots went into L1 by row DMAs
        self._straight_only = False  # the ring could not be had for a layered H2D
        self.copy_max_pages = (COPY_MAX_PAGES if self.cuda else 0) if copy_max_pages is None else copy_max_pages
        self.copy_usable = self.copy_max_pages > 0 and (dma.AVAILABLE or not self.cuda)
        if ring_head_pages is not None and (
            isinstance(ring_head_pages, bool) or not isinstance(ring_head_pages, int) or ring_head_pages < 0
        ):
            raise ConfigError(f"ring_head_pages must be an int >= 0, got {ring_head_pages!r}")
        # NOTE: on CPU only when asked for, as the copy path (tests of the split)
        self.ring_head_pages = (RING_HEAD_PAGES if self.cuda else 0) if ring_head_pages is None else ring_head_pages
        self.fence_policy: FencePolicy = fences
        # NOTE: off by default: alone the split copy runs nearer the plain rate, but in the
        # engine the layered prefill ended behind the whole copy (docs/RESULTS.md, latency).
        self.split_layered = split_layered
        self.gather_backend: str | None = None
        self.scatter_backend: str | None = None
        self.autotune_ms: dict[str, float] = {}
        self._ring: _Ring | None = None
        self._ids: _Ids | None = None
        self._timers: list[tuple[Any, Any]] = []  # idle (start, end) timing events
        self._warm: set[tuple[Direction, str]] = set()  # paths (and layered ways) past their first transfer
        self.paths: dict[str, int] = {"copy": 0, "direct": 0, "ring": 0, "layered": 0}
        self.allocation_failures = 0
        self._deferring = False
        self._midway: tuple[int, Callable[[], None], Any] | None = None  # flush(midway=...), not yet called
        self._midway_error: BaseException | None = None
        self._midway_s = 0.0  # time spent in midway calls (not any transfer's enqueue)
        self._pending_thread = 0  # the thread that made the deferred H2Ds
        self._pending: deque[tuple[DeviceTicket, Callable[[], None]]] = deque()  # deferred H2Ds (deferring())

    # -- backend choice ----------------------------------------------------------------------

    def _choose(self) -> None:
        if self.gather_backend is not None:
            return
        if self.requested == "torch" or not self.triton_usable:
            self.gather_backend = self.scatter_backend = "torch"
        elif self.requested == "triton":
            self.gather_backend = self.scatter_backend = "triton"
        else:
            self._autotune()
        if self.layered and self.scatter_backend == "triton":
            self._warm_layered()
        log.info(
            "hicache transfer: gather=%s scatter=%s %s", self.gather_backend, self.scatter_backend, self.autotune_ms
        )

    def _warm_layered(self) -> None:
        """Compile the layered H2D's scatter variants now, inside the first transfer's setup,
        not in a later restore's timed copy (:func:`kernels.warm_load_layers`). A failure is
        left to the first layered H2D (which falls back to torch under ``auto``)."""
        try:
            kernels.warm_load_layers(
                self.l1.slabs,
                self.layer_groups(),
                programs=self.scatter_programs,
                src=self.l2.slabs if self.direct_usable else None,
            )
        except Exception as exc:
            if self.requested == "triton" or by_signal(exc):
                raise
            warnings.warn(f"hicache: warming the layered scatter failed ({exc!r})", RuntimeWarning, stacklevel=4)

    def _autotune(self) -> None:
        """Time Triton and torch on this geometry, up to a chunk (64 pages) at a time in two
        ring slots (no allocation of their own); keep Triton for gather if <= 1.05x torch and for scatter
        if <= 1.02x. Scatter is timed into a slot seen as an L1 pool, never into L1."""
        assert self._ring is not None
        g = self.geometry
        n = min(64, self._ring.pages)
        dev = self.l1.slabs.device
        ids = torch.randperm(self.l1.num_pages, device=dev)[:n].contiguous()
        packed = self._ring.slot(0)[:n]
        scratch = self._ring.flat(1, (2 * g.num_layers, n, g.page_elements))
        scratch_ids = torch.randperm(n, device=dev)
        times: dict[str, float] = {}
        for name, fn, args in (
            ("gather_torch", kernels.gather_torch, (self.l1.slabs, ids, packed)),
            ("gather_triton", kernels.gather_triton, (self.l1.slabs, ids, packed)),
            ("scatter_torch", kernels.scatter_torch, (packed, scratch_ids, scratch)),
            ("scatter_triton", kernels.scatter_triton, (packed, scratch_ids, scratch)),
        ):
            try:
                times[name] = self._time(fn, args)
            except Exception as exc:  # a Triton failure under auto falls back to torch
                if by_signal(exc):
                    raise  # NOTE: a signal handler's (a timeout's): the caller's, not Triton's failure
                warnings.warn(f"hicache: {name} failed ({exc!r}); using torch", RuntimeWarning, stacklevel=3)
                times[name] = float("inf")
        self.autotune_ms = {k: v * 1e3 for k, v in times.items()}
        self.gather_backend = "triton" if times["gather_triton"] <= 1.05 * times["gather_torch"] else "torch"
        self.scatter_backend = "triton" if times["scatter_triton"] <= 1.02 * times["scatter_torch"] else "torch"

    def _time(self, fn: Copy, args: tuple[torch.Tensor, torch.Tensor, torch.Tensor], reps: int = 5) -> float:
        fn(*args)  # warm-up (and compile)
        samples = []
        for _ in range(reps):
            if self.cuda:
                start, end = _Event(enable_timing=True), _Event(enable_timing=True)
                start.record()
                fn(*args)
                end.record()
                end.synchronize()
                samples.append(float(start.elapsed_time(end)) / 1e3)
            else:
                t0 = time.perf_counter()
                fn(*args)
                samples.append(time.perf_counter() - t0)
        return statistics.median(samples)

    def _run(self, table: dict[str, Copy], which: str, args: tuple[torch.Tensor, torch.Tensor, torch.Tensor]) -> None:
        name = self.gather_backend if which == "gather" else self.scatter_backend
        assert name is not None
        try:
            table[name](*args)
        except Exception as exc:
            if name != "triton" or self.requested == "triton" or by_signal(exc):
                raise
            warnings.warn(
                f"hicache: triton {which} failed ({exc!r}); falling back to torch", RuntimeWarning, stacklevel=3
            )
            if which == "gather":
                self.gather_backend = "torch"
            else:
                self.scatter_backend = "torch"
            table["torch"](*args)

    # -- memory (allocated once; a failure fails the transfer) -------------------------------

    def _setup(self, path: Path) -> None:
        """Allocate the index buffers and the ring and choose the kernels, once. The direct
        path needs only the index buffers: it goes on if the ring fails (and stops asking
        for it after a failure; the other paths ask again)."""
        try:
            if self._ids is None:
                cap = max(4096, 4 * min(self.l1.num_pages, self.l2.num_pages))
                self._ids = _Ids(cap, self.l1.device, self.cuda)
        except Exception as exc:
            if by_signal(exc):
                raise
            raise _AllocationFailed(f"transfer index buffers: allocation failed: {exc!r}") from exc
        try:
            if self._ring is None and not (path == "direct" and self.allocation_failures):
                with torch.cuda.stream(self.stream) if self.cuda else contextlib.nullcontext():
                    self._ring = _Ring(self.geometry, self.chunk_pages, self.chunks, self.l1.device, self.cuda)
            if self._ring is not None:
                # NOTE: at the first transfer of any path: it also compiles the layered
                # scatter, so no restore's copy holds a compile.
                self._choose()
        except (torch.OutOfMemoryError, MemoryError, _AllocationFailed) as exc:
            self._fail_ring(path, exc)
        except Exception as exc:
            if self._ring is not None or by_signal(exc):
                raise  # not an allocation: an explicit backend that does not work here
            self._fail_ring(path, exc)

    def _fail_ring(self, path: Path, exc: BaseException) -> None:
        if path != "direct":
            raise _AllocationFailed(f"transfer ring: allocation failed: {exc!r}") from exc
        self.allocation_failures += 1
        log.warning("hicache transfer ring: allocation failed (%r); direct transfers go on", exc)

    def _timer(self) -> tuple[Any, Any]:
        if self._timers:
            return self._timers.pop()
        return _Event(enable_timing=True), _Event(enable_timing=True)

    @property
    def straight_runs(self) -> int:
        """The most page runs a layered H2D copies straight into L1 (0: never)."""
        return self._straight_runs

    @straight_runs.setter
    def straight_runs(self, value: int) -> None:
        self._straight_runs = _count("straight_runs", value)

    @property
    def straight_max_pages(self) -> int:
        """The most pages a layered H2D copies straight into L1 (0: never)."""
        return self._straight_max_pages

    @straight_max_pages.setter
    def straight_max_pages(self, value: int) -> None:
        self._straight_max_pages = _count("straight_max_pages", value)

    @property
    def d2d_runs(self) -> int:
        """The most runs of L1 pages a layered H2D through the ring fills by row DMAs from
        its slots (0: always the scatter kernel)."""
        return self._d2d_runs

    @d2d_runs.setter
    def d2d_runs(self, value: int) -> None:
        self._d2d_runs = _count("d2d_runs", value)

    @property
    def d2d_min_bytes(self) -> int:
        """The fewest bytes a layered H2D by row DMAs moves (below: straight, if it can)."""
        return self._d2d_min_bytes

    @d2d_min_bytes.setter
    def d2d_min_bytes(self, value: int) -> None:
        self._d2d_min_bytes = _count("d2d_min_bytes", value)

    def prepare(self) -> None:
        """Do the ring paths' one-time setup now: the index buffers, the choice of
        gather/scatter kernels (timed on this geometry, in the ring) and the layered
        scatter's compiles. The ring itself is freed again: it is allocated at the first
        transfer that needs it, as before, so memory sized for the forwards stays theirs.

        NOTE: otherwise the first transfer that needs the ring pays all of it, and a workload
        whose transfers take the copy and straight paths (which need none of it) meets it
        seconds later, in a live request's restore: the first fragmented one. A failure to
        allocate is logged and left to that transfer (it fails, the request recomputes); an
        explicitly requested backend that does not work here is a ConfigError."""
        if not self.cuda or self.gather_backend is not None:
            return
        try:
            self._setup("ring")
        except _AllocationFailed as exc:
            log.warning("hicache transfer: setup deferred to the first transfer: %s", exc)
        except Exception as exc:
            if by_signal(exc):
                raise
            raise ConfigError(f"the transfer engine's setup failed (backend {self.requested!r}): {exc!r}") from exc
        finally:
            if self._ring is not None:
                torch.cuda.synchronize(self.l1.device)  # the autotune's kernels have left the ring
                self._ring = None
                # NOTE: the ring's memory sits in the transfer stream's pool, which the forwards
                # cannot reuse: hand it back (a device-wide sync, once, while the cache is built).
                torch.cuda.empty_cache()

    @property
    def kernel_stream(self) -> Any:
        """The second stream of the ring pipeline (gathers and scatters of multi-chunk transfers)."""
        if self._kernel_stream is None and self.cuda:
            self._kernel_stream = _Stream(device=self.l1.device)
        return self._kernel_stream

    # -- transfers ---------------------------------------------------------------------------

    def d2h(self, src: Sequence[int], dst: Sequence[int]) -> DeviceTicket:
        """Copy L1 pages ``src`` into L2 pages ``dst`` (same order)."""
        return self._transfer(Direction.D2H, src, dst)

    def layer_groups(self) -> list[tuple[int, int]]:
        """The ``[lo, hi)`` layer ranges a layered H2D moves, in order (:func:`layer_groups`)."""
        return layer_groups(self.geometry.num_layers, self.layer_group, self.max_layer_group, self.last_layer_group)

    @property
    def layered(self) -> bool:
        """Whether :meth:`h2d` can signal layers as they land (CUDA with cuda-python)."""
        return self.cuda and dma.AVAILABLE

    def h2d(self, src: Sequence[int], dst: Sequence[int], layer_events: Sequence[Any] | None = None) -> DeviceTicket:
        """Copy L2 pages ``src`` into L1 pages ``dst``. Before reading ``dst`` on a stream,
        call ``ticket.wait_on_current_stream()`` (or ``wait()``). With ``layer_events`` (one
        ``torch.cuda.Event`` per layer) the copy goes layer by layer and records
        ``layer_events[l]`` once layer ``l`` of every page is in L1 (see the module
        docstring); where that is unavailable (:attr:`layered` False: CPU, or no cuda-python)
        the events are recorded with the last page instead."""
        if layer_events is not None and len(layer_events) not in (0, self.geometry.num_layers):
            raise ConfigError(f"layer_events: {len(layer_events)} events for {self.geometry.num_layers} layers")
        return self._transfer(Direction.H2D, src, dst, layer_events or None)

    def _transfer(
        self, direction: Direction, src: Sequence[int], dst: Sequence[int], events: Sequence[Any] | None = None
    ) -> DeviceTicket:
        t0 = time.perf_counter()
        storage = self.l1.buffer.untyped_storage()
        if (storage.data_ptr(), storage.nbytes()) != self._l1_memory:
            # NOTE: the engine freed or resized its KV pool under the cache: copies into the
            # addresses it had would write freed memory (a crash at best)
            raise MisuseError("the L1 pool's memory was freed or moved since the cache was made over it")
        d2h = direction is Direction.D2H
        l1_pages, l2_pages = (src, dst) if d2h else (dst, src)
        l1_pages = check_pages("L1", l1_pages, self.l1.num_pages)
        l2_pages = check_pages("L2", l2_pages, self.l2.num_pages)
        src, dst = (l1_pages, l2_pages) if d2h else (l2_pages, l1_pages)
        if len(src) != len(dst):
            raise PageOwnershipError(f"{direction.name}: {len(src)} source pages for {len(dst)} destinations")
        n = len(src)
        ticket = DeviceTicket(direction, n, n * self.bytes_per_page, started=t0)
        if n == 0:
            ticket.finish_now(True)
            return ticket
        if self._pending:
            self.flush()  # NOTE: a deferred H2D queues before any later transfer (stream, slots, ids)
        src_fences, dst_fences = (self.l1.fences, self.l2.fences) if d2h else (self.l2.fences, self.l1.fences)
        self._order(src_fences, src, write=False)  # NOTE: may raise; nothing has changed yet
        self._order(dst_fences, dst, write=True)
        path, runs = self._plan(n, l2_pages, events is not None and self.layered)
        layered = path == "layered" and events is not None
        straight = self._straight_plan(l1_pages, l2_pages) if layered else None
        # NOTE: fragmented L2 pages go by zero-copy loads, not through the slots: row DMAs
        # would not apply (and the straight path, where it can, keeps the SMs free)
        l1_runs = self._d2d_plan(l1_pages) if layered and not self._zero_copy(path, runs) else None
        planned = time.perf_counter() - t0

        def issue() -> None:
            ticket.flush = None  # queued now: nothing left for the ticket to flush
            taken, t1, aside = path, time.perf_counter(), self._midway_s
            counts = (self.straight, self.d2d)
            try:
                if straight is not None and (l1_runs is None or not self._ring_for(taken)):
                    # NOTE: no ring, no page ids, no kernel: nothing to set up
                    assert events is not None
                    self._issue_straight(ticket, l1_pages, l2_pages, straight, events)
                else:
                    if taken != "copy":
                        self._setup(taken)
                    taken = self._issue(ticket, taken, d2h, l1_pages, l2_pages, runs, events, l1_runs)
            except _AllocationFailed as exc:
                self.allocation_failures += 1
                log.warning("hicache %s of %d pages failed: %s", direction.name, n, exc)
                ticket.fail_now(str(exc))
                return
            self.paths[taken] += 1
            ticket.timings.enqueue_s = planned + time.perf_counter() - t1 - (self._midway_s - aside)
            # the layered H2D's three ways warm up apart: straight needs nothing, the others the ring
            way = "straight" if self.straight > counts[0] else "d2d" if self.d2d > counts[1] else taken
            if (direction, way) not in self._warm:
                # NOTE: a path's first enqueue is one-time setup (memory, autotune, kernel
                # compile and module load on first launch): counted as recurring, a ~1 s first
                # H2D made the cost model rule out restores from L2 for dozens of requests.
                ticket.timings.setup_s = ticket.timings.enqueue_s
                self._warm.add((direction, way))

        if self._deferring and events is not None:
            self._pending.append((ticket, issue))
            self._pending_thread = threading.get_ident()
            ticket.queued = threading.Event()
            ticket.bind(self._when_issued(ticket))
            ticket.flush = self.flush
        else:
            issue()
            if not self.cuda:
                ticket.poll()
                return ticket
            if ticket.ok is not None:
                return ticket
        src_fences.fence(src, ticket, write=False, owner=self)
        dst_fences.fence(dst, ticket, write=True, owner=self)
        return ticket

    # -- deferred issue ----------------------------------------------------------------------

    @contextlib.contextmanager
    def deferring(self) -> Iterator[None]:
        """Inside the block, an H2D with layer events is checked, planned and fenced at once
        but queued only by :meth:`flush` (or the first thing that needs it: a later
        transfer, its ticket's ``poll``, ``wait``, ``settle``, ``wait_on_current_stream``).

        For a forward whose per-layer waits are value waits (:func:`dma.wait_value`): it can
        be launched between the two, and then runs from the moment the first layer group
        lands instead of after the host has queued every copy of the restore."""
        was, self._deferring = self._deferring, True
        try:
            yield
        finally:
            self._deferring = was

    def flush(self, midway: Callable[[], None] | None = None, after: int = 1) -> None:
        """Queue the deferred H2Ds, in the order they were made (:meth:`deferring`). One
        whose queuing raises fails its ticket (after what it queued) instead of raising.

        ``midway`` is called once, on the caller's current stream, as soon as the first
        ``after`` layer groups of a layered H2D are queued (else once all is queued): a
        forward launched there starts on the first groups' pages while the copy engine still
        has work, and the rest is queued behind it. Its exception is raised after the flush
        (the H2Ds are queued whole either way); its time is not the transfer's enqueue."""
        if midway is None and self._pending_thread and threading.get_ident() != self._pending_thread:
            # NOTE: an I/O worker settling a ticket: deferred H2Ds are queued by the thread
            # that made them (and its midway launches run there); the worker's wait then
            # ends once they are. Nor does it touch a flush in progress there: with the last
            # H2D being queued none is pending, and that flush's midway is still to be called.
            return
        self._midway = None if midway is None else (after, midway, torch.cuda.current_stream() if self.cuda else None)
        self._midway_error = None
        try:
            while self._pending:
                ticket, issue = self._pending.popleft()
                try:
                    issue()
                except Exception as exc:
                    if by_signal(exc):  # NOTE: a signal handler's (a timeout's): the caller's to hear
                        self._fail_queued(ticket, "interrupted while queued")
                        raise
                    log.warning("hicache H2D of %d pages could not be queued: %r", ticket.pages, exc)
                    self._fail_queued(ticket, f"could not be queued: {exc!r}")
                except BaseException:
                    self._fail_queued(ticket, "interrupted while queued")
                    raise
                finally:
                    if ticket.queued is not None:
                        ticket.queued.set()
                if not self.cuda and ticket.ok is None:
                    ticket.poll()
        finally:
            self._midway_after(None)
        error, self._midway_error = self._midway_error, None
        if error is not None:
            raise error

    def _midway_after(self, groups: int | None) -> None:
        """Call the flush's ``midway`` if ``groups`` layer groups are queued (None: at the end)."""
        if self._midway is None or (groups is not None and groups < self._midway[0]):
            return
        _, fn, caller = self._midway
        self._midway = None
        t0 = time.perf_counter()
        try:
            with torch.cuda.stream(caller) if caller is not None else contextlib.nullcontext():
                fn()
        except BaseException as exc:  # raised by flush once its H2Ds are queued
            self._midway_error = exc
        finally:
            self._midway_s += time.perf_counter() - t0

    def _when_issued(self, ticket: DeviceTicket) -> Callable[[bool], bool | None]:
        """A deferred ticket's check until it is queued: queue it, then ask its own check."""

        def check(block: bool) -> bool | None:
            self.flush()  # binds the ticket's own check, or finishes it
            if ticket.ok is not None:
                return ticket.ok  # finished while queuing (an allocation failure): the same result
            if ticket._check is check:
                raise RuntimeError("a deferred H2D was not queued")
            return ticket._check(block) if ticket._check is not None else None

        return check

    def _fail_queued(self, ticket: DeviceTicket, error: str) -> None:
        """Fail ``ticket`` once what it queued before raising has run (its pages are reused
        only after that)."""
        end = None
        if self.cuda:
            if self._kernel_stream is not None:
                self.stream.wait_stream(self._kernel_stream)
            end = torch.cuda.Event()  # type: ignore[no-untyped-call]
            end.record(self.stream)
        ticket.event, ticket.stream = end, self.stream

        def check(block: bool) -> bool | None:
            if end is not None:
                if block:
                    end.synchronize()
                elif not end.query():  # type: ignore[no-untyped-call]
                    return None
            ticket.error = error
            ticket.event = None
            return False

        ticket.bind(check)

    def _plan(self, n: int, l2_pages: Sequence[int], layered: bool) -> tuple[Path, list[tuple[int, int]]]:
        nbytes = n * self.bytes_per_page
        if not layered and self.copy_usable and n <= self.copy_max_pages:
            return "copy", []
        if not layered and self.direct_usable and nbytes <= self.direct_max_bytes:
            return "direct", []
        runs = page_runs(l2_pages)
        if layered and (self.l2.pinned or not self.cuda):
            return "layered", runs
        if self.direct_usable and len(runs) > 1 and nbytes < self.min_run_bytes * len(runs):
            return "direct", runs
        return "ring", runs

    def _order(self, fences: PageFences, pages: Sequence[int], *, write: bool) -> None:
        """Order this transfer after every transfer in flight that conflicts on ``pages``
        (module docstring): this engine's own are ordered by its stream already."""
        for other in fences.pending(pages, write=write, exclude=self):
            if self.fence_policy == "raise":
                named = fences.pages_of(other, pages)
                raise PagesInFlightError(
                    f"{fences.name}: pages {named} are still {'moved' if write else 'written'} by a "
                    f"{other.direction.name} in flight; wait for its ticket first"
                )
            if isinstance(other, DeviceTicket) and other.event is not None and self.cuda:
                self.stream.wait_event(other.event)
            else:
                other.wait()

    def _issue(
        self,
        ticket: DeviceTicket,
        path: Path,
        d2h: bool,
        l1_pages: Sequence[int],
        l2_pages: Sequence[int],
        runs: list[tuple[int, int]],
        events: Sequence[Any] | None,
        l1_runs: list[tuple[int, int]] | None = None,
    ) -> Path:
        """Queue the copies (CPU: run them); returns the path taken, attaches the check.
        ``l1_runs``: a layered H2D fills these runs of L1 pages by row DMAs (:meth:`_unpack`)."""
        if path == "copy":
            return self._issue_copy(ticket, d2h, l1_pages, l2_pages, events)
        assert self._ids is not None
        head = self._ring_head(path, d2h, len(l1_pages))
        all_l1, all_l2 = l1_pages, l2_pages
        if head:
            # the ring moves the rest; its ids and runs are the rest's
            l1_pages, l2_pages, runs = l1_pages[head:], l2_pages[head:], page_runs(l2_pages[head:])
        n = len(l1_pages)
        zero_copy = path == "direct" or self._zero_copy(path, runs)
        # NOTE: row DMAs out of the ring read no page ids: none are written or uploaded
        rows_only = path == "layered" and l1_runs is not None and not zero_copy
        at, count = (0, 0) if rows_only else self._ids.put(l1_pages, l2_pages) if zero_copy else self._ids.put(l1_pages)
        timer = self._timer() if self.cuda else None
        t = time.perf_counter()
        if timer is not None:
            self._wait_caller()
        # NOTE: the ring switches to its kernel stream itself (its DMAs name their stream):
        # a switch here too would only add two of torch's stream lookups
        with torch.cuda.stream(self.stream) if self.cuda and path != "ring" else contextlib.nullcontext():
            try:
                if timer is not None:
                    timer[0].record(self.stream)
                ids = None if rows_only else self._ids.upload(at, count, timer[1] if timer else None, self.stream)
                l1_ids = ids[:n] if ids is not None else None
                l2_ids = ids[n + (n & 1) : 2 * n + (n & 1)] if ids is not None and zero_copy else None
                if path == "direct":
                    assert l1_ids is not None and l2_ids is not None
                    path = self._direct(d2h, l1_ids, l2_ids, l2_pages, runs)
                if path == "layered":
                    assert events is not None
                    self._layered_copies(l1_ids, l2_ids, l2_pages, runs, events, l1_pages, l1_runs)
                elif path == "ring":
                    assert l1_ids is not None
                    first = None
                    if head:
                        pairs = list(zip(all_l2[:head], all_l1[:head], strict=True))
                        first = functools.partial(self._copy_pairs, True, pairs)
                    self._ring_copies(d2h, l1_ids, l2_pages, runs, first)
                if events is not None and path != "layered":
                    for event in {id(e): e for e in events}.values():  # every layer lands with the last page
                        event.record(self.stream)
            except BaseException:
                if self._kernel_stream is not None:
                    # NOTE: a raise part-way leaves kernels queued on the kernel stream that
                    # read ring slots and page ids; the end event (reused region, slots) must
                    # come after them, as it does when the transfer completes.
                    self.stream.wait_stream(self._kernel_stream)
                raise
            finally:
                if timer is not None:  # NOTE: always: the id region waits on it before reuse
                    timer[1].record(self.stream)
        if timer is None:
            ticket.timings.service_s = time.perf_counter() - t
        else:
            ticket.event, ticket.stream = timer[1], self.stream
        fault = self.faults.take("write" if d2h else "read", ("fail", "slow"))
        ticket.bind(self._checker(ticket, timer, fault.kind if fault else None, fault.delay_s if fault else 0.0))
        return path

    def _ring_head(self, path: Path, d2h: bool, n: int) -> int:
        """How many of a ring D2H's first pages go as the copy path does (:data:`RING_HEAD_PAGES`):
        none unless the ring keeps at least as many."""
        head = self.ring_head_pages if path == "ring" and d2h and (dma.AVAILABLE or not self.cuda) else 0
        return head if n >= 2 * head else 0

    def _copy_pairs(self, d2h: bool, pairs: Sequence[tuple[int, int]]) -> None:
        """One strided DMA per ``(destination, source)`` page pair between L1 and L2, on the
        transfer stream (CPU: at once); L2 pages first in a D2H's pairs, L1 pages in an H2D's."""
        l1, l2, width, rows = self._page_rows
        (dst, dpage, dpitch), (src, spage, spitch) = (l2, l1) if d2h else (l1, l2)
        dma.copy_pages(dst, dpage, dpitch, src, spage, spitch, width, rows, pairs, self.stream)

    def _issue_copy(
        self,
        ticket: DeviceTicket,
        d2h: bool,
        l1_pages: Sequence[int],
        l2_pages: Sequence[int],
        events: Sequence[Any] | None,
    ) -> Path:
        """The copy path: one strided DMA per page between L1 and L2 (:func:`dma.copy_pages`).

        L1  [2*layers, pages, E]:  page p = 2*layers rows of E elements, a slab apart
        L2  [pages, 2*layers, E]:  page q = the same rows, contiguous
        """
        pairs = list(zip(l2_pages, l1_pages, strict=True) if d2h else zip(l1_pages, l2_pages, strict=True))
        timer = self._timer() if self.cuda else None
        t = time.perf_counter()
        if timer is not None:
            # NOTE: every call below names the stream: no current-stream switch (its host
            # cost is a fair part of a one-page transfer's).
            self._wait_caller()
            timer[0].record(self.stream)
            try:
                self._copy_pairs(d2h, pairs)
                for event in {id(e): e for e in events or ()}.values():  # every layer lands with the last page
                    event.record(self.stream)
            finally:
                timer[1].record(self.stream)
            ticket.event, ticket.stream = timer[1], self.stream
        else:
            self._copy_pairs(d2h, pairs)
            ticket.timings.service_s = time.perf_counter() - t
        fault = self.faults.take("write" if d2h else "read", ("fail", "slow"))
        ticket.bind(self._checker(ticket, timer, fault.kind if fault else None, fault.delay_s if fault else 0.0))
        return "copy"

    def _zero_copy(self, path: Path, runs: list[tuple[int, int]]) -> bool:
        """Whether a layered H2D loads its L2 pages in place (fragmented L2, Triton usable)."""
        return path == "layered" and len(runs) > 1 and self.direct_usable

    def _d2d_plan(self, l1_pages: Sequence[int]) -> list[tuple[int, int]] | None:
        """The runs of consecutive L1 pages, if there are at most ``d2d_runs`` of them and
        the pages hold at least ``d2d_min_bytes``: a layered H2D through the ring then fills
        them by row DMAs from its slots."""
        if not self.d2d_runs or len(l1_pages) * self.bytes_per_page < self.d2d_min_bytes:
            return None
        runs = page_runs(l1_pages)
        return runs if len(runs) <= self.d2d_runs else None

    def _ring_for(self, path: Path) -> bool:
        """Whether the ring is (now) set up for ``path``. A layered H2D that could also go
        straight asks with this: where the ring cannot be allocated it goes straight, and so
        do later ones without asking again (a failed allocation can cost a device sync)."""
        if self._straight_only:
            return False
        if self._ring is not None and self._ids is not None:
            return True
        try:
            self._setup(path)
            return True
        except _AllocationFailed as exc:
            self.allocation_failures += 1
            self._straight_only = True
            log.warning("hicache layered H2D: %s; straight into L1 from now on", exc)
            return False

    def _straight_plan(self, l1_pages: Sequence[int], l2_pages: Sequence[int]) -> list[tuple[int, int]] | None:
        """The runs over which both page lists step by one, if there are at most
        ``straight_runs`` of them and at most ``straight_max_pages`` pages (the L1 allocator
        hands out consecutive runs when it can)."""
        if not self.straight_runs or len(l1_pages) > self.straight_max_pages:
            return None
        runs = coalesce(l1_pages, l2_pages)
        return runs if len(runs) <= self.straight_runs else None

    def _issue_straight(
        self,
        ticket: DeviceTicket,
        l1_pages: Sequence[int],
        l2_pages: Sequence[int],
        runs: list[tuple[int, int]],
        events: Sequence[Any],
    ) -> None:
        """A layered H2D straight into L1: per layer group, per run and per K/V row of each
        of its layers, one strided DMA (a row of every page of the run: L2 rows a page
        apart, L1 rows contiguous); then the group's distinct events. No ring (not even set
        up), no page ids, no kernel, one stream: the copy engine runs from one group to the
        next.

            L2  [pages, 2*layers, E]  row r of page q at (q * 2*layers + r) * slab
            L1  [2*layers, pages, E]  row r of page p at (r * pages + p) * slab
        """
        g = self.geometry
        layers, slab = g.num_layers, g.page_elements * self.l1.buffer.element_size()
        l1_at, l1_row = self.l1.slabs.data_ptr(), self.l1.num_pages * slab
        l2_at, l2_page = self.l2.slabs.data_ptr(), 2 * layers * slab
        plan = [(l1_at + l1_pages[a] * slab, l2_at + l2_pages[a] * l2_page, b - a) for a, b in runs]
        timer = self._timer() if self.cuda else None
        t = time.perf_counter()
        if timer is not None:
            self._wait_caller()
            timer[0].record(self.stream)
        try:
            for i, (lo, hi) in enumerate(self.layer_groups()):
                for row in itertools.chain(range(lo, hi), range(layers + lo, layers + hi)):
                    for dst, src, count in plan:
                        rows = (dst + row * l1_row, slab, src + row * slab, l2_page, slab, count)
                        if timer is not None:
                            dma.copy_rows_raw(*rows, self.stream)
                        else:
                            dma.copy_rows_host(*rows)
                for event in {id(e): e for e in events[lo:hi]}.values():
                    self._record_layer(event, self.stream)
                self._midway_after(i + 1)
        finally:
            if timer is not None:
                timer[1].record(self.stream)
        if timer is None:
            ticket.timings.service_s = time.perf_counter() - t
        else:
            ticket.event, ticket.stream = timer[1], self.stream
        self.straight += 1
        fault = self.faults.take("read", ("fail", "slow"))
        ticket.bind(self._checker(ticket, timer, fault.kind if fault else None, fault.delay_s if fault else 0.0))

    def _checker(
        self, ticket: DeviceTicket, timer: tuple[Any, Any] | None, fault: str | None, delay: float
    ) -> Callable[[bool], bool | None]:
        def check(block: bool) -> bool | None:
            if timer is not None:
                start, end = timer
                if block:
                    end.synchronize()
                elif not end.query():
                    return None
                ticket.timings.service_s = start.elapsed_time(end) / 1e3
                ticket.event = None
                self._timers.append(timer)
            t1 = time.perf_counter()
            if delay:
                time.sleep(delay)
            ticket.timings.complete_s = time.perf_counter() - t1
            if fault == "fail":
                ticket.error = "injected transfer failure"
                return False
            return True

        return check

    # -- stream order: each wait has a GPU test that fails without it ------------------------

    def _wait_caller(self) -> None:
        """The transfer stream waits for the caller's current stream (module docstring).

        NOTE: through one event of the engine's, recorded again each time (a wait holds the
        record made before it): ``Stream.wait_stream`` makes and frees a CUDA event per call,
        a fair part of a one-page transfer's host time; the caller's stream is looked up
        by :func:`current_stream`."""
        caller = self._caller
        caller.record(current_stream(self._device))
        self.stream.wait_event(caller)

    def _wait_join(self, waiter: Any, other: Any) -> None:
        """``waiter`` (the kernel stream) starts behind everything queued on ``other``."""
        waiter.wait_stream(other)

    def _wait_ready(self, consumer: Any, event: Any) -> None:
        """A chunk's consumer (DMA after gather, scatter after DMA) waits for its producer."""
        consumer.wait_event(event)

    def _wait_free(self, producer: Any, event: Any) -> None:
        """Reusing a ring slot waits until the slot's previous consumer has finished."""
        producer.wait_event(event)

    def _record_layer(self, event: Any, stream: Any) -> None:
        """A layer group's event, on the stream of that group's last scatter or load (the
        forward waiting on it must see those layers of every page)."""
        event.record(stream)

    def _wait_done(self, stream: Any, kern: Any) -> None:
        """A layered H2D ends on ``stream`` only after its last scatter, load and record on
        the kernel stream (the ticket's event then means every layer landed)."""
        stream.wait_stream(kern)

    # -- the three paths ---------------------------------------------------------------------

    def _direct(
        self,
        d2h: bool,
        l1_ids: torch.Tensor,
        l2_ids: torch.Tensor,
        l2_pages: Sequence[int],
        runs: list[tuple[int, int]],
    ) -> Path:
        """One kernel between L1 and the L2 pages in place; on a Triton failure under
        ``auto``, returns "ring" (the caller then goes through it, as later transfers do)."""
        try:
            if d2h:
                kernels.gather_triton(self.l1.slabs, l1_ids, self.l2.slabs, l2_ids)
            else:
                kernels.scatter_triton(self.l2.slabs, l1_ids, self.l1.slabs, l2_ids)
            return "direct"
        except Exception as exc:
            if self.requested == "triton":
                raise
            warnings.warn(
                f"hicache: direct transfer failed ({exc!r}); using the ring from now on", RuntimeWarning, stacklevel=5
            )
            self.direct_usable = False
        self._setup("ring")
        if not runs:
            runs[:] = page_runs(l2_pages)
        return "ring"

    def _dma_runs(
        self, slot: torch.Tensor, to_l2: bool, runs: Iterator[tuple[int, int]], a: int, l2_pages: Sequence[int]
    ) -> None:
        """The DMAs between ring slot ``slot`` (holding pages ``a ..``) and L2, one per run
        of consecutive L2 pages, queued on the transfer stream in one batched call where the
        runtime has it (:func:`dma.copy_batch`); on CPU the same addresses, copied at once."""
        if self.cuda and not dma.AVAILABLE:
            l2 = self.l2.slabs
            with torch.cuda.stream(self.stream):
                for first, end in runs:
                    h, part = l2_pages[first], slot[first - a : end - a]
                    (l2[h : h + end - first].copy_(part, non_blocking=True) if to_l2 else
                     part.copy_(l2[h : h + end - first], non_blocking=True))  # fmt: skip
            return
        bpp = self.bytes_per_page
        slot_at, l2_at = slot.data_ptr(), self.l2.slabs.data_ptr()
        copies = []
        for first, end in runs:
            ring, host, nbytes = slot_at + (first - a) * bpp, l2_at + l2_pages[first] * bpp, (end - first) * bpp
            copies.append((host, ring, nbytes) if to_l2 else (ring, host, nbytes))
        dma.copy_batch(copies, self.stream)

    def _ring_copies(
        self,
        d2h: bool,
        ids: torch.Tensor,
        l2_pages: Sequence[int],
        runs: list[tuple[int, int]],
        head: Callable[[], None] | None = None,
    ) -> None:
        """Chunk by chunk through the ring (module docstring). One chunk runs on the
        transfer stream alone; more alternate with the kernel stream. ``head`` (a D2H's first
        pages by the copy path) is queued on the transfer stream once the kernel stream has
        joined it: the DMAs run while the first gather is launched and runs."""
        ring = self._ring
        assert ring is not None
        n = ids.numel()
        spans = [(a, min(n, a + ring.pages)) for a in range(0, n, ring.pages)]
        two = self.cuda and (len(spans) > 1 or head is not None)
        copy, kern = self.stream, self.kernel_stream if two else self.stream
        if two:
            self._wait_join(kern, copy)
        if head is not None:
            head()
        k = 0
        # NOTE: one switch to the kernel stream for the whole loop (a switch costs two of
        # torch's stream lookups): only the kernels go by the current stream; the DMAs,
        # records and waits name theirs.
        with torch.cuda.stream(kern) if self.cuda else contextlib.nullcontext():
            for j, (a, b) in enumerate(spans):
                k = j % ring.count
                slot = ring.slot(k)[: b - a]
                if d2h:
                    if two and j >= ring.count:
                        self._wait_free(kern, ring.free[k])
                    self._run(GATHER, "gather", (self.l1.slabs, ids[a:b], slot))
                    if two:
                        ring.ready[k].record(kern)
                        self._wait_ready(copy, ring.ready[k])
                    self._dma_runs(slot, True, _clip(runs, a, b), a, l2_pages)
                    if two:
                        ring.free[k].record(copy)
                else:
                    if two and j >= ring.count:
                        self._wait_free(copy, ring.free[k])
                    self._dma_runs(slot, False, _clip(runs, a, b), a, l2_pages)
                    if two:
                        ring.ready[k].record(copy)
                        self._wait_ready(kern, ring.ready[k])
                    self._run(SCATTER, "scatter", (slot, ids[a:b], self.l1.slabs))
                    if two:
                        ring.free[k].record(kern)
        if two and not d2h:
            self._wait_ready(copy, ring.free[k])  # the ticket's event comes after the last scatter

    def _on(self, stream: Any) -> Any:
        other = self.cuda and stream is not None and stream is not self.stream
        return torch.cuda.stream(stream) if other else contextlib.nullcontext()

    def _layered_copies(
        self,
        ids: torch.Tensor | None,
        l2_ids: torch.Tensor | None,
        l2_pages: Sequence[int],
        runs: list[tuple[int, int]],
        events: Sequence[Any],
        l1_pages: Sequence[int],
        l1_runs: list[tuple[int, int]] | None = None,
    ) -> None:
        """Per group of layers: its layers of every page into L1 (zero-copy from L2 given
        ``l2_ids``; else strided DMAs into ring slots in the compact layout, units of as
        many pages as a slot holds, each moved into L1 by :meth:`_unpack`), then one record
        per distinct event of the group. DMAs on the transfer stream; with ``split_layered``
        or ``l1_runs`` (CUDA) the unpacking, loads and records on the kernel stream, so a
        group's unpacking overlaps the next group's DMAs; a slot is refilled only after
        it was unpacked, and the transfer ends after the kernel stream's last work."""
        g = self.geometry
        layers, n = g.num_layers, len(l1_pages)
        ring = self._ring
        assert ring is not None
        two = self.cuda and (self.split_layered or l1_runs is not None)
        copy, kern = self.stream, self.kernel_stream if two else None
        if kern is not None:
            self._wait_join(kern, copy)
        unit = 0
        for i, (lo, hi) in enumerate(self.layer_groups()):
            count = hi - lo
            loaded = False
            if l2_ids is not None:
                assert ids is not None
                with self._on(kern):
                    loaded = self._load_in_place(l2_ids, ids, (lo, hi))
            if not loaded:
                per = max(1, ring.pages * layers // count)
                per -= per & 1 if per > 1 else 0
                for a in range(0, n, per):
                    b = min(n, a + per)
                    k = unit % ring.count
                    if kern is not None and unit >= ring.count:
                        self._wait_free(copy, ring.free[k])
                    unit += 1
                    self._layer_dmas(ring.at(k), (lo, hi), _clip(runs, a, b), a, l2_pages)
                    if kern is not None:
                        ring.ready[k].record(copy)
                        self._wait_ready(kern, ring.ready[k])
                    self._unpack(k, (lo, hi), (a, b), ids, l1_pages, l1_runs, kern)
                    if kern is not None:
                        ring.free[k].record(kern)
            for event in {id(e): e for e in events[lo:hi]}.values():
                self._record_layer(event, kern if kern is not None else self.stream)
            self._midway_after(i + 1)
        if kern is not None:
            self._wait_done(copy, kern)
        if l1_runs is not None and unit:
            self.d2d += 1

    def _unpack(
        self,
        k: int,
        layers: tuple[int, int],
        span: tuple[int, int],
        ids: torch.Tensor | None,
        l1_pages: Sequence[int],
        l1_runs: list[tuple[int, int]] | None,
        stream: Any,
    ) -> None:
        """Ring slot ``k`` holding layers ``[lo, hi)`` of pages ``a .. b`` (compact layout) into
        their L1 pages. Given ``l1_runs``: per run and per K/V row of each layer one row DMA
        on ``stream`` (the copy engine: device to device, no SMs taken from the forward it
        overlaps; on CPU the same addresses, copied at once); else the scatter kernel.

            slot  [pages, 2*count, E]   row (kv, i) of page j at (j * 2*count + kv*count + i) * slab
            L1    [2*layers, pages, E]  row r of page p at (r * pages + p) * slab
        """
        a, b = span
        g, ring = self.geometry, self._ring
        assert ring is not None
        lo, hi = layers
        count = hi - lo
        if l1_runs is None:
            assert self._ids is not None and ids is not None
            buf = ring.flat(k, (b - a, 2 * count, g.page_elements))
            with self._on(stream):
                self._scatter_layers(buf, self._ids.arange[: b - a], ids[a:b], layers)
            return
        slab = self._slab
        pitch = 2 * count * slab  # a page in the slot
        l1_at, l1_row, out = self.l1.slabs.data_ptr(), self.l1.num_pages * slab, ring.at(k)
        for first, end in _clip(l1_runs, a, b):
            dst, src = l1_at + l1_pages[first] * slab, out + (first - a) * pitch
            for kv in (0, 1):
                for i in range(count):
                    rows = (dst + (kv * g.num_layers + lo + i) * l1_row, slab, src + (kv * count + i) * slab)
                    if self.cuda:
                        dma.copy_rows_device(*rows, pitch, slab, end - first, stream)
                    else:
                        dma.copy_rows_host(*rows, pitch, slab, end - first)

    def _layer_dmas(
        self,
        out: int,
        layers: tuple[int, int],
        runs: Iterator[tuple[int, int]],
        a: int,
        l2_pages: Sequence[int],
    ) -> None:
        """Layers ``[lo, hi)`` of pages ``a ..`` from L2 into the compact slot at ``out``: per
        run of consecutive L2 pages one strided DMA of the K slabs and one of the V slabs,
        on the transfer stream (on CPU the same addresses, copied at once)."""
        g = self.geometry
        lo, hi = layers
        count, slab = hi - lo, self._slab  # bytes of one layer's K (or V) of a page
        pitch = 2 * g.num_layers * slab  # bytes of a page in L2
        dpitch = 2 * count * slab
        base = self.l2.slabs.data_ptr()
        # NOTE: the DMAs go by address (L2 is pinned, checked at planning): per-copy checks of
        # views cost more host time than the copies' enqueue, and the forward launches after it.
        for first, end in runs:
            for kv in (0, 1):
                dst = out + (first - a) * dpitch + kv * count * slab
                src = base + l2_pages[first] * pitch + (kv * g.num_layers + lo) * slab
                if self.cuda:
                    dma.copy_rows_raw(dst, dpitch, src, pitch, count * slab, end - first, self.stream)
                else:
                    dma.copy_rows_host(dst, dpitch, src, pitch, count * slab, end - first)

    def _load_in_place(self, l2_ids: torch.Tensor, ids: torch.Tensor, layers: tuple[int, int]) -> bool:
        """Layers of fragmented pages straight from L2 (zero-copy); False after a Triton
        failure under ``auto`` (the caller then uses DMAs, and so do later transfers)."""
        if not self.direct_usable:
            return False
        try:
            kernels.load_layers_triton(
                self.l2.slabs, l2_ids, self.l1.slabs, ids, layers, programs=self.scatter_programs
            )
            return True
        except Exception as exc:
            if self.requested == "triton":
                raise
            warnings.warn(f"hicache: zero-copy layer load failed ({exc!r})", RuntimeWarning, stacklevel=4)
            self.direct_usable = False
            return False

    def _scatter_layers(
        self, packed: torch.Tensor, rows: torch.Tensor, ids: torch.Tensor, layers: tuple[int, int]
    ) -> None:
        """Layers ``[lo, hi)`` of a compact workspace into their L1 pages; a Triton failure
        under ``auto`` falls back to torch for good, as the whole-run scatter does (:meth:`_run`)."""
        if self.scatter_backend == "triton":
            try:
                kernels.load_layers_triton(
                    packed, rows, self.l1.slabs, ids, layers, programs=self.scatter_programs, compact=True
                )
                return
            except Exception as exc:
                if self.requested == "triton":
                    raise
                warnings.warn(
                    f"hicache: triton layered scatter failed ({exc!r}); falling back to torch",
                    RuntimeWarning,
                    stacklevel=4,
                )
                self.scatter_backend = "torch"
        kernels.load_layers_torch(packed, rows, self.l1.slabs, ids, layers, compact=True)

    # -- observability -----------------------------------------------------------------------

    def status(self) -> dict[str, Any]:
        """Backends, paths taken, and transfer memory: the ring's cap is fixed at
        construction, whatever the transfers' sizes; it is allocated at first use."""
        bpp = self.bytes_per_page
        ring = self._ring.nbytes if self._ring is not None else 0
        index = self._ids.nbytes if self._ids is not None else 0
        return {
            "requested": self.requested,
            "gather": self.gather_backend,
            "scatter": self.scatter_backend,
            "autotune_ms": dict(self.autotune_ms),
            "direct": self.direct_usable,
            "direct_max_bytes": self.direct_max_bytes,
            "copy": self.copy_usable,
            "copy_max_pages": self.copy_max_pages,
            "ring_head_pages": self.ring_head_pages,
            "chunk_pages": self.chunk_pages,
            "chunks": self.chunks,
            "chunk_bytes": self.chunk_pages * bpp,
            "ring_cap_bytes": self.chunk_pages * self.chunks * bpp,
            "workspaces": int(self._ring is not None),
            "workspace_device_bytes": ring,
            "workspace_pinned_bytes": 0,
            "index_bytes": index,
            "paths": dict(self.paths),
            "allocation_failures": self.allocation_failures,
            "fences": self.fence_policy,
            "split_layered": self.split_layered,
            "straight_runs": self.straight_runs,
            "straight_max_pages": self.straight_max_pages,
            "straight": self.straight,
            "d2d_runs": self.d2d_runs,
            "d2d_min_bytes": self.d2d_min_bytes,
            "d2d": self.d2d,
            "device": str(self.l1.device),
        }

    def synchronize(self) -> None:
        self.flush()
        if self.cuda:
            self.stream.synchronize()
            if self._kernel_stream is not None:
                self._kernel_stream.synchronize()
