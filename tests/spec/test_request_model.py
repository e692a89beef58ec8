"""The request model: the compiled table agrees with the Machine and every state is
reachable (the request invariants' reports: ``test_request_invariants.py``)."""

from __future__ import annotations

from hicache.spec.request import REQUEST_TABLE, ReqEvent, ReqState, RequestMachine, request_reachable, request_step


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
