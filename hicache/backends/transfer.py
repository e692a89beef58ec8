"""L1 <-> L2 transfers: one gather kernel plus one DMA per direction (DESIGN.md §6).

D2H::

    L1 pages --gather (1 launch)--> packed device buffer --1 DMA--> L2 pages (consecutive)
                                                         \\-1 DMA--> pinned workspace
                                                                   --index_copy_--> L2 pages

H2D is symmetric: host gather only when the L2 pages are fragmented, one DMA, one scatter
launch into arbitrary L1 pages.

Layered H2D (``h2d(..., layer_events=...)``, CUDA with cuda-python): the same source, moved
in groups of layers (:meth:`TransferEngine.layer_groups`: small at both ends, up to
``max_layer_group`` in the middle; few groups keep the host's enqueue short, and the forward
launches only after it): per group
two strided DMAs per run (its K and V slabs of every page,
:func:`hicache.backends.dma.copy_rows`), one scatter of those layers into L1 with at most
``scatter_programs`` programs (the forward that overlaps it keeps the other SMs), then each
distinct event among ``layer_events[lo:hi]`` is recorded once (a caller that shares one
event across a group's layers saves the records). A forward that waits on
``layer_events[l]`` before its layer ``l`` reads the restored pages while later layers are
still on the wire (``hicache.engine`` does). The ticket still completes only after the last
layer: publication and the state machine are unchanged.

Streams: the private transfer stream first waits on the caller's current stream (page ids
and pages it produced are ready), and the caller makes its stream wait on the ticket's
event (:meth:`DeviceTicket.wait_on_current_stream`) before reading restored pages. Tensors
used on the transfer stream are kept alive by the ticket until its event completes.

On a CPU-only machine the same API runs synchronously (no streams; tickets finish at once).
"""

from __future__ import annotations

import itertools
import logging
import os
import statistics
import time
import warnings
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

import torch

from hicache.backends import dma, kernels
from hicache.backends.faults import FaultInjector
from hicache.backends.pools import DevicePool, HostPool, check_pages, coalesce
from hicache.backends.ticket import Ticket
from hicache.errors import ConfigError, PageOwnershipError
from hicache.spec.model import Direction

log = logging.getLogger(__name__)

TransferBackend = Literal["auto", "triton", "torch"]
Copy = Callable[[torch.Tensor, torch.Tensor, torch.Tensor], None]

GATHER: dict[str, Copy] = {"torch": kernels.gather_torch, "triton": kernels.gather_triton}
SCATTER: dict[str, Copy] = {"torch": kernels.scatter_torch, "triton": kernels.scatter_triton}
# torch.cuda's Stream and Event constructors are unannotated; use them through Any.
_Stream: Any = torch.cuda.Stream
_Event: Any = torch.cuda.Event


def page_runs(pages: Sequence[int]) -> list[tuple[int, int]]:
    """``(first, end)`` index ranges over which ``pages`` step by one."""
    return coalesce(pages, pages)


@dataclass(eq=False)
class Workspace:
    """A packed device buffer of ``pages`` pages, and (only once the fragmented path needs
    it) a pinned host buffer of the same size."""

    pages: int
    device: torch.Tensor
    host: torch.Tensor | None = None
    busy: bool = False


@dataclass(eq=False)
class DeviceTicket(Ticket):
    event: Any = None  # torch.cuda.Event recorded after the last copy
    keep: list[Any] = field(default_factory=list)

    def wait_on_current_stream(self) -> None:
        """Make the caller's current CUDA stream wait for this transfer (no CPU block)."""
        if self.event is not None:
            torch.cuda.current_stream().wait_event(self.event)


class TransferEngine:
    """Moves pages between a :class:`DevicePool` (L1) and a :class:`HostPool` (L2)."""

    def __init__(
        self,
        l1: DevicePool,
        l2: HostPool,
        backend: TransferBackend = "auto",
        *,
        faults: FaultInjector | None = None,
        min_run_bytes: int = 256 * 1024,
        layer_group: int = 1,
        max_layer_group: int = 8,
        scatter_programs: int = 32,
    ) -> None:
        if backend not in ("auto", "triton", "torch"):
            raise ConfigError(f"transfer backend must be auto, triton or torch; got {backend!r}")
        if l1.geometry != l2.geometry:
            raise ConfigError("L1 and L2 pools have different geometries")
        if min(layer_group, max_layer_group, scatter_programs) < 1 or max_layer_group < layer_group:
            raise ConfigError(
                "need 1 <= layer_group <= max_layer_group and scatter_programs >= 1, got "
                f"{layer_group}, {max_layer_group}, {scatter_programs}"
            )
        self.l1 = l1
        self.l2 = l2
        self.geometry = l1.geometry
        self.requested = backend
        self.cuda = l1.device.type == "cuda"
        self.triton_usable = kernels.HAVE_TRITON and (self.cuda or os.environ.get("TRITON_INTERPRET") == "1")
        if backend == "triton" and not self.triton_usable:
            raise ConfigError("transfer backend 'triton' needs triton and a CUDA device (or TRITON_INTERPRET=1)")
        self.stream: Any = _Stream(device=l1.device) if self.cuda else None
        self.faults = faults or FaultInjector()
        # Fragmented L2 pages: one DMA per run of consecutive pages when runs average at
        # least this many bytes (each DMA is then near full speed); otherwise one DMA into
        # a pinned workspace plus one host index_copy_.
        self.min_run_bytes = min_run_bytes
        self.layer_group = layer_group
        self.max_layer_group = max_layer_group
        self.scatter_programs = scatter_programs
        self.gather_backend: str | None = None
        self.scatter_backend: str | None = None
        self.autotune_ms: dict[str, float] = {}
        self.workspaces: list[Workspace] = []
        self._warm: set[tuple[Direction, bool]] = set()  # (direction, layered) past their first (cold) transfer
        self.pinned_bytes = 0
        self.device_workspace_bytes = 0

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
            kernels.warm_load_layers(self.l1.slabs, self.layer_groups(), programs=self.scatter_programs)
        except Exception as exc:
            if self.requested == "triton":
                raise
            warnings.warn(f"hicache: warming the layered scatter failed ({exc!r})", RuntimeWarning, stacklevel=4)

    def _autotune(self) -> None:
        """Time Triton and torch on this geometry; keep Triton for gather if <= 1.05x torch
        and for scatter if <= 1.02x. Scatter is timed into a scratch buffer, never L1."""
        g = self.geometry
        n = min(64, self.l1.num_pages)
        slabs = self.l1.slabs
        ids = torch.randperm(self.l1.num_pages, device=slabs.device)[:n].contiguous()
        packed = torch.empty((n, 2 * g.num_layers, g.page_elements), dtype=g.dtype, device=slabs.device)
        scratch = torch.empty((2 * g.num_layers, n, g.page_elements), dtype=g.dtype, device=slabs.device)
        scratch_ids = torch.randperm(n, device=slabs.device)
        times: dict[str, float] = {}
        for name, fn, args in (
            ("gather_torch", kernels.gather_torch, (slabs, ids, packed)),
            ("gather_triton", kernels.gather_triton, (slabs, ids, packed)),
            ("scatter_torch", kernels.scatter_torch, (packed, scratch_ids, scratch)),
            ("scatter_triton", kernels.scatter_triton, (packed, scratch_ids, scratch)),
        ):
            try:
                times[name] = self._time(fn, args)
            except Exception as exc:  # a Triton failure under auto falls back to torch
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
            if name != "triton" or self.requested == "triton":
                raise
            warnings.warn(
                f"hicache: triton {which} failed ({exc!r}); falling back to torch", RuntimeWarning, stacklevel=3
            )
            if which == "gather":
                self.gather_backend = "torch"
            else:
                self.scatter_backend = "torch"
            table["torch"](*args)

    # -- workspaces --------------------------------------------------------------------------

    def _acquire(self, pages: int, *, needs_host: bool) -> tuple[Workspace, float]:
        """Best fit by page count; returns (workspace, one-time setup seconds)."""
        t0 = time.perf_counter()
        idle = [w for w in self.workspaces if not w.busy and w.pages >= pages]
        ws = min(idle, key=lambda w: (w.pages, w.host is None and needs_host)) if idle else None
        g = self.geometry
        if ws is None:
            shape = (pages, 2 * g.num_layers, g.page_elements)
            if self.cuda:
                with torch.cuda.stream(self.stream):
                    dev = torch.empty(shape, dtype=g.dtype, device=self.l1.device)
            else:
                dev = torch.empty(shape, dtype=g.dtype)
            ws = Workspace(pages, dev)
            self.device_workspace_bytes += dev.numel() * dev.element_size()
            self.workspaces.append(ws)
        if needs_host and ws.host is None:  # NOTE: pinned memory only for the fragmented path
            ws.host = torch.empty(ws.device.shape, dtype=g.dtype, pin_memory=self.cuda)
            self.pinned_bytes += ws.host.numel() * ws.host.element_size()
        ws.busy = True
        return ws, time.perf_counter() - t0

    def _release(self, ws: Workspace) -> None:
        """Free the workspace; of several idle ones keep only the largest (one with a pinned
        buffer preferred at equal size)."""
        ws.busy = False
        idle = [w for w in self.workspaces if not w.busy]
        if len(idle) > 1:
            keep = max(idle, key=lambda w: (w.pages, w.host is not None))
            for w in idle:
                if w is not keep:
                    self.device_workspace_bytes -= w.device.numel() * w.device.element_size()
                    if w.host is not None:
                        self.pinned_bytes -= w.host.numel() * w.host.element_size()
            self.workspaces = [w for w in self.workspaces if w.busy or w is keep]

    # -- transfers ---------------------------------------------------------------------------

    def d2h(self, src: Sequence[int], dst: Sequence[int]) -> DeviceTicket:
        """Copy L1 pages ``src`` into L2 pages ``dst`` (same order)."""
        return self._transfer(Direction.D2H, src, dst)

    def layer_groups(self) -> list[tuple[int, int]]:
        """The ``[lo, hi)`` layer ranges a layered H2D moves, in order (module docstring):
        sizes grow from ``layer_group`` by doubling to ``max_layer_group`` and shrink the
        same way at the end (1, 2, 4, 8, 6, 8, 4, 2, 1 for 36 layers). Small first groups
        let the forward start early; small last ones leave it little to do after the last
        layer lands (when the copy is the slower, the forward waits on every group's end)."""
        head: list[int] = []
        tail: list[int] = []
        left, size = self.geometry.num_layers, self.layer_group
        while left > 0:
            for part in (head, tail):
                if left > 0:
                    part.append(min(size, left))
                    left -= part[-1]
            size = min(2 * size, self.max_layer_group)
        bounds = list(itertools.accumulate(head + tail[::-1], initial=0))
        return list(itertools.pairwise(bounds))

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
        if len(src) != len(dst):
            raise PageOwnershipError(f"{direction.name}: {len(src)} source pages for {len(dst)} destinations")
        l1_pages, l2_pages = (src, dst) if direction is Direction.D2H else (dst, src)
        check_pages("L1", l1_pages, self.l1.num_pages)
        check_pages("L2", l2_pages, self.l2.num_pages)
        n = len(src)
        ticket = DeviceTicket(direction, n, n * self.geometry.bytes_per_page, started=t0)
        if n == 0:
            ticket._finish(True)
            return ticket
        t_choose = time.perf_counter()
        self._choose()  # the first call autotunes (compiling the Triton kernels)
        chose = time.perf_counter() - t_choose
        runs = page_runs(l2_pages)
        consecutive = len(runs) == 1
        per_run = not consecutive and n * self.geometry.bytes_per_page >= self.min_run_bytes * len(runs)
        ws, setup = self._acquire(n, needs_host=not (consecutive or per_run))
        ticket.timings.setup_s = setup + chose
        try:
            if direction is Direction.D2H:
                complete = self._issue_d2h(ticket, ws, l1_pages, l2_pages, runs, per_run)
            else:
                complete = self._issue_h2d(ticket, ws, l2_pages, l1_pages, runs, per_run, events)
        except BaseException:
            if self.cuda:  # NOTE: work may already be queued on the stream using ws
                self.stream.synchronize()
            self._release(ws)
            raise
        fault = self.faults.take("write" if direction is Direction.D2H else "read", ("fail", "slow"))
        ticket.timings.enqueue_s = time.perf_counter() - t0
        path = (direction, events is not None and self.layered)
        if path not in self._warm:
            # NOTE: a path's first enqueue is one-time setup (autotune, kernel compile and
            # module load on first launch): counted as recurring, a ~1 s first H2D made the
            # cost model rule out restores from L2 for dozens of requests on the H200. The
            # layered H2D is a path of its own (other kernels, cuda-python's first calls).
            ticket.timings.setup_s = ticket.timings.enqueue_s
            self._warm.add(path)
        ticket._check = self._checker(
            ticket, ws, complete, fault.kind if fault else None, fault.delay_s if fault else 0.0
        )
        if not self.cuda:
            ticket.poll()
        return ticket

    def _checker(
        self, ticket: DeviceTicket, ws: Workspace, complete: Callable[[], None], fault: str | None, delay: float
    ) -> Callable[[bool], bool | None]:
        def check(block: bool) -> bool | None:
            event = ticket.event
            if event is not None:
                if block:
                    event.synchronize()
                elif not event.query():
                    return None
                ticket.timings.service_s = ticket.keep[0].elapsed_time(event) / 1e3
            t1 = time.perf_counter()
            if delay:
                time.sleep(delay)
            complete()
            ticket.timings.complete_s = time.perf_counter() - t1
            ticket.keep.clear()
            self._release(ws)
            if fault == "fail":
                ticket.error = "injected transfer failure"
                return False
            return True

        return check

    def _ids(self, pages: Sequence[int]) -> torch.Tensor:
        """Page ids on the device, uploaded asynchronously on the caller's current stream.

        NOTE: from pinned memory, so the upload never blocks the scheduler thread behind the
        caller's queued work (a pageable upload would); the transfer stream's wait on the
        caller's stream is then what orders the kernels after it."""
        if not self.cuda:
            return torch.tensor(pages, dtype=torch.int64)
        staged = torch.tensor(pages, dtype=torch.int64).pin_memory()
        return staged.to(self.l1.device, non_blocking=True)

    def _issue_d2h(
        self,
        ticket: DeviceTicket,
        ws: Workspace,
        src: Sequence[int],
        dst: Sequence[int],
        runs: list[tuple[int, int]],
        per_run: bool,
    ) -> Callable[[], None]:
        n = len(src)
        ids = self._ids(src)  # produced on the caller's current stream
        packed = ws.device[:n]
        staged = ws.host[:n] if ws.host is not None and not (len(runs) == 1 or per_run) else None

        def copies() -> None:
            self._run(GATHER, "gather", (self.l1.slabs, ids, packed))
            if staged is not None:
                staged.copy_(packed, non_blocking=self.cuda)
                return
            for first, end in runs:  # one DMA per run of consecutive L2 pages (usually one)
                h = dst[first]
                self.l2.slabs[h : h + end - first].copy_(packed[first:end], non_blocking=self.cuda)

        self._issue(ticket, copies, [ids, ws])
        if staged is None:
            return lambda: None
        host_idx = torch.tensor(dst, dtype=torch.int64)

        def land() -> None:  # after the DMA: one host-side index_copy_ into the L2 pages
            self.l2.slabs.index_copy_(0, host_idx, staged)

        return land

    def _issue_h2d(
        self,
        ticket: DeviceTicket,
        ws: Workspace,
        src: Sequence[int],
        dst: Sequence[int],
        runs: list[tuple[int, int]],
        per_run: bool,
        events: Sequence[Any] | None = None,
    ) -> Callable[[], None]:
        n = len(src)
        packed = ws.device[:n]
        staged = None
        if len(runs) > 1 and not per_run:
            assert ws.host is not None
            staged = ws.host[:n]
            torch.index_select(self.l2.slabs, 0, torch.tensor(src, dtype=torch.int64), out=staged)
        ids = self._ids(dst)
        if events is not None and self.layered:
            self._issue(ticket, lambda: self._layered_copies(packed, staged, src, runs, ids, events), [ids, ws, staged])
            return lambda: None

        def copies() -> None:
            if staged is not None:
                packed.copy_(staged, non_blocking=self.cuda)
            else:
                for first, end in runs:
                    h = src[first]
                    packed[first:end].copy_(self.l2.slabs[h : h + end - first], non_blocking=self.cuda)
            self._run(SCATTER, "scatter", (packed, ids, self.l1.slabs))
            for event in {id(e): e for e in events or ()}.values():  # every layer lands with the last page
                event.record(self.stream)

        self._issue(ticket, copies, [ids, ws, staged])
        return lambda: None

    def _layered_copies(
        self,
        packed: torch.Tensor,
        staged: torch.Tensor | None,
        src: Sequence[int],
        runs: list[tuple[int, int]],
        ids: torch.Tensor,
        events: Sequence[Any],
    ) -> None:
        """On the transfer stream: per group of layers, strided DMAs of their K and V slabs
        into the workspace, one scatter into L1, one event per layer."""
        layers = self.geometry.num_layers
        n = packed.shape[0]
        rows = torch.arange(n, device=packed.device)
        pieces = (
            [(0, n, staged)]
            if staged is not None
            else [(a, b, self.l2.slabs[src[a] : src[a] + b - a]) for a, b in runs]
        )
        # NOTE: the DMAs go by address (checked once here): per-copy checks of the views
        # cost more host time than the copies' enqueue, and the forward launches after it.
        size = packed.element_size()
        slab = self.geometry.page_elements * size  # bytes of one layer's K (or V) of a page
        pitch = 2 * layers * slab  # bytes of a page, in the workspace and in L2 alike
        plan = []
        for first, end, host in pieces:
            assert host is not None
            dma.check_rows(packed[first:end, 0], host[:, 0])  # rows a page apart, pinned source
            plan.append((packed.data_ptr() + first * pitch, host.data_ptr(), end - first))
        for lo, hi in self.layer_groups():
            for dst, host_ptr, count in plan:
                for base in (lo, layers + lo):  # K slabs, then V slabs
                    at = base * slab
                    dma.copy_rows_raw(dst + at, pitch, host_ptr + at, pitch, (hi - lo) * slab, count, self.stream)
            self._scatter_layers(packed, rows, ids, (lo, hi))
            for event in {id(e): e for e in events[lo:hi]}.values():
                event.record(self.stream)

    def _scatter_layers(
        self, packed: torch.Tensor, rows: torch.Tensor, ids: torch.Tensor, layers: tuple[int, int]
    ) -> None:
        """Layers ``[lo, hi)`` of the workspace into their L1 pages; a Triton failure under
        ``auto`` falls back to torch for good, as the whole-run scatter does (:meth:`_run`)."""
        if self.scatter_backend == "triton":
            try:
                kernels.load_layers_triton(packed, rows, self.l1.slabs, ids, layers, programs=self.scatter_programs)
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
        kernels.load_layers_torch(packed, rows, self.l1.slabs, ids, layers)

    def _issue(self, ticket: DeviceTicket, copies: Callable[[], None], keep: list[Any]) -> None:
        """Run ``copies`` synchronously (CPU) or on the transfer stream behind the caller's."""
        if not self.cuda:
            t = time.perf_counter()
            copies()
            ticket.timings.service_s = time.perf_counter() - t
            return
        # NOTE: the transfer stream must see the page ids and pages the caller produced, and
        # must not overwrite pages the caller's queued work still reads.
        self.stream.wait_stream(torch.cuda.current_stream(self.l1.device))
        start, end = _Event(enable_timing=True), _Event(enable_timing=True)
        with torch.cuda.stream(self.stream):
            start.record()
            copies()
            end.record()
        keep[0].record_stream(self.stream)  # the ids tensor came from the caller's stream
        ticket.event = end
        ticket.keep = [start, *keep]

    # -- observability -----------------------------------------------------------------------

    def status(self) -> dict[str, Any]:
        return {
            "requested": self.requested,
            "gather": self.gather_backend,
            "scatter": self.scatter_backend,
            "autotune_ms": dict(self.autotune_ms),
            "workspaces": len(self.workspaces),
            "workspace_device_bytes": self.device_workspace_bytes,
            "workspace_pinned_bytes": self.pinned_bytes,
            "device": str(self.l1.device),
        }

    def synchronize(self) -> None:
        if self.cuda:
            self.stream.synchronize()
