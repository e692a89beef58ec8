"""The L1 (device) and L2 (host) page pools (DESIGN.md §2).

    L1  [2 (K/V), layer, page, token_in_page, kv_head, head_dim]   read by attention kernels
    L2  [page, 2, layer, token_in_page, kv_head, head_dim]          one page contiguous

Both are also seen as ``[pages, 2*layers, page_elements]`` (L2, page-major) and
``[2*layers, pages, page_elements]`` (L1): the transfer kernels work on those views, where
``page_elements = page_size * kv_heads * head_dim``.
"""

from __future__ import annotations

import operator
import threading
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

from hicache.backends.ticket import Ticket
from hicache.core.geometry import KVGeometry
from hicache.errors import ConfigError, MisuseError, PageOwnershipError


class PagesInFlightError(MisuseError):
    """A transfer names pages that another transfer still writes (or reads, for a write)."""


def check_pages(name: str, pages: Sequence[int], limit: int) -> Sequence[int]:
    """``pages`` as distinct plain ints in ``[0, limit)``, else PageOwnershipError.

    A list, tuple or range of ints comes back as given; a 1-D integer tensor or array, or a
    sequence of other integer types (numpy's, a 0-d integer tensor), as a list of ints.
    Refused: bools (an int to Python, never a page id a caller means), unordered or unsized
    collections (a page's place pairs it with its source or destination), anything else."""
    if type(pages) not in (list, tuple, range):
        pages = _page_list(name, pages)
    # NOTE: C-level checks first (a 3,500-token restore checks 219 pages twice per
    # transfer); the loop below only runs to name the bad page or to convert other ints.
    if not pages:
        return pages
    if set(map(type, pages)) == {int} and min(pages) >= 0 and max(pages) < limit and len(set(pages)) == len(pages):
        return pages
    out: list[int] = []
    seen: set[int] = set()
    items: Sequence[object] = pages
    for p in items:
        if isinstance(p, (bool, np.bool_)) or (isinstance(p, torch.Tensor) and p.dtype == torch.bool):
            raise PageOwnershipError(f"{name}: page {p!r} is a bool, not a page id")
        try:
            page = operator.index(p)  # type: ignore[arg-type]  # NOTE: a TypeError is the refusal below
        except TypeError:
            raise PageOwnershipError(f"{name}: page {p!r} is not an int") from None
        if not 0 <= page < limit:
            raise PageOwnershipError(f"{name}: page {page} out of range [0, {limit})")
        if page in seen:
            raise PageOwnershipError(f"{name}: page {page} given twice")
        seen.add(page)
        out.append(page)
    return out


def _page_list(name: str, pages: object) -> Sequence[int]:
    """:func:`check_pages`' form of any other container: a tensor's or array's values, a
    sequence's items (their checks follow)."""
    if isinstance(pages, (torch.Tensor, np.ndarray)):
        if isinstance(pages, torch.Tensor):
            integer = not (pages.dtype.is_floating_point or pages.dtype.is_complex or pages.dtype == torch.bool)
        else:
            integer = pages.dtype.kind in "iu"
        if pages.ndim != 1 or not integer:
            raise PageOwnershipError(
                f"{name}: pages must be a 1-D sequence of ints, got a {pages.ndim}-D {type(pages).__name__} "
                f"of {pages.dtype}"
            )
        values: list[int] = pages.tolist()
        return values
    if isinstance(pages, Sequence) and not isinstance(pages, (str, bytes, bytearray)):
        return list(pages)
    raise PageOwnershipError(
        f"{name}: pages must be a sequence of ints (a list, tuple or range), got {type(pages).__name__}"
    )


def coalesce(a: Sequence[int], b: Sequence[int]) -> list[tuple[int, int]]:
    """Split index range ``[0, len(a))`` into maximal runs where both ``a`` and ``b`` step by
    one; returns ``(first, end)`` pairs. (With ``a is b``: the runs of consecutive pages.)"""
    extents: list[tuple[int, int]] = []
    first = 0
    for i in range(1, len(a)):
        if a[i] != a[i - 1] + 1 or b[i] != b[i - 1] + 1:
            extents.append((first, i))
            first = i
    if len(a):
        extents.append((first, len(a)))
    return extents


@dataclass(frozen=True, slots=True, eq=False)
class _Fence:
    ticket: Ticket
    pages: frozenset[int]
    write: bool
    owner: object | None


class PageFences:
    """Which pages of a pool a transfer in flight writes or reads, and which ticket.

    Backends register each transfer's pages (:meth:`fence`) and, before issuing one, ask
    which earlier tickets it must be ordered after (:meth:`pending`): a read conflicts with
    writes in flight, a write with writes and reads. A fence ends when its ticket finishes
    (whoever polls it). An ``owner`` that orders its own transfers (one stream) leaves its
    own fences out of its queries. Call from the scheduler thread: :meth:`pending` polls.
    """

    def __init__(self, name: str) -> None:
        self.name = name
        self._live: list[_Fence] = []
        self._lock = threading.Lock()

    def fence(self, pages: Sequence[int], ticket: Ticket, *, write: bool = True, owner: object | None = None) -> None:
        """``ticket`` writes (``write``) or reads ``pages`` until it finishes. Register
        after the ticket's completion check is bound (:meth:`Ticket.bind`)."""
        if ticket.ok is not None or not pages:
            return
        entry = _Fence(ticket, frozenset(pages), write, owner)
        with self._lock:
            self._live.append(entry)
        ticket.add_done_callback(lambda _t: self._drop(entry))

    def _drop(self, entry: _Fence) -> None:
        with self._lock:
            if entry in self._live:
                self._live.remove(entry)

    def pending(self, pages: Sequence[int], *, write: bool = False, exclude: object | None = None) -> list[Ticket]:
        """Unfinished tickets that write ``pages`` (or, with ``write``, also read them), in
        the order they were fenced, less those fenced by ``exclude``. The conflicting ones
        are polled first (a finished one drops out)."""
        return [t for t in self._conflicts(pages, write, exclude) if not t.poll()]

    def _conflicts(self, pages: Sequence[int], write: bool, exclude: object | None) -> list[Ticket]:
        if not self._live or not pages:
            return []
        want = set(pages)
        with self._lock:
            live = list(self._live)
        found: list[Ticket] = []
        for entry in live:
            if exclude is not None and entry.owner is exclude:
                continue
            if (entry.write or write) and entry.ticket not in found and not want.isdisjoint(entry.pages):
                found.append(entry.ticket)
        return found

    def pages_of(self, ticket: Ticket, pages: Sequence[int]) -> list[int]:
        """Which of ``pages`` ``ticket`` holds fenced (sorted)."""
        with self._lock:
            held = set().union(*[e.pages for e in self._live if e.ticket is ticket])
        return sorted(held.intersection(pages))

    def await_pages(self, pages: Sequence[int], *, write: bool = False) -> bool:
        """Block until no transfer in flight writes ``pages`` (with ``write``: nor reads
        them); True if every one waited for succeeded."""
        return all([t.wait() for t in self._conflicts(pages, write, None)])

    def refuse(self, pages: Sequence[int], *, write: bool = False, exclude: object | None = None) -> None:
        """Raise :class:`PagesInFlightError` naming the pages if a transfer in flight
        conflicts with a read (or, with ``write``, a write) of ``pages``."""
        for ticket in self.pending(pages, write=write, exclude=exclude):
            raise PagesInFlightError(
                f"{self.name}: pages {self.pages_of(ticket, pages)} are still "
                f"{'in use' if write else 'being written'} by a {ticket.direction.name} in flight; "
                "wait for its ticket first"
            )

    def __len__(self) -> int:
        return len(self._live)


class _Fenced:
    """The fence API of a pool (see :class:`PageFences`); storage backends call it on L2."""

    fences: PageFences

    def fence(self, pages: Sequence[int], ticket: Ticket, *, write: bool = True) -> None:
        """Record that ``ticket`` writes (``write``) or reads these pages until it finishes."""
        self.fences.fence(pages, ticket, write=write)

    def pending(self, pages: Sequence[int], *, write: bool = False) -> list[Ticket]:
        """Tickets in flight that a read (or, with ``write``, a write) of ``pages`` must follow."""
        return self.fences.pending(pages, write=write)

    def await_pages(self, pages: Sequence[int], *, write: bool = False) -> bool:
        """Block until a read (``write``: a write) of ``pages`` may start; True if every
        transfer waited for succeeded."""
        return self.fences.await_pages(pages, write=write)


def l1_shape(geometry: KVGeometry, pages: int) -> tuple[int, ...]:
    g = geometry
    return (2, g.num_layers, pages, g.page_size, g.num_kv_heads, g.head_dim)


def l2_shape(geometry: KVGeometry, pages: int) -> tuple[int, ...]:
    g = geometry
    return (pages, 2, g.num_layers, g.page_size, g.num_kv_heads, g.head_dim)


class DevicePool(_Fenced):
    """L1: the engine's paged KV pool. We read and write pages; we never change its layout."""

    def __init__(self, geometry: KVGeometry, buffer: torch.Tensor) -> None:
        validate_l1(geometry, buffer)
        self.geometry = geometry
        self.buffer = buffer
        self.num_pages = buffer.shape[2]
        g = geometry
        self.slabs = buffer.view(2 * g.num_layers, self.num_pages, g.page_elements)
        self.fences = PageFences("L1")

    @classmethod
    def allocate(cls, geometry: KVGeometry, pages: int, device: torch.device | str) -> DevicePool:
        if pages <= 0:
            raise ConfigError(f"L1 pages must be positive, got {pages}")
        return cls(geometry, torch.empty(l1_shape(geometry, pages), dtype=geometry.dtype, device=device))

    @property
    def device(self) -> torch.device:
        return self.buffer.device


def validate_l1(geometry: KVGeometry, buffer: object) -> None:
    """Refuse anything but a contiguous MHA/GQA pool of our layout, dtype and geometry."""
    if isinstance(buffer, (list, tuple)):
        raise ConfigError(
            "L1 pool must be one tensor [2, layer, page, token, kv_head, head_dim]; separate latent "
            "buffers (an MLA-style pool) are not supported"
        )
    if not isinstance(buffer, torch.Tensor):
        raise ConfigError(f"L1 pool must be a torch.Tensor, got {type(buffer).__name__}")
    if buffer.dtype != geometry.dtype:
        kind = "a quantized KV pool" if buffer.dtype in (torch.int8, torch.uint8) or buffer.element_size() == 1 else ""
        raise ConfigError(
            f"L1 pool dtype {buffer.dtype} differs from the geometry's {geometry.dtype}"
            + (f" ({kind} is not supported)" if kind else "")
        )
    g = geometry
    if buffer.dim() != 6 or buffer.shape[0] != 2:
        raise ConfigError(
            f"L1 pool must be [2, layer, page, token, kv_head, head_dim] (MHA/GQA); got shape "
            f"{tuple(buffer.shape)} (an MLA-style latent pool is not supported)"
        )
    want = (2, g.num_layers, buffer.shape[2], g.page_size, g.num_kv_heads, g.head_dim)
    if tuple(buffer.shape) != want:
        raise ConfigError(f"L1 pool shape {tuple(buffer.shape)} does not match geometry {want}")
    if not buffer.is_contiguous():
        raise ConfigError("L1 pool must be contiguous")


class HostPool(_Fenced):
    """L2: page-major host memory, pinned when CUDA is available.

    ``page_buffer`` is ``[page, 2, layer, token, kv_head, head_dim]``; ``buffer`` is the
    L1-ordered view of the same memory; ``bytes`` is ``[page, bytes_per_page]`` uint8 (for
    file I/O); ``slabs`` is ``[page, 2*layer, page_elements]`` (for transfers).
    """

    def __init__(self, geometry: KVGeometry, pages: int, *, pin: bool | None = None) -> None:
        if isinstance(pages, bool) or not isinstance(pages, int) or pages <= 0:
            raise ConfigError(f"L2 pages must be a positive int, got {pages!r}")
        self.geometry = geometry
        self.num_pages = pages
        pin = torch.cuda.is_available() if pin is None else pin
        self.pinned = pin
        nbytes = pages * geometry.bytes_per_page
        # NOTE: 4096-byte aligned so O_DIRECT file I/O can read straight into pages.
        raw = torch.empty(nbytes + 4096, dtype=torch.uint8, pin_memory=pin)
        shift = (-raw.data_ptr()) % 4096
        self._raw = raw
        self.bytes = raw[shift : shift + nbytes].view(pages, geometry.bytes_per_page)
        self.page_buffer = self.bytes.view(geometry.dtype).view(l2_shape(geometry, pages))
        g = geometry
        self.slabs = self.page_buffer.view(pages, 2 * g.num_layers, g.page_elements)
        self.fences = PageFences("L2")

    @property
    def buffer(self) -> torch.Tensor:
        """The L1-ordered view ``[2, layer, page, token, kv_head, head_dim]`` (not contiguous)."""
        return self.page_buffer.permute(1, 2, 0, 3, 4, 5)
