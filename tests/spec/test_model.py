"""The spec: the compiled table agrees with the Machine, states are exactly the reachable
ones, and every guard of DESIGN.md §4 allows and refuses what the design says."""

from __future__ import annotations

import pytest

from hicache.spec.model import (
    TABLE,
    Direction,
    Event,
    RunMachine,
    RunState,
    Tier,
    reachable,
    start_event,
    state_of,
    step,
)

S = RunState


@pytest.mark.parametrize("state", list(RunState), ids=lambda s: s.name)
def test_table_agrees_with_machine_on_every_event(state: RunState) -> None:
    """For every (state, event), allowed or refused, the hot-path table and the
    transitions Machine give the same answer."""
    for event in Event:
        assert step(state, event) == RunMachine.fire(state, event), (state.name, event.value)


def test_declared_states_are_exactly_the_reachable_ones() -> None:
    """No dead declaration, nothing undeclared reachable."""
    assert reachable() == set(RunState)
    assert reachable(RunState.L1_PRIVATE) == set(RunState) - {RunState.REMOTE}


def test_seed_states_are_the_design_points() -> None:
    """The seed's named states are the (R, F) points DESIGN.md §4 gives them."""
    L1, L2, L3 = Tier.L1, Tier.L2, Tier.L3
    D = Direction
    assert state_of(frozenset({L1}), frozenset({D.D2H})) is S.D2H_PENDING
    assert state_of(frozenset({L1, L2}), frozenset({D.H2S})) is S.H2S_PENDING
    assert state_of(frozenset({L2}), frozenset({D.H2D})) is S.H2D_PENDING
    assert state_of(frozenset({L3}), frozenset({D.S2H})) is S.S2H_PENDING
    assert state_of(frozenset({L1, L2, L3}), frozenset()) is S.L1_L2_L3
    assert state_of(frozenset({L2, L3}), frozenset()) is S.L2_L3


def test_write_through_and_restore_paths_of_the_seed() -> None:
    """L1_PRIVATE -> L1 -> D2H_PENDING -> L1_L2 -> H2S_PENDING -> L1_L2_L3, and the restore
    paths L2 -> H2D_PENDING -> L1_L2, L3 -> S2H_PENDING -> L2_L3 -> H2D -> L1_L2_L3."""

    def walk(state: RunState, *events: Event) -> RunState:
        for e in events:
            nxt = step(state, e)
            assert nxt is not None, (state.name, e.value)
            state = nxt
        return state

    E = Event
    assert walk(S.L1_PRIVATE, E.INSERT, E.START_D2H, E.COMPLETE_D2H, E.START_H2S, E.COMPLETE_H2S) is S.L1_L2_L3
    assert walk(S.L2, E.START_H2D, E.COMPLETE_H2D) is S.L1_L2
    assert walk(S.L3, E.START_S2H, E.COMPLETE_S2H, E.START_H2D, E.COMPLETE_H2D) is S.L1_L2_L3


# Hand-written from the guard table of DESIGN.md §4 (not derived from the code).
START_ALLOWED = {
    Direction.D2H: {S.L1, S.L1_L3},  # L1 in R, L2 not, no S2H in flight
    Direction.H2S: {S.L1_L2, S.L2, S.H2D_PENDING},  # L2 in R, L3 not
    Direction.S2H: {S.L3, S.L1_L3},  # L3 in R, L2 not, no D2H in flight
    Direction.H2D: {S.L2, S.L2_L3, S.L2__H2S},  # L2 in R, L1 not
}


@pytest.mark.parametrize("direction", list(Direction), ids=lambda d: d.name)
def test_start_guard_allows_exactly_the_design_states(direction: Direction) -> None:
    allowed = {s for s in RunState if step(s, start_event(direction)) is not None}
    assert allowed == START_ALLOWED[direction]


@pytest.mark.parametrize("direction", list(Direction), ids=lambda d: d.name)
def test_completion_adds_target_and_failure_only_clears_flight(direction: Direction) -> None:
    """complete: target joins R; fail/cancel: only F changes (DESIGN.md §4)."""
    name = direction.name.lower()
    for s in RunState:
        if direction not in s.in_flight:
            for verb in ("complete", "fail", "cancel"):
                assert step(s, Event(f"{verb}_{name}")) is None
            continue
        done = step(s, Event(f"complete_{name}"))
        assert done is not None
        assert done.resident == s.resident | {direction.target}
        assert done.in_flight == s.in_flight - {direction}
        for verb in ("fail", "cancel"):
            back = step(s, Event(f"{verb}_{name}"))
            assert back is not None
            assert back.resident == s.resident and back.in_flight == s.in_flight - {direction}


@pytest.mark.parametrize("tier", list(Tier), ids=lambda t: t.name)
def test_evict_refused_for_absent_copy_or_transfer_source(tier: Tier) -> None:
    event = Event(f"evict_{tier.name.lower()}")
    for s in RunState:
        nxt = step(s, event)
        is_source = any(d.source is tier for d in s.in_flight)
        if tier not in s.resident or is_source:
            assert nxt is None, s.name
        else:
            assert nxt is not None and nxt.resident == s.resident - {tier}, s.name


def test_insert_only_onto_runs_without_l1_or_restore_in_flight() -> None:
    allowed = {s for s in RunState if step(s, Event.INSERT) is not None}
    assert S.L1_PRIVATE in allowed
    for s in allowed - {S.L1_PRIVATE}:
        assert Tier.L1 not in s.resident and Direction.H2D not in s.in_flight
    assert S.H2D_PENDING not in allowed and S.L2_L3__H2D not in allowed
    assert {S.L2, S.L3, S.L2_L3, S.S2H_PENDING, S.L2__H2S} <= allowed


def test_remove_only_from_private_or_empty() -> None:
    assert {s for s in RunState if step(s, Event.REMOVE) is not None} == {S.L1_PRIVATE, S.EMPTY}
    assert all(step(S.REMOVED, e) is None for e in Event)


def test_no_two_transfers_race_for_l2() -> None:
    """D2H and S2H both target L2: never both in flight; the table never declares it."""
    for s in RunState:
        assert not {Direction.D2H, Direction.S2H} <= s.in_flight
    assert len(TABLE) == 72


def test_the_guards_declare_exactly_the_compiled_table() -> None:
    """Declaring the transitions from the guards again, now, gives TABLE back, and so does
    compiling the Machine: the table the hot path uses is what the guards say (checked
    here at test time, not only once at import)."""
    from hicache.spec import model

    assert {(src, event): dst for event, src, dst in model._declare()} == TABLE
    assert model._compile() == TABLE
