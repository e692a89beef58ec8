"""The request model: what a request may do in which state, declared once.

A request is admitted (its prompt matched once, the L1 hit pinned), may restore a longer
prefix from L2 or L3, then prefills its uncached tail into private pages, hands the aligned
part to the tree, decodes, and is released (finished or aborted)::

    ADMITTED --start_l2--> LOADING_L2 --publish--> READY --allocate--> PREFILLING --insert--> RUNNING
        |  \\--start_l3--> LOADING_L3 --promote--^  |                                          |
        |                     (fail: back to READY, the request recomputes)                   |
        \\--skip--> READY                                                         release (any state)

``allocate`` is also accepted in ADMITTED (an engine that never restores), in LOADING_L2
(the layered restore prefills beside its copy) and in RUNNING (decode pages); ``insert`` in
ADMITTED and READY too (nothing left to allocate). As for page runs
(:mod:`hicache.spec.model`), one class-level ``transitions.Machine`` is the declaration and
the oracle; :data:`REQUEST_TABLE` is what the controller consults on its hot path.
"""

from __future__ import annotations

from enum import StrEnum
from typing import Final

from transitions import Machine, MachineError


class ReqState(StrEnum):
    """Where a request is in its life."""

    ADMITTED = "admitted"  # matched, L1 hit pinned; a plan may be made and committed
    LOADING_L3 = "loading_l3"  # S2H in flight; the L3 source is pinned by the request
    LOADING_L2 = "loading_l2"  # H2D in flight; the L2 source is pinned by the request
    READY = "ready"  # cached_len final: prefill may start
    PREFILLING = "prefilling"  # holds private pages for its uncached tail
    RUNNING = "running"  # its aligned prompt handed to the tree; decoding
    RELEASED = "released"  # finished or aborted: holds nothing


class ReqEvent(StrEnum):
    """Everything that can happen to a request."""

    SKIP = "skip"  # no restore: the plan keeps the L1 hit
    START_L2 = "start_l2"  # a restore from L2 committed (H2D issued)
    START_L3 = "start_l3"  # a restore from L3 committed (S2H issued)
    PROMOTE = "promote"  # the S2H published into L2 and the H2D was issued
    PUBLISH = "publish"  # the H2D published: cached_len grew
    FAIL = "fail"  # the restore failed or could not go on: the request recomputes
    ALLOCATE = "allocate"  # private L1 pages handed to the request
    INSERT = "insert"  # the prefilled aligned prompt handed to the tree
    RELEASE = "release"  # finished or aborted


LIVE: Final = frozenset(s for s in ReqState if s is not ReqState.RELEASED)
RESTORING: Final = frozenset({ReqState.LOADING_L2, ReqState.LOADING_L3})


def _declare() -> list[tuple[ReqEvent, ReqState, ReqState]]:
    s, e = ReqState, ReqEvent
    out = [
        (e.SKIP, s.ADMITTED, s.READY),
        (e.START_L2, s.ADMITTED, s.LOADING_L2),
        (e.START_L3, s.ADMITTED, s.LOADING_L3),
        (e.PROMOTE, s.LOADING_L3, s.LOADING_L2),
        (e.PUBLISH, s.LOADING_L2, s.READY),
        (e.FAIL, s.LOADING_L3, s.READY),
        (e.FAIL, s.LOADING_L2, s.READY),
        (e.ALLOCATE, s.ADMITTED, s.PREFILLING),
        (e.ALLOCATE, s.READY, s.PREFILLING),
        (e.ALLOCATE, s.PREFILLING, s.PREFILLING),
        (e.ALLOCATE, s.LOADING_L2, s.LOADING_L2),
        (e.ALLOCATE, s.RUNNING, s.RUNNING),
        (e.INSERT, s.ADMITTED, s.RUNNING),
        (e.INSERT, s.READY, s.RUNNING),
        (e.INSERT, s.PREFILLING, s.RUNNING),
    ]
    out += [(e.RELEASE, src, s.RELEASED) for src in ReqState if src in LIVE]
    return out


class _Probe:
    state: ReqState


class RequestMachine:
    """The declaration: one class-level ``transitions.Machine`` over :class:`ReqState`.
    :meth:`fire` is the oracle the tests compare :data:`REQUEST_TABLE` with."""

    probe: Final = _Probe()
    machine: Final = Machine(
        model=probe,
        states=ReqState,
        transitions=[{"trigger": ev.value, "source": src, "dest": dst} for ev, src, dst in _declare()],
        initial=ReqState.ADMITTED,
        auto_transitions=False,
        ignore_invalid_triggers=False,
    )

    @classmethod
    def fire(cls, state: ReqState, event: ReqEvent) -> ReqState | None:
        """The state after ``event`` in ``state`` per the Machine, or None if refused."""
        cls.machine.set_state(state, model=cls.probe)
        try:
            cls.probe.trigger(event.value)  # type: ignore[attr-defined]
        except MachineError:
            return None
        return cls.probe.state


def _compile() -> dict[tuple[ReqState, ReqEvent], ReqState]:
    table: dict[tuple[ReqState, ReqEvent], ReqState] = {}
    for name, ev in RequestMachine.machine.events.items():
        for src_name, transitions in ev.transitions.items():
            for tr in transitions:
                table[(ReqState[src_name], ReqEvent(name))] = ReqState[str(tr.dest)]
    return table


REQUEST_TABLE: Final[dict[tuple[ReqState, ReqEvent], ReqState]] = _compile()
"""``(state, event) -> state``; absent means refused."""


def request_step(state: ReqState, event: ReqEvent) -> ReqState | None:
    """Hot-path transition: the next state, or None if ``event`` is refused in ``state``."""
    return REQUEST_TABLE.get((state, event))


def request_reachable(start: ReqState = ReqState.ADMITTED) -> set[ReqState]:
    """States reachable from ``start`` through :data:`REQUEST_TABLE`."""
    seen = {start}
    frontier = [start]
    while frontier:
        s = frontier.pop()
        for event in ReqEvent:
            nxt = REQUEST_TABLE.get((s, event))
            if nxt is not None and nxt not in seen:
                seen.add(nxt)
                frontier.append(nxt)
    return seen
