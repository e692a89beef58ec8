"""The page-run model of DESIGN.md §4: tiers, directions, states, events, guards.

A page run (one tree node's pages) is in state ``(R, F)``: ``R`` the tiers that hold a
*published* copy, ``F`` the transfers in flight for it. Before it is inserted into the tree
a run is ``L1_PRIVATE``; after its last copy is evicted it is ``EMPTY`` and the only thing
left to do is ``remove`` it (``REMOVED``).

The rules are written once, in :func:`_declare`, as guards over ``(R, F)``. They are fed to
one class-level ``transitions.Machine`` (the declaration and the test oracle) and compiled
into :data:`TABLE`, a plain dict the hot path uses. ``tests/spec`` proves the two agree on
every ``(state, event)`` pair and that the declared states are exactly the reachable ones.

The model is about the host's bookkeeping: who may read a run is decided by ``R`` alone.
The layered restore (``hicache.engine``) lets the *requester* start its prefill over an H2D
still in flight: that is a device read ordered after each layer's copy by CUDA events, not
a host event. The run stays in ``F`` until the transfer completes, nobody else can match it,
and the requester discards what it computed unless the run is then published (``R`` gains
L1); a failed transfer leaves the states as if the read never happened.

State codes (the enum values) pack ``R`` into bits 0..2 and ``F`` into bits 3..6, so the
core can derive a node's state with a few ``|`` and one list lookup::

    bit:   0   1   2  |  3    4    5    6   |  7           8        9
           L1  L2  L3 |  D2H  H2S  S2H  H2D |  L1_PRIVATE  REMOVED  REMOTE
"""

from __future__ import annotations

from collections.abc import Iterator
from enum import IntEnum, StrEnum
from typing import Final

from transitions import Machine, MachineError


class Tier(IntEnum):
    """A level of the hierarchy. The value indexes per-tier arrays."""

    L1 = 0  # GPU page pool
    L2 = 1  # pinned host memory
    L3 = 2  # local file


class Direction(IntEnum):
    """A transfer direction. The value indexes per-direction arrays."""

    D2H = 0  # L1 -> L2
    H2S = 1  # L2 -> L3
    S2H = 2  # L3 -> L2
    H2D = 3  # L2 -> L1

    @property
    def source(self) -> Tier:
        return _ENDS[self][0]

    @property
    def target(self) -> Tier:
        return _ENDS[self][1]


_ENDS: Final[dict[Direction, tuple[Tier, Tier]]] = {
    Direction.D2H: (Tier.L1, Tier.L2),
    Direction.H2S: (Tier.L2, Tier.L3),
    Direction.S2H: (Tier.L3, Tier.L2),
    Direction.H2D: (Tier.L2, Tier.L1),
}

TIER_BIT: Final = (1, 2, 4)
DIR_BIT: Final = (8, 16, 32, 64)
_PRIVATE: Final = 128
_REMOVED: Final = 256
_REMOTE: Final = 512


class RunState(IntEnum):
    """Every declared state of a page run. The seed's names come first (canonical)."""

    L1_PRIVATE = _PRIVATE
    L1 = 1
    D2H_PENDING = 1 | 8
    L1_L2 = 1 | 2
    H2S_PENDING = 1 | 2 | 16
    L1_L2_L3 = 1 | 2 | 4
    L2 = 2
    H2D_PENDING = 2 | 64
    L3 = 4
    S2H_PENDING = 4 | 32
    L2_L3 = 2 | 4
    # The other reachable points of the (R, F) space.
    L2__H2S = 2 | 16
    L2__H2S_H2D = 2 | 16 | 64
    L1_L3 = 1 | 4
    L1_L3__D2H = 1 | 4 | 8
    L1_L3__S2H = 1 | 4 | 32
    L2_L3__H2D = 2 | 4 | 64
    EMPTY = 0
    REMOVED = _REMOVED
    REMOTE = _REMOTE  # only a shared store holds it; the tree does not know it yet

    @property
    def resident(self) -> frozenset[Tier]:
        """``R``: tiers holding a published copy (empty for the two special states)."""
        if self.value >= _PRIVATE:
            return frozenset()
        return frozenset(t for t in Tier if self.value & TIER_BIT[t])

    @property
    def in_flight(self) -> frozenset[Direction]:
        """``F``: directions with a transfer in flight."""
        if self.value >= _PRIVATE:
            return frozenset()
        return frozenset(d for d in Direction if self.value & DIR_BIT[d])

    @property
    def in_tree(self) -> bool:
        return self.value < _PRIVATE


class Event(StrEnum):
    """Everything that can happen to a page run."""

    INSERT = "insert"
    START_D2H = "start_d2h"
    COMPLETE_D2H = "complete_d2h"
    FAIL_D2H = "fail_d2h"
    CANCEL_D2H = "cancel_d2h"
    START_H2S = "start_h2s"
    COMPLETE_H2S = "complete_h2s"
    FAIL_H2S = "fail_h2s"
    CANCEL_H2S = "cancel_h2s"
    START_S2H = "start_s2h"
    COMPLETE_S2H = "complete_s2h"
    FAIL_S2H = "fail_s2h"
    CANCEL_S2H = "cancel_s2h"
    START_H2D = "start_h2d"
    COMPLETE_H2D = "complete_h2d"
    FAIL_H2D = "fail_h2d"
    CANCEL_H2D = "cancel_h2d"
    EVICT_L1 = "evict_l1"
    EVICT_L2 = "evict_l2"
    EVICT_L3 = "evict_l3"
    REMOVE = "remove"
    DISCOVER = "discover"  # a shared store was found to hold the run: L3 joins R
    LOSE = "lose"  # a read found the run gone from a shared store: L3 leaves R


def start_event(d: Direction) -> Event:
    return Event(f"start_{d.name.lower()}")


def complete_event(d: Direction) -> Event:
    return Event(f"complete_{d.name.lower()}")


def fail_event(d: Direction) -> Event:
    return Event(f"fail_{d.name.lower()}")


def cancel_event(d: Direction) -> Event:
    return Event(f"cancel_{d.name.lower()}")


def evict_event(t: Tier) -> Event:
    return Event(f"evict_{t.name.lower()}")


# --------------------------------------------------------------------------------------
# Guards: the table of DESIGN.md §4, as predicates over (R, F).
# --------------------------------------------------------------------------------------


def may_start(d: Direction, r: frozenset[Tier], f: frozenset[Direction]) -> bool:
    """May a transfer in direction ``d`` start on a run in ``(r, f)``?

    D2H: L1 ∈ R, L2 ∉ R, no S2H in flight.   H2S: L2 ∈ R, L3 ∉ R.
    S2H: L3 ∈ R, L2 ∉ R, no D2H in flight.   H2D: L2 ∈ R, L1 ∉ R.
    One transfer per direction per run.
    """
    if d in f or d.source not in r or d.target in r:
        return False
    if d is Direction.D2H and Direction.S2H in f:
        return False
    return not (d is Direction.S2H and Direction.D2H in f)


def may_evict(t: Tier, r: frozenset[Tier], f: frozenset[Direction]) -> bool:
    """A tier's copy may be dropped when present and not the source of a transfer.

    (Refs and leaf-ness are tree-level guards, checked by the core.)
    """
    return t in r and not any(d.source is t for d in f)


def may_discover(r: frozenset[Tier], f: frozenset[Direction]) -> bool:
    """A store's copy may be recorded when the tree has none and is not writing one."""
    return Tier.L3 not in r and Direction.H2S not in f


def may_lose(r: frozenset[Tier], f: frozenset[Direction]) -> bool:
    """A store's copy is forgotten when a read into L2 found it gone: present, no L2 copy
    (the only reads are S2H, which need none; runs below a lost one have none either), and
    nothing in flight (the failed read has ended; nothing else can move a run with no L2
    copy below an S2H). Refs are the core's guard."""
    return Tier.L3 in r and Tier.L2 not in r and not f


def may_insert(r: frozenset[Tier], f: frozenset[Direction]) -> bool:
    """A request's L1 pages may be adopted by a run with no L1 copy and no H2D in flight."""
    return bool(r) and Tier.L1 not in r and Direction.H2D not in f


_BY_RF: Final[dict[tuple[frozenset[Tier], frozenset[Direction]], RunState]] = {
    (s.resident, s.in_flight): s for s in RunState if s.in_tree
}


def state_of(r: frozenset[Tier], f: frozenset[Direction]) -> RunState | None:
    """The declared state for ``(r, f)``, or None if that point is not declared."""
    return _BY_RF.get((r, f))


def _declare() -> Iterator[tuple[Event, RunState, RunState]]:
    """Yield every declared transition ``(event, source, dest)`` from the guards."""
    yield Event.INSERT, RunState.L1_PRIVATE, RunState.L1
    yield Event.REMOVE, RunState.L1_PRIVATE, RunState.REMOVED
    yield Event.REMOVE, RunState.EMPTY, RunState.REMOVED
    yield Event.DISCOVER, RunState.REMOTE, RunState.L3
    for s in RunState:
        if not s.in_tree or s is RunState.EMPTY:
            continue
        r, f = s.resident, s.in_flight
        candidates: list[tuple[Event, frozenset[Tier], frozenset[Direction]]] = []
        if may_insert(r, f):
            candidates.append((Event.INSERT, r | {Tier.L1}, f))
        for d in Direction:
            if may_start(d, r, f):
                candidates.append((start_event(d), r, f | {d}))
            if d in f:
                done = f - {d}
                candidates.append((complete_event(d), r | {d.target}, done))
                candidates.append((fail_event(d), r, done))
                candidates.append((cancel_event(d), r, done))
        for t in Tier:
            if may_evict(t, r, f):
                candidates.append((evict_event(t), r - {t}, f))
        if may_discover(r, f):
            candidates.append((Event.DISCOVER, r | {Tier.L3}, f))
        if may_lose(r, f):
            candidates.append((Event.LOSE, r - {Tier.L3}, f))
        for event, r2, f2 in candidates:
            dest = state_of(r2, f2)
            if dest is None:
                raise RuntimeError(f"guard leads outside the declared states: {s.name} --{event.value}--> ({r2}, {f2})")
            yield event, s, dest


class _Probe:
    """The single model object the class-level machine drives when used as an oracle."""

    state: RunState


class RunMachine:
    """The declaration: one class-level ``transitions.Machine`` over :class:`RunState`.

    Never instantiate a machine per run (that costs ~12 KB and ~0.5 ms each); the core uses
    :data:`TABLE`. :meth:`fire` is the oracle the tests compare the table with.
    """

    probe: Final = _Probe()
    machine: Final = Machine(
        model=probe,
        states=RunState,
        transitions=[{"trigger": e.value, "source": src, "dest": dst} for e, src, dst in _declare()],
        initial=RunState.L1_PRIVATE,
        auto_transitions=False,
        ignore_invalid_triggers=False,
    )

    @classmethod
    def fire(cls, state: RunState, event: Event) -> RunState | None:
        """The state after ``event`` in ``state`` per the Machine, or None if refused."""
        cls.machine.set_state(state, model=cls.probe)
        try:
            cls.probe.trigger(event.value)  # type: ignore[attr-defined]
        except MachineError:
            return None
        return cls.probe.state


def _compile() -> dict[tuple[RunState, Event], RunState]:
    table: dict[tuple[RunState, Event], RunState] = {}
    for name, ev in RunMachine.machine.events.items():
        event = Event(name)
        for src_name, transitions in ev.transitions.items():
            for tr in transitions:
                table[(RunState[src_name], event)] = RunState[str(tr.dest)]
    return table


TABLE: Final[dict[tuple[RunState, Event], RunState]] = _compile()
"""The compiled transition table: ``(state, event) -> state``; absent means refused."""

STATE_BY_CODE: Final[list[RunState | None]] = [None] * (_REMOTE + 1)
for _s in RunState:
    STATE_BY_CODE[_s.value] = _s


def step(state: RunState, event: Event) -> RunState | None:
    """Hot-path transition: the next state, or None if ``event`` is refused in ``state``."""
    return TABLE.get((state, event))


def reachable(*starts: RunState) -> set[RunState]:
    """States reachable from ``starts`` (default: a request's private run and a run only a
    shared store holds, the two ways a run comes to exist) through :data:`TABLE`."""
    seen = set(starts or (RunState.L1_PRIVATE, RunState.REMOTE))
    frontier = list(seen)
    while frontier:
        s = frontier.pop()
        for event in Event:
            nxt = TABLE.get((s, event))
            if nxt is not None and nxt not in seen:
                seen.add(nxt)
                frontier.append(nxt)
    return seen
