"""Every refusal of a public Controller call, checked by its whole message: it names the
call (where the message has one) and the bad value or its type, and the request it was
given can still go on. The movers hold every copy until told (hicache.testing.tag_movers)."""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Callable
from typing import Any

import pytest

from hicache.core.cache import CacheCore
from hicache.core.controller import Controller, Request, WritePolicy
from hicache.core.cost import CostModel, CostPriors, Plan
from hicache.core.geometry import TierSizes
from hicache.errors import ConfigError, HandleError, MisuseError, PageOwnershipError
from hicache.spec.model import Tier
from hicache.spec.request import ReqState
from hicache.testing.tag_movers import TagDevice, TagFabric
from tests.core.test_seed26_controller import PS, _cached, _make

_PLAN_L2 = Plan(Tier.L2, 4, 1.0, 0.1, 1.1)
_PLAN_NEGATIVE = dataclasses.replace(_PLAN_L2, tokens=-4)
_PLAN_PART_PAGE = dataclasses.replace(_PLAN_L2, tokens=PS - 1)

_REFUSALS: list[tuple[str, Callable[[Controller, Request], object]]] = [
    (r"^observe_prefill: tokens must be an int in \[1, 2\*\*53\], got 0$", lambda c, req: c.observe_prefill(0, 1.0)),
    (
        r"^observe_prefill: tokens must be an int in \[1, 2\*\*53\], got True$",
        lambda c, req: c.observe_prefill(True, 1.0),
    ),
    (
        r"^observe_prefill: tokens must be an int in \[1, 2\*\*53\], got 9007199254740993$",
        lambda c, req: c.observe_prefill(2**53 + 1, 1.0),
    ),
    (
        r"^observe_prefill: seconds must be a number in \[0, 86400\], got -1\.0$",
        lambda c, req: c.observe_prefill(4, -1.0),
    ),
    (
        r"^observe_prefill: seconds must be a number in \[0, 86400\], got nan$",
        lambda c, req: c.observe_prefill(4, float("nan")),
    ),
    (r"^note_decode: seconds must be a number in \[0, 86400\], got '1'$", lambda c, req: c.note_decode("1")),  # type: ignore[arg-type]
    (r"^allocate: page count must be an int >= 0, got -1$", lambda c, req: c.allocate(req, -1)),
    (
        rf"^start_restore: {re.escape(str(_PLAN_L2))} does not fit request #1 \(hits \(0, 0, 0\)\)$",
        lambda c, req: c.start_restore(req, _PLAN_L2),
    ),
    (
        rf"^start_restore: {re.escape(str(_PLAN_NEGATIVE))} does not fit request #1 \(hits \(0, 0, 0\)\)$",
        lambda c, req: c.start_restore(req, _PLAN_NEGATIVE),
    ),
    (
        rf"^start_restore: {re.escape(str(_PLAN_PART_PAGE))} does not fit request #1 \(hits \(0, 0, 0\)\)$",
        lambda c, req: c.start_restore(req, _PLAN_PART_PAGE),
    ),
    (r"^plan: expected a Request from admit\(\), got int$", lambda c, req: c.plan(7)),  # type: ignore[arg-type]
    (r"^tokens must be a 1-D sequence of ints, got str$", lambda c, req: c.admit("12")),
    (
        r"^insert: pages must be distinct private pages allocated for this request; page 7 was not allocated to "
        r"request #1 \(free, or the tree's\)$",
        lambda c, req: c.insert(req, [7]),  # type: ignore[list-item]
    ),
    (
        r"^insert: pages must be distinct private pages allocated for this request; page 8 is outside L1's pages "
        r"\[0, 8\)$",
        lambda c, req: c.insert(req, [8, 9]),  # type: ignore[list-item]
    ),
]
_IDS = [
    "observe_prefill-tokens-0",
    "observe_prefill-tokens-bool",
    "observe_prefill-tokens-past-2**53",
    "observe_prefill-seconds-negative",
    "observe_prefill-seconds-nan",
    "note_decode-seconds-str",
    "allocate-count",
    "start_restore-plan-too-long",
    "start_restore-plan-negative",
    "start_restore-plan-part-of-a-page",
    "plan-not-a-request",
    "admit-tokens-str",
    "insert-pages-not-private",
    "insert-pages-outside-l1",
]


@pytest.mark.parametrize(("want", "call"), _REFUSALS, ids=_IDS)
def test_a_refused_argument_is_named_with_its_call(want: str, call: Callable[[Controller, Request], object]) -> None:
    """A bad argument raises MisuseError whose whole message names the call and the value
    (or its type); the request can still be prefilled afterwards."""
    c, _ = _make()
    req = c.admit([1, 2, 3, 4])
    with pytest.raises(MisuseError, match=want) as refused:
        call(c, req)
    # NOTE: pages the request does not own are the typed refusal DESIGN.md names
    assert isinstance(refused.value, PageOwnershipError) == want.startswith("^insert: pages must be distinct")
    pages = c.allocate(req, 2)
    assert pages is not None and c.insert(req, pages) == 4
    c.release(req)
    c.close()


def test_insert_with_too_few_pages_names_the_span_and_the_count() -> None:
    """Inserting a 4-token prompt with one page raises MisuseError naming the pages needed,
    the token span and the count given; the request can insert with enough pages after."""
    c, _ = _make()
    req = c.admit([1, 2, 3, 4])
    pages = c.allocate(req, 2)
    assert pages is not None
    with pytest.raises(MisuseError, match=r"^insert needs 2 pages for tokens \[0, 4\), got 1$"):
        c.insert(req, pages[:1])
    assert req.state is ReqState.PREFILLING
    assert c.insert(req, pages) == 4
    c.release(req)
    c.close()


def test_a_second_insert_is_refused_naming_the_call_and_the_state() -> None:
    """Insert after insert raises MisuseError naming insert, the request, its state and the
    step refused."""
    c, _ = _make()
    req = c.admit([1, 2])
    pages = c.allocate(req, 1)
    assert pages is not None
    c.insert(req, pages)
    with pytest.raises(MisuseError, match=rf"^insert: request #{req.id} is running; 'insert' is not allowed there$"):
        c.insert(req, [])
    c.release(req)
    c.close()


def test_allocate_while_loading_from_storage_is_refused_naming_the_call_and_the_state() -> None:
    """Allocate during an L3 restore raises MisuseError naming allocate, the request, its
    state and the step refused."""
    c, _ = _make()
    tokens = [1, 2, 3, 4]
    _cached(c, tokens, Tier.L1, Tier.L2)
    req = c.admit(tokens)
    assert c.start_restore(req) is not None
    refused = (
        rf"^allocate: request #{req.id} is loading_l3; 'allocate' is not allowed there "
        r"\(wait until poll\(\) reports its restore\)$"
    )
    with pytest.raises(MisuseError, match=refused):
        c.allocate(req, 1)
    c.release(req)
    c.drain()
    c.check_integrity()
    c.close()


def test_a_closed_controller_refuses_every_call() -> None:
    """After close, admit raises MisuseError saying the cache is closed."""
    c, _ = _make()
    c.close()
    with pytest.raises(MisuseError, match=r"^this HiCache is closed$"):
        c.admit([1, 2])


def _controller(sizes: TierSizes, **kwargs: Any) -> Controller:
    fabric = TagFabric(sizes.capacities)
    cost = CostModel(1, CostPriors(), "always")
    return Controller(CacheCore(PS, sizes), TagDevice(fabric), None, cost, **kwargs)


def test_l3_pages_without_a_store_are_refused() -> None:
    """L3 pages configured with no storage backend raise ConfigError saying so."""
    with pytest.raises(ConfigError, match=r"^L3 pages configured but no storage backend given$"):
        _controller(TierSizes(4, 4, 4))


def test_an_unknown_write_policy_is_refused_naming_the_choices_and_the_value() -> None:
    """A write policy that is none of the three raises ConfigError listing them and the value."""
    choices = re.escape(str([p.value for p in WritePolicy]))
    with pytest.raises(ConfigError, match=rf"^write_policy must be one of {choices}, got 'lru'$"):
        _controller(TierSizes(4, 4, 0), write_policy="lru")


def test_zero_seconds_are_accepted() -> None:
    """A prefill or decode that took no measurable time (0.0 s) is a valid observation."""
    c, _ = _make()
    before = len(c.cost.recompute.samples) + (c.cost.recompute.held is not None)
    c.observe_prefill(4, 0.0)
    c.note_decode(0.0)
    assert len(c.cost.recompute.samples) + (c.cost.recompute.held is not None) == before + 1
    c.close()


def test_insert_names_a_page_given_twice_or_another_requests() -> None:
    c, _ = _make()
    a, b = c.admit([1, 2, 3, 4]), c.admit([5, 6, 7, 8])
    pa, pb = c.allocate(a, 2), c.allocate(b, 2)
    assert pa is not None and pb is not None
    with pytest.raises(MisuseError, match=rf"; page {pa[0]} is given twice$"):
        c.insert(a, [pa[0], pa[0]])
    with pytest.raises(MisuseError, match=rf"; page {pb[1]} is request #{b.id}'s$"):
        c.insert(a, [pa[0], pb[1]])
    assert c.insert(a, pa) == 4 and c.insert(b, pb) == 4
    c.release(a)
    c.release(b)
    c.check_integrity()
    c.close()


@pytest.mark.parametrize(
    ("call", "hint"),
    [
        ("release", "release it once"),
        ("allocate", "a request's last call is release"),
        ("insert", "a request's last call is release"),
        ("prefix_pages", "a request's last call is release"),
        ("start_restore", "a request's last call is release"),
    ],
)
def test_a_released_request_is_named_with_the_call_that_used_it(call: str, hint: str) -> None:
    """Releasing twice and using a request after its release read differently."""
    c, _ = _make()
    req = c.admit([1, 2, 3, 4])
    c.release(req)
    args: dict[str, tuple[object, ...]] = {"allocate": (1,), "insert": ([0],)}
    with pytest.raises(HandleError, match=rf"^{call}: request #{req.id} was released; {hint}$"):
        getattr(c, call)(req, *args.get(call, ()))
    c.check_integrity()
    c.close()
