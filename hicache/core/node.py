"""Tree nodes, leases and in-flight transfers: the records the tree and lifecycle share."""

from __future__ import annotations

from dataclasses import dataclass, field

from hicache.spec.model import DIR_BIT, STATE_BY_CODE, TIER_BIT, Direction, RunState, Tier

Key = tuple[int, ...]


@dataclass(slots=True, eq=False)
class Node:
    """One run of tokens (a multiple of ``page_size``) and, per tier, where its pages live.

    Per tier ``t`` (index ``t.value``): ``pages[t]`` the published physical pages or None,
    ``refs[t]`` how many leases hold this copy, ``stamp[t]`` the LRU clock of its last use,
    ``version[t]`` bumped whenever the copy is dropped (so stale handles are detected), and
    ``tier_children[t]`` how many children hold a copy in ``t`` (0 means a leaf in ``t``).
    Per direction ``d``: ``inflight[d]`` the transfer moving this run, ``pending[d]`` its
    private destination pages (not readable until the transfer completes).
    """

    id: int
    key: Key
    parent: Node | None
    children: dict[Key, Node] = field(default_factory=dict)
    pages: list[list[int] | None] = field(default_factory=lambda: [None, None, None])
    refs: list[int] = field(default_factory=lambda: [0, 0, 0])
    stamp: list[int] = field(default_factory=lambda: [0, 0, 0])
    version: list[int] = field(default_factory=lambda: [0, 0, 0])
    tier_children: list[int] = field(default_factory=lambda: [0, 0, 0])
    inflight: list[Transfer | None] = field(default_factory=lambda: [None, None, None, None])
    pending: list[list[int] | None] = field(default_factory=lambda: [None, None, None, None])
    alive: bool = True
    hits: int = 0  # requests that matched it in L1 (write_through_selective)
    keys: list[bytes] | None = None  # content key per page (a keyed L3 store's names), once computed

    @property
    def code(self) -> int:
        code = 0
        for t in range(3):
            if self.pages[t] is not None:
                code |= TIER_BIT[t]
        for d in range(4):
            if self.inflight[d] is not None:
                code |= DIR_BIT[d]
        return code

    @property
    def state(self) -> RunState | None:
        """The run's declared state, or None if ``(R, F)`` is not a declared point."""
        return STATE_BY_CODE[self.code]

    def has(self, tier: Tier) -> bool:
        return self.pages[tier] is not None

    def __repr__(self) -> str:
        state = self.state
        name = state.name if state is not None else f"undeclared:{self.code}"
        return f"Node#{self.id}(len={len(self.key)}, {name})"


@dataclass(slots=True, eq=False)
class Lease:
    """A lock on the copy in ``tier`` of every node from the root to ``node``.

    Obtained from :meth:`HiRadixTree.lock`; give it back exactly once with ``release``.
    """

    id: int
    tier: Tier
    node: Node
    length: int
    released: bool = False


@dataclass(slots=True, eq=False)
class Transfer:
    """One transfer of a whole path segment ``nodes`` (top to bottom) in ``direction``.

    ``src`` and ``dst`` are the flat page lists handed to the backend, in token order;
    ``dst`` pages are private to this transfer until :meth:`CacheCore.complete` publishes
    them. A split of a node in ``nodes`` inserts the new upper half into ``nodes``; ``src``
    and ``dst`` never change.
    """

    id: int
    direction: Direction
    nodes: list[Node]
    src: list[int]
    dst: list[int]
    src_lease: Lease
    dst_lease: Lease | None
    tokens: int
    done: bool = False

    @property
    def num_pages(self) -> int:
        return len(self.dst)
