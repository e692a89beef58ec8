"""Contracts of ``CacheCore`` and ``Controller`` that the seed-27 mutation draw found
unchecked: page-size validation, the guard against evicting an undeclared run, the trace of
a lost run, counters that accumulate, the pages an insert past a cached prefix consumes,
the reason of a restore failed by its L3 deadline and status()'s write policy."""

from __future__ import annotations

from collections.abc import Sequence

import pytest

from hicache.core.cache import CacheCore
from hicache.core.controller import Controller, Outcome
from hicache.core.cost import CostModel, CostPriors
from hicache.core.geometry import TierSizes
from hicache.core.protocols import PageVerifier
from hicache.errors import ConfigError, IntegrityError, MisuseError
from hicache.spec.model import Direction, Event, RunState, Tier
from hicache.spec.request import ReqEvent, ReqState
from hicache.testing.tag_movers import TagDevice, TagFabric, TagStorage
from tests.core.test_seed26_controller import _cached
from tests.core.test_tree import make, prefill, through

PS = 2  # tokens per page


class _SharedStore(TagStorage):
    """A keyed store other caches write too, claiming to hold the first ``held`` pages."""

    def __init__(self, fabric: TagFabric, held: int) -> None:
        super().__init__(fabric)
        self.held = held

    @property
    def keyed(self) -> bool:
        return True

    @property
    def shared(self) -> bool:
        return True

    def exists(self, keys: Sequence[bytes]) -> int:
        return min(self.held, len(keys))


class _RejectAll:
    """A page verifier that fails every transfer it checks."""

    def verify(self, direction: Direction, src: Sequence[int], dst: Sequence[int]) -> str | None:
        return "digest mismatch"

    def forget_slots(self, slots: Sequence[int]) -> None:
        pass


def _make(
    l3: int = 16,
    *,
    held: int | None = None,
    write_policy: str = "write_through",
    verifier: PageVerifier | None = None,
) -> tuple[Controller, TagFabric]:
    """A controller over tag movers; with ``held``, over a shared store holding that many pages."""
    sizes = TierSizes(8, 8, l3)
    fabric = TagFabric(sizes.capacities)
    store = TagStorage(fabric) if held is None else _SharedStore(fabric, held)
    seed = bytes(16) if store.keyed else None  # any 16-byte key of the empty prefix
    core = CacheCore(PS, sizes, tracing=True)
    cost = CostModel(1, CostPriors(), "always")
    c = Controller(core, TagDevice(fabric), store, cost, write_policy=write_policy, verifier=verifier, key_seed=seed)
    return c, fabric


@pytest.mark.parametrize("page_size", [True, 2.0])
def test_a_page_size_that_is_not_a_plain_positive_int_is_refused(page_size: object) -> None:
    """A bool (even True, which equals 1) or a float (even 2.0) page size raises ConfigError
    naming it."""
    with pytest.raises(ConfigError, match=rf"^page_size must be a positive int, got {page_size!r}$"):
        CacheCore(page_size, TierSizes(4, 4, 4))  # type: ignore[arg-type]


def test_evicting_a_run_in_an_undeclared_state_is_an_integrity_error_at_the_run() -> None:
    """The guard under every eviction: a run whose copies and transfers form no declared
    state raises IntegrityError("declared-states") naming the run, and drops nothing."""
    core = make()
    node = prefill(core, (1, 2))
    node.inflight[Direction.S2H] = object()  # type: ignore[call-overload]  # an S2H with no L3 copy
    assert node.state is None
    where = repr(node)
    with pytest.raises(IntegrityError) as caught:
        core._evict_one(node, Tier.L1)
    err = caught.value
    assert (err.invariant, err.where, err.detail) == (
        "declared-states",
        where,
        "evicting a run in an undeclared state",
    )
    assert node.pages[Tier.L1] is not None


def test_losing_a_run_traces_it_by_id() -> None:
    """Losing a run known only in L3 logs L3 --lose--> EMPTY on that run (its id), then its
    removal."""
    core = make()
    node = prefill(core, (1, 2, 3, 4))
    through(core, node, Direction.D2H, Direction.H2S)
    core.evict(Tier.L1, 100)
    core.evict(Tier.L2, 100)
    assert core.lose(node) == 2
    assert [(e.node, e.before, e.event, e.after) for e in core.tree.trace[-2:]] == [
        (node.id, RunState.L3, Event.LOSE, RunState.EMPTY),
        (node.id, RunState.EMPTY, Event.REMOVE, RunState.REMOVED),
    ]


def test_request_coverage_counts_each_transition_taken() -> None:
    """Three requests each inserted and released: request_coverage counts the
    PREFILLING --insert--> and RUNNING --release--> transitions three times each."""
    c, _ = _make()
    for i in range(3):
        _cached(c, [10 * i + 1, 10 * i + 2])
    assert c.request_coverage[(ReqState.PREFILLING, ReqEvent.INSERT)] == 3
    assert c.request_coverage[(ReqState.RUNNING, ReqEvent.RELEASE)] == 3
    c.close()


def test_discovery_counts_exactly_the_l3_slots_it_recorded() -> None:
    """A shared store holding more pages than L3 has room for: nothing is recorded and the
    counter stays 0; holding 2 pages of a 3-page prompt on a roomy L3: it counts 2."""
    c, _ = _make(l3=2, held=3)
    req = c.admit([1, 2, 3, 4, 5, 6])
    assert req.hit == (0, 0, 0)
    assert c.metrics.l3_discovered_pages == 0
    c.release(req)
    c.close()
    c, _ = _make(held=2)
    req = c.admit([1, 2, 3, 4, 5, 6])
    assert req.hit == (0, 0, 4)
    assert c.metrics.l3_discovered_pages == 2
    c.release(req)
    c.close()


def test_insert_past_a_cached_prefix_consumes_only_the_pages_it_needs() -> None:
    """A request with 4 tokens cached that inserts 8 tokens with 4 private pages uses 2;
    the other 2 stay its own, and release frees them: L1 ends with only the tree's 4."""
    c, _ = _make()
    _cached(c, [1, 2, 3, 4])
    req = c.admit([1, 2, 3, 4, 5, 6, 7, 8])
    assert req.cached_len == 4
    own = c.allocate(req, 4)
    assert own is not None
    assert c.insert(req, own) == 8
    assert req.private == own[2:]
    c.release(req)
    c.drain()
    assert c.core.status().tiers[Tier.L1].free == 8 - 4
    c.check_integrity()
    c.close()


def test_layer_events_of_a_wrong_type_are_refused_naming_the_type() -> None:
    """start_restore with layer_events that is not a sequence (a set, a str) raises
    MisuseError naming the type given."""
    c, _ = _make()
    req = c.admit([1, 2])
    for bad, name in (({1}, "set"), ("abc", "str")):
        with pytest.raises(MisuseError, match=rf"^start_restore: layer_events must be a sequence, got {name}$"):
            c.start_restore(req, layer_events=bad)  # type: ignore[arg-type]
    c.release(req)
    c.close()


def test_a_restore_past_its_l3_deadline_fails_with_that_reason() -> None:
    """An L3 read failed by its deadline that gives no error of its own fails the restore
    with reason "L3 deadline"; the request may recompute."""
    c, fabric = _make()
    tokens = [1, 2, 3, 4]
    _cached(c, tokens, Tier.L1, Tier.L2)
    req = c.admit(tokens)
    pending = c.start_restore(req)
    assert pending is not None and pending.plan.tier is Tier.L3
    (ticket,) = fabric.queue
    fabric.expire(ticket)
    ticket.error = None
    c.poll()
    assert (pending.outcome, pending.error) == (Outcome.FAILED, "L3 deadline")
    assert c.metrics.l3_deadline_failures == 1
    fabric.settle(ticket)
    c.poll()
    c.release(req)
    c.check_integrity()
    c.close()


def test_verify_failures_count_every_rejected_transfer() -> None:
    """A verifier that rejects every copy: two prompts' backups (a D2H each, the first
    transfer of each) count two verify failures."""
    c, _ = _make(verifier=_RejectAll())
    _cached(c, [1, 2])
    _cached(c, [3, 4])
    assert c.metrics.verify_failures == 2
    c.close()


@pytest.mark.parametrize("policy", ["write_through", "write_back", "write_through_selective"])
def test_status_reports_the_write_policy(policy: str) -> None:
    """status().write_policy is the configured policy's name."""
    c, _ = _make(write_policy=policy)
    assert c.status().write_policy == policy
    c.close()
