"""A tiny L3 stand-in that honours the pools' page fences, as a storage backend should.

Each operation runs on a thread of its own, but only once someone waits on its ticket (a
poll before that says "pending"): so a transfer that reads pages this still writes, without
being ordered after it, reads them deterministically stale. The ordering it does is the one
``hicache.backends.storage`` is to do (see the transfer engine's report):

- at submission, on the caller's thread: find the tickets in flight it must follow on the
  L2 pages (``HostPool.pending``) and on its own slots; wait there for host tickets, and
  hand device tickets to the worker, which ``settle()``s them before touching the pages;
- register its own pages (``HostPool.fence``): a read of L3 writes L2 pages, a write reads them.
"""

from __future__ import annotations

import threading
from collections.abc import Sequence

import torch

from hicache.backends.pools import HostPool, PageFences
from hicache.backends.ticket import Ticket
from hicache.backends.transfer import DeviceTicket
from hicache.spec.model import Direction


class FencedStorage:
    def __init__(self, host: HostPool, slots: int) -> None:
        self.host = host
        self.data = torch.zeros((slots, *host.slabs.shape[1:]), dtype=host.slabs.dtype)
        self.slot_fences = PageFences("L3")

    def write(self, host_pages: Sequence[int], slots: Sequence[int]) -> Ticket:
        """H2S: L2 pages -> slots (reads L2, writes L3)."""
        return self._submit(Direction.H2S, list(host_pages), list(slots))

    def read(self, slots: Sequence[int], host_pages: Sequence[int]) -> Ticket:
        """S2H: slots -> L2 pages (reads L3, writes L2)."""
        return self._submit(Direction.S2H, list(host_pages), list(slots))

    def _submit(self, direction: Direction, pages: list[int], slots: list[int]) -> Ticket:
        to_l2 = direction is Direction.S2H
        deps = self.host.pending(pages, write=to_l2) + self.slot_fences.pending(slots, write=not to_l2)
        for dep in deps:
            if not isinstance(dep, DeviceTicket):
                dep.wait()
        device_deps = [d for d in deps if isinstance(d, DeviceTicket)]
        gate, done = threading.Event(), threading.Event()

        def work() -> None:
            gate.wait()
            for dep in device_deps:
                dep.settle()
            if to_l2:
                self.host.slabs[pages] = self.data[slots]
            else:
                self.data[slots] = self.host.slabs[pages]
            done.set()

        threading.Thread(target=work, daemon=True).start()
        ticket = Ticket(direction, len(pages), len(pages) * self.host.geometry.bytes_per_page)

        def check(block: bool) -> bool | None:
            if not block and not done.is_set():
                return None
            gate.set()
            done.wait()
            return True

        ticket.bind(check)
        self.host.fence(pages, ticket, write=to_l2)
        self.slot_fences.fence(slots, ticket, write=not to_l2)
        return ticket
