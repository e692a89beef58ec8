"""The fleet simulator (bench/fleet.py): its prefix cache against hand-computed cases and a
page-level LRU reference, the L3 modes' guaranteed relations, the restore decision against
hicache's CostModel, and the quick run's files."""

from __future__ import annotations

import argparse
import json
import math
import sys
from collections import OrderedDict
from collections.abc import Hashable
from dataclasses import replace
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from hicache.core.cost import CostModel, CostPriors
from hicache.errors import MisuseError
from hicache.spec.model import Direction, Tier

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "bench"))
import fleet
from common import guarded
from fleet import Costs, Fleet, Link, PrefixStore, Request, Workload, decide, make_request, simulate

PT = 16
NO_L1_L2 = Fleet(l1_tokens=0, l2_tokens=0, warmup=0.0)


def req(sys_id: int, sys_tokens: int, conv_id: int, prompt: int) -> Request:
    return make_request(sys_id, sys_tokens, conv_id, prompt, prompt, PT)


class PageLRU:
    """Reference: a set of pages keyed by their whole prefix, LRU over pages; a touch
    refreshes the path deepest page first (so ties evict deepest first)."""

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self.pages: OrderedDict[tuple[Hashable, ...], None] = OrderedDict()

    @staticmethod
    def keys(path: tuple[tuple[Hashable, int], ...]) -> list[tuple[Hashable, ...]]:
        ids = [key for key, n in path for _ in range(n)]
        return [(*ids[: i + 1], i) for i in range(len(ids))]

    def match(self, path: tuple[tuple[Hashable, int], ...]) -> int:
        hit = 0
        for key in self.keys(path):
            if key not in self.pages:
                break
            hit += 1
        return hit

    def insert(self, path: tuple[tuple[Hashable, int], ...]) -> None:
        for key in reversed(self.keys(path)):
            self.pages[key] = None
            self.pages.move_to_end(key)
        while len(self.pages) > self.capacity:
            self.pages.popitem(last=False)


def test_a_hit_is_whole_pages_and_leaves_the_last_prompt_token_to_compute() -> None:
    """Only full pages are cached; the page holding the end of the system prompt and the start
    of a conversation is that conversation's; a prompt always recomputes its last token."""
    store = PrefixStore(None)
    store.insert(req(0, 40, 0, 100).insert_path)  # 6 pages: 2 of the system prompt, 4 of conv 0
    assert len(store) == 6
    other = req(0, 40, 1, 70)  # same system prompt, another conversation
    assert store.match(other.match_path) == 2  # page 3 holds conv 0's tokens, not conv 1's
    assert store.match(req(0, 40, 0, 150).match_path) == 6
    exact = req(0, 40, 0, 96)  # 6 full pages, but its last token must be computed
    assert store.match(exact.match_path) == 6 and exact.usable == 5


def test_lru_evicts_the_least_recent_chain_from_its_deep_end() -> None:
    """Eviction order on a hand-computed case: least recently inserted first, a conversation
    before its system prompt, a partly evicted chain keeps its front pages."""
    store = PrefixStore(6)
    x, y = req(0, 32, 0, 65), req(1, 16, 1, 33)  # 2 + 2 pages, 1 + 1 pages
    store.insert(x.insert_path)
    store.insert(y.insert_path)
    z = req(0, 32, 2, 49)  # shares x's system prompt: 2 + 1 pages, needs one more page
    store.insert(z.insert_path)  # LRU order was conv0, sys0, conv1, sys1: conv0 loses one page
    assert (store.match(x.match_path), store.match(y.match_path), store.match(z.match_path)) == (3, 2, 3)
    store.insert(req(2, 48, 3, 49).insert_path)  # 3 pages: conv0's last, then conv1, then sys1
    assert (store.match(x.match_path), store.match(y.match_path), store.match(z.match_path)) == (2, 0, 3)
    assert len(store) == 6


def test_a_path_larger_than_the_store_keeps_its_front() -> None:
    """A prompt longer than the whole store leaves its first pages, never a hole."""
    store = PrefixStore(3)
    r = req(0, 32, 0, 100)  # 6 pages
    store.insert(r.insert_path)
    assert store.match(r.match_path) == 3 and len(store) == 3


def test_a_chain_may_not_shrink() -> None:
    """Inserting a shorter path over a longer cached chain is refused before any change."""
    store = PrefixStore(None)
    store.insert(req(0, 32, 0, 100).insert_path)
    with pytest.raises(MisuseError):
        store.insert(req(0, 32, 0, 60).insert_path)
    assert len(store) == 6


@given(seed=st.integers(0, 2**16), capacity=st.integers(0, 400), insert_output=st.booleans())
def test_prefix_store_equals_page_level_lru(seed: int, capacity: int, insert_output: bool) -> None:
    """On generated workloads the chain-level store matches exactly what a page-level LRU
    radix cache would, request by request."""
    w = Workload(
        requests=60,
        seed=seed,
        system_prompts=4,
        system_tokens=(10, 100),
        conversations=8,
        turns_mean=3,
        user_tokens=(1, 40),
        output_tokens=(1, 40),
        max_context=600,
        insert_output=insert_output,
    )
    store, ref = PrefixStore(capacity), PageLRU(capacity)
    for r in fleet.make_requests(w, PT):
        assert store.match(r.match_path) == ref.match(r.match_path)
        store.insert(r.insert_path)
        ref.insert(r.insert_path)
        assert len(store) == len(ref.pages)


def test_the_shared_store_serves_an_instance_what_another_wrote() -> None:
    """Round-robin puts a conversation's two turns on two instances: only the shared L3 finds
    the first turn's pages on the second."""
    requests = [req(0, 40, 0, 100), req(0, 40, 0, 200)]
    tallies = simulate(requests, 2, NO_L1_L2, Costs())
    assert tallies["shared"].found == [0, 96]
    assert tallies["local"].found == tallies["none"].found == [0, 0]


SMALL = Workload(requests=1500, seed=3, system_prompts=10, conversations=80, system_tokens=(100, 800))
SMALL_FLEET = Fleet(l1_tokens=4_000, l2_tokens=12_000, l3_tokens=40_000, warmup=0.1)


def test_with_one_instance_shared_and_local_l3_are_the_same() -> None:
    """One instance, same capacity and same link: both L3 modes give identical results."""
    same = Costs(l3_local_gib_s=6.0, l3_local_fixed_ms=1.0, store_gib_s=6.0, store_fixed_ms=1.0)
    tallies = simulate(fleet.make_requests(SMALL, PT), 1, SMALL_FLEET, same)
    assert tallies["local"] == tallies["shared"]
    assert tallies["shared"].tiers["L3"] > 0  # the store mattered


@pytest.mark.parametrize("router", ["round_robin", "random"])
def test_an_unbounded_shared_store_makes_the_fleet_find_as_one_machine(router: fleet.Router) -> None:
    """With an unbounded shared L3, what is found does not depend on the fleet's size, and on
    every request it is at least what per-instance L3s (of any size) find."""
    requests = fleet.make_requests(SMALL, PT)
    cfg = replace(SMALL_FLEET, shared_l3_tokens=10**12, router=router)
    one = simulate(requests, 1, cfg, Costs())["shared"].found
    for n in (3, 8):
        tallies = simulate(requests, n, cfg, Costs(), seed=n)
        assert tallies["shared"].found == one
        assert all(s >= p for s, p in zip(tallies["shared"].found, tallies["local"].found, strict=True))


@settings(max_examples=100)
@given(seed=st.integers(0, 2**16), small=st.integers(0, 20_000), more=st.integers(0, 20_000))
def test_a_larger_shared_store_finds_at_least_as_much_on_every_request(seed: int, small: int, more: int) -> None:
    """LRU is a stack algorithm: with the same requests, a larger store holds a superset."""
    w = Workload(requests=150, seed=seed, system_prompts=5, conversations=20, system_tokens=(50, 300))
    requests = fleet.make_requests(w, PT)
    cfg = Fleet(l1_tokens=500, l2_tokens=1_000, warmup=0.0, router="random")
    a = simulate(requests, 4, replace(cfg, shared_l3_tokens=small), Costs(), seed)["shared"].found
    b = simulate(requests, 4, replace(cfg, shared_l3_tokens=small + more), Costs(), seed)["shared"].found
    assert all(y >= x for x, y in zip(a, b, strict=True))


def test_a_bounded_shared_store_can_find_less_than_local_stores_of_the_same_total() -> None:
    """Why the fleet comparison is not a theorem: one instance's large prompts can flush from
    a shared store the small hot prefix that another instance's own store would have kept."""
    small = req(0, 32, 0, 33)  # 2 pages, on instance 1 every time
    requests = []
    for k in range(4):
        requests += [req(1 + k, 128, 1 + k, 129), small]  # instance 0: a new 8-page prompt each time
    tallies = simulate(requests, 2, replace(NO_L1_L2, l3_tokens=4 * PT), Costs())  # shared: 8 pages
    local, shared = tallies["local"].found, tallies["shared"].found
    assert local[3::2] == [32, 32, 32] and shared[3::2] == [0, 0, 0]


ordered_hits = st.tuples(st.integers(0, 5000), st.integers(0, 5000), st.integers(0, 5000)).map(sorted)


@given(hits=ordered_hits, tail=st.integers(1, 3000), gib_s=st.floats(1e-300, 1e-3), fixed_s=st.floats(0, 10))
def test_an_infinitely_slow_store_is_never_chosen(hits: list[int], tail: int, gib_s: float, fixed_s: float) -> None:
    """A store of (nearly) no bandwidth or of infinite fixed cost is never read from."""
    n1, n2, n3 = hits
    for link in (Link(gib_s, fixed_s), Link(50.0, math.inf)):
        assert decide(n3 + tail, n1, n2, n3, Costs(), link).tier != "L3"


def test_an_infinitely_slow_local_store_changes_nothing_in_a_simulation() -> None:
    """With a useless local L3 the per-instance mode is exactly the no-L3 baseline."""
    tallies = simulate(fleet.make_requests(SMALL, PT), 4, SMALL_FLEET, Costs(l3_local_fixed_ms=math.inf))
    assert tallies["local"].used == tallies["none"].used and tallies["local"].tiers["L3"] == 0
    assert sum(tallies["local"].found) > sum(tallies["none"].found)  # it did hold pages


@given(
    hits=ordered_hits,
    tail=st.integers(1, 3000),
    us=st.sampled_from([5.0, 33.0, 80.0]),
    host=st.sampled_from([10.0, 51.0]),
    store=st.sampled_from([0.5, 1.3, 6.0, 20.0]),
    fixed_ms=st.sampled_from([0.0, 1.0, 3.0]),
    margin=st.sampled_from([1.0, 1.5]),
)
def test_decide_agrees_with_hicache_cost_model(
    hits: list[int], tail: int, us: float, host: float, store: float, fixed_ms: float, margin: float
) -> None:
    """The simulator picks the same source and prefix as hicache's CostModel on its priors
    (no exploration), fixed costs included."""
    n1, n2, n3 = hits
    costs = Costs(
        recompute_us_per_token=us,
        l2_gib_s=host,
        l2_fixed_ms=fixed_ms,
        l3_local_gib_s=store,
        l3_local_fixed_ms=2 * fixed_ms,
        margin=margin,
    )
    priors = CostPriors(us * 1e-6, host_gib_s=host, storage_read_gib_s=store, margin=margin, explore=0)
    model = CostModel(costs.bytes_per_token, priors)
    model.transfer[Direction.H2D].fixed = fixed_ms / 1e3
    model.transfer[Direction.S2H].fixed = 2 * fixed_ms / 1e3
    ours = decide(n3 + tail, n1, n2, n3, costs, costs.l3("local"))
    theirs = model.decide(n1, n2, n3)
    assert (ours.tier, ours.tokens) == ({Tier.L1: "L1", Tier.L2: "L2", Tier.L3: "L3"}[theirs.tier], theirs.tokens)


def test_the_same_seed_gives_the_same_results_and_another_seed_does_not() -> None:
    """Deterministic for a seed (workload and random router)."""
    cfg = replace(SMALL_FLEET, router="random")
    first = fleet.run(SMALL, cfg, Costs(), [1, 4])[1]
    assert fleet.run(SMALL, cfg, Costs(), [1, 4])[1] == first
    assert fleet.run(replace(SMALL, seed=4), cfg, Costs(), [1, 4])[1] != first


def test_the_quick_run_writes_json_and_png(tmp_path: Path) -> None:
    """``--quick`` writes a JSON with meta and a row per (instances, L3 mode), and a PNG."""
    assert fleet.main(["--quick", "--out", str(tmp_path), "--tag", "t"]) == 0
    (result,) = tmp_path.glob("fleet-*-t.json")
    data = json.loads(result.read_text())
    assert {(r["instances"], r["l3"]) for r in data["rows"]} == {(n, m) for n in (1, 4, 16, 64) for m in fleet.MODES}
    meta = data["meta"]
    assert meta["seed"] == 0 and meta["git_commit"] and set(meta["costs"]) == set(meta["cost_sources"])
    assert all(0 <= r["hit_rate"] <= r["found_rate"] <= 1 for r in data["rows"])
    assert result.with_suffix(".png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


@pytest.mark.parametrize("flag", ["--requests", "--system-prompts", "--conversations", "--l1-tokens", "--max-context"])
@pytest.mark.parametrize("value", ["0", "-5", "x"])
def test_a_bad_size_is_refused_before_anything_runs(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], flag: str, value: str
) -> None:
    """A count or size below its least value is a usage error naming the flag and value
    (exit 2), with nothing written; with --quick too (it used to be silently replaced)."""
    out = tmp_path / "out"
    with pytest.raises(SystemExit) as exc:
        fleet.main(["--quick", flag, value, "--out", str(out)])
    assert exc.value.code == 2 and capsys.readouterr().err.startswith(f"error: {flag} {value}:")
    assert not out.exists()


def test_quick_sizes_yield_to_the_flags_given(tmp_path: Path) -> None:
    """--quick's smaller world fills only the sizes not given: --requests 50 runs 50."""
    assert fleet.main(["--quick", "--instances", "1", "--requests", "50", "--out", str(tmp_path), "--tag", "q"]) == 0
    meta = json.loads(next(tmp_path.glob("fleet-*-q.json")).read_text())["meta"]
    assert meta["workload"]["requests"] == 50 and meta["workload"]["conversations"] == 300
    assert meta["fleet"]["l1_tokens"] == 40_000


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--turns-mean", "inf"], "--turns-mean inf: not a finite number"),
        (["--turns-mean", "0.5"], "--turns-mean 0.5: must be >= 1"),
        (["--system-zipf", "nan"], "--system-zipf nan: not a number"),
        (["--conversation-zipf", "-1"], "--conversation-zipf -1: must be >= 0"),
    ],
)
def test_a_workload_that_cannot_be_drawn_is_refused_before_anything_runs(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], argv: list[str], message: str
) -> None:
    """An endless conversation (turns_mean inf divided by zero while drawing turns) or a
    NaN or negative Zipf exponent is one error line (exit 2), with nothing written."""
    out = tmp_path / "out"
    with pytest.raises(SystemExit) as exc:
        guarded(lambda: fleet.main(["--quick", *argv, "--out", str(out)]))  # as __main__ runs it
    assert exc.value.code == 2 and capsys.readouterr().err == f"error: {message}\n"
    assert not out.exists()


@pytest.mark.parametrize(
    ("low", "kw", "text", "value"),
    [
        (0, {"inf": True}, "inf", math.inf),  # a zipf exponent: only the first
        (0, {"inf": True}, "Infinity", math.inf),
        (0, {"inf": True}, "2e9", 2e9),
        (0, {"above": True, "inf": True}, "inf", math.inf),  # a link: free
        (0, {}, "0", 0.0),
        (1, {}, " 2.5 ", 2.5),
    ],
)
def test_number_flags_take_what_the_model_takes(low: float, kw: dict[str, bool], text: str, value: float) -> None:
    """The flags take every value the workload and cost model take (infinity where they do),
    and refuse NaN, which compares false everywhere."""
    assert fleet.number(low, **kw)(text) == value
    with pytest.raises(argparse.ArgumentTypeError, match="not a number"):
        fleet.number(low, **kw)("nan")
