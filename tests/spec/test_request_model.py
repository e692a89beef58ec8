"""The request model: the compiled table agrees with the Machine and every state is
reachable (the request invariants' reports: ``test_request_invariants.py``)."""

from __future__ import annotations

from hicache.spec.request import (
    REQUEST_TABLE,
    ReqEvent,
    ReqState,
    RequestMachine,
    _compile,
    _declare,
    request_reachable,
    request_step,
)

DECLARED = {
    ("admitted", "skip", "ready"),
    ("admitted", "start_l2", "loading_l2"),
    ("admitted", "start_l3", "loading_l3"),
    ("admitted", "allocate", "prefilling"),
    ("admitted", "insert", "running"),
    ("admitted", "release", "released"),
    ("loading_l3", "promote", "loading_l2"),
    ("loading_l3", "fail", "ready"),
    ("loading_l3", "release", "released"),
    ("loading_l2", "publish", "ready"),
    ("loading_l2", "fail", "ready"),
    ("loading_l2", "allocate", "loading_l2"),
    ("loading_l2", "release", "released"),
    ("ready", "allocate", "prefilling"),
    ("ready", "insert", "running"),
    ("ready", "release", "released"),
    ("prefilling", "allocate", "prefilling"),
    ("prefilling", "insert", "running"),
    ("prefilling", "release", "released"),
    ("running", "allocate", "running"),
    ("running", "release", "released"),
}
"""The 21 transitions of DESIGN.md §4b, spelled out: (from, event, to)."""


def test_table_equals_machine_on_every_state_and_event() -> None:
    for state in ReqState:
        for event in ReqEvent:
            assert request_step(state, event) == RequestMachine.fire(state, event), (state, event)


def test_every_state_is_reachable_and_released_is_final() -> None:
    assert request_reachable() == set(ReqState)
    assert not any(s is ReqState.RELEASED for (s, _e) in REQUEST_TABLE)
    assert all(request_step(s, ReqEvent.RELEASE) is ReqState.RELEASED for s in ReqState if s is not ReqState.RELEASED)


def test_nothing_but_release_leaves_a_restore_in_flight() -> None:
    """A request's prefix is final before it may prefill: no allocate in LOADING_L3, no insert
    while loading; only publish, fail, promote and release end a restore."""
    for s in (ReqState.LOADING_L2, ReqState.LOADING_L3):
        assert request_step(s, ReqEvent.INSERT) is None
        assert request_step(s, ReqEvent.SKIP) is None
    assert request_step(ReqState.LOADING_L3, ReqEvent.ALLOCATE) is None
    assert request_step(ReqState.LOADING_L3, ReqEvent.PUBLISH) is None


def test_declaration_and_compiled_table_are_the_design_s_transitions() -> None:
    """Declaring and compiling afresh give exactly §4b's 21 transitions, each once, and the
    module's table is that compilation."""
    declared = [(src.value, ev.value, dst.value) for ev, src, dst in _declare()]
    assert len(declared) == len(DECLARED) and set(declared) == DECLARED
    table = _compile()
    assert {(a.value, e.value, b.value) for (a, e), b in table.items()} == DECLARED
    assert all(isinstance(b, ReqState) for b in table.values()) and table == REQUEST_TABLE


def test_reachability_follows_paths_of_several_steps() -> None:
    """From LOADING_L3, PREFILLING and RUNNING are two steps away; RELEASED reaches nothing."""
    s = ReqState
    assert request_reachable(s.LOADING_L3) == set(ReqState) - {s.ADMITTED}
    assert request_reachable(s.READY) == {s.READY, s.PREFILLING, s.RUNNING, s.RELEASED}
    assert request_reachable(s.RELEASED) == {s.RELEASED}
