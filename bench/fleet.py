"""Fleet simulator: N engine instances behind a cache-unaware router, L3 per instance or shared.

A workload of shared system prompts and multi-turn conversations (Zipf popularity over both)
is routed round-robin or at random, so a conversation's turns land on different instances.
Each instance has an L1 and an L2 (page-granular prefix caches with LRU eviction); L3 is
either one store per instance (local disk) or ONE store all instances read and write (e.g.
Mooncake Store over the network), or absent. Per request: the longest prefix found in each
tier, the restore-or-recompute choice of hicache's cost model (``hicache/core/cost.py``) and
an estimated TTFT (service time only: no queueing, no batching). Writes JSON + one PNG.

    python bench/fleet.py [--instances 1 4 16 64] [--requests 100000] [--quick]
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import random
import statistics
import sys
import time
from collections import OrderedDict
from collections.abc import Callable, Hashable, Sequence
from dataclasses import asdict, dataclass, field
from datetime import date
from pathlib import Path
from typing import Any, Literal

from common import _shown, at_least, git_commit, guarded, out_dir, tag_name
from tqdm import tqdm

from hicache.engine.cli import ArgParser
from hicache.errors import ConfigError, MisuseError
from hicache.flags import FlagError, nonneg_float, strict_float

GiB = float(2**30)
Mode = Literal["none", "local", "shared"]
MODES: tuple[Mode, ...] = ("none", "local", "shared")
Router = Literal["round_robin", "random"]
Path_ = Sequence[tuple[Hashable, int]]  # a prompt as chains of pages: (chain key, pages used)


# -- the prefix cache -------------------------------------------------------------------------


class PrefixStore:
    """A page-granular prefix cache with LRU eviction, kept as chains of pages.

    A prompt is a path of chains ``[(key, n), ...]``: the first ``n`` pages of each chain, in
    order (a system prompt's pages, then a conversation's). It is exactly a radix tree of pages
    with LRU over pages where a touch refreshes a whole root-to-leaf path and ties go deepest
    first: a chain's pages share one timestamp, each chain is more recent than its
    descendants, so eviction always trims the least recent chain from its deep end.

    Precondition of :meth:`insert`: a chain is only ever extended (``n`` at least what is
    held) and a chain in the middle of a path is used whole by every path through it.
    """

    __slots__ = ("_held", "capacity", "pages")

    def __init__(self, capacity_pages: int | None) -> None:
        if capacity_pages is not None and capacity_pages < 0:
            raise ConfigError(f"capacity_pages must be >= 0 or None, got {capacity_pages}")
        self.capacity = capacity_pages  # None: unbounded
        self.pages = 0
        self._held: OrderedDict[Hashable, int] = OrderedDict()  # chain -> pages held; LRU first

    def match(self, path: Path_) -> int:
        """Pages of ``path``'s longest cached prefix. Does not change the LRU order."""
        total = 0
        for key, n in path:
            held = self._held.get(key, 0)
            if held < n:
                return total + held
            total += n
        return total

    def insert(self, path: Path_) -> None:
        """Cache all of ``path`` and make it the most recent, then evict down to capacity
        (the path itself last, from its deep end, if it alone exceeds the capacity)."""
        held = self._held
        for key, n in path:
            if n < held.get(key, 0):
                raise MisuseError(f"chain {key!r} holds {held[key]} pages, a path may not shrink it to {n}")
        # Deepest first, so that every chain ends up more recent than its descendants.
        for key, n in reversed(path):
            if n <= 0:
                continue
            self.pages += n - held.get(key, 0)
            held[key] = n
            held.move_to_end(key)
        cap = self.capacity
        while cap is not None and self.pages > cap:
            key, n = next(iter(held.items()))
            drop = min(n, self.pages - cap)
            if drop == n:
                held.popitem(last=False)
            else:
                held[key] = n - drop  # keeps its place
            self.pages -= drop

    def __len__(self) -> int:
        return self.pages


# -- cost constants and the decision ----------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Link:
    """A restore path: ``seconds = fixed + bytes / bandwidth`` (nothing moved costs 0)."""

    gib_s: float
    fixed_s: float

    def __post_init__(self) -> None:
        if not self.gib_s > 0 or not self.fixed_s >= 0:
            raise ConfigError(f"a link needs bandwidth > 0 and fixed >= 0, got {self.gib_s} GiB/s, {self.fixed_s} s")

    def seconds(self, nbytes: float) -> float:
        # The same float expression as hicache's AffineCost.predict, so decisions agree exactly.
        return self.fixed_s + nbytes * (1 / (self.gib_s * GiB)) if nbytes > 0 else 0.0


@dataclass(frozen=True, slots=True)
class Costs:
    """Cost constants (defaults: Qwen3-8B bf16 on an H200; :data:`SOURCES` says where from)."""

    bytes_per_token: int = 147_456
    page_tokens: int = 16
    recompute_us_per_token: float = 33.0
    recompute_fixed_ms: float = 10.0
    l2_gib_s: float = 51.0
    l2_fixed_ms: float = 3.0
    l3_local_gib_s: float = 1.3
    l3_local_fixed_ms: float = 1.0
    store_gib_s: float = 6.0
    network_gib_s: float = 10.0
    store_fixed_ms: float = 1.0
    margin: float = 1.0

    def __post_init__(self) -> None:
        for name, value in asdict(self).items():
            if not (value >= 0 if name.endswith("_ms") else value > 0):  # fixed costs may be 0
                raise ConfigError(f"cost constant {name} must be positive, got {value!r}")

    @property
    def l2(self) -> Link:
        return Link(self.l2_gib_s, self.l2_fixed_ms / 1e3)

    def l3(self, mode: Mode) -> Link | None:
        if mode == "local":
            return Link(self.l3_local_gib_s, self.l3_local_fixed_ms / 1e3)
        if mode == "shared":  # the store or the network, whichever is slower
            return Link(min(self.store_gib_s, self.network_gib_s), self.store_fixed_ms / 1e3)
        return None


SOURCES = {
    "bytes_per_token": "Qwen3-8B bf16: 36 layers x 8 KV heads x 128 dims x 2 (K, V) x 2 bytes",
    "page_tokens": "hicache default page size",
    "recompute_us_per_token": "H200, Qwen3-8B shape with random weights, prefill at ~3,500 tokens",
    "recompute_fixed_ms": "H200, same prefill runs (fixed part of the affine fit)",
    "l2_gib_s": "H200 host, pinned H2D (bench/transfer.py)",
    "l2_fixed_ms": "H200, restore start-up of the L2 path (bench_hicache)",
    "l3_local_gib_s": "H200 host local disk, cold reads 1.1-1.5 GiB/s (bench/storage.py); ~7 GiB/s from page cache",
    "l3_local_fixed_ms": "assumed (not separated from bandwidth in the measurement)",
    "store_gib_s": "Mooncake Store on the H200 host, loopback batch_get_into 4.8-8.4 GiB/s (issue 20)",
    "network_gib_s": "assumed: ~100 Gb/s RDMA-class network to a remote shared store",
    "store_fixed_ms": "assumed: one network round trip plus the store's lookup",
    "margin": "hicache CostPriors default",
}


@dataclass(frozen=True, slots=True)
class Plan:
    tier: Literal["L1", "L2", "L3"]  # L1: recompute past what L1 holds
    tokens: int  # prefix usable without recompute
    ttft_s: float


def decide(prompt: int, n1: int, n2: int, n3: int, costs: Costs, l3: Link | None) -> Plan:
    """hicache's rule (``CostModel.decide``, no exploration): restore from the tier whose
    saving ``n * s_r - margin * restore`` is largest and positive; ties go to L2.
    ``n1 <= n2 <= n3``: prefixes reachable from L1, L1+L2, L1+L2+L3 (in tokens)."""
    s_r, b, fixed = costs.recompute_us_per_token * 1e-6, costs.bytes_per_token, costs.recompute_fixed_ms * 1e-3
    best, benefit = Plan("L1", n1, fixed + (prompt - n1) * s_r), 0.0
    candidates: list[tuple[Literal["L2", "L3"], int, float]] = []
    if n2 > n1:
        candidates.append(("L2", n2, costs.l2.seconds((n2 - n1) * b)))
    if l3 is not None and n3 > n1:
        candidates.append(("L3", n3, costs.l2.seconds((n3 - n1) * b) + l3.seconds((n3 - max(n1, n2)) * b)))
    for tier, n, restore in candidates:
        saved = (n - n1) * s_r - costs.margin * restore
        if saved > benefit:
            best, benefit = Plan(tier, n, fixed + (prompt - n) * s_r + restore), saved
    return best


# -- the workload -----------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Workload:
    """Requests from ``conversations`` slots (Zipf popularity); a slot's conversation runs
    ``turns_mean`` turns on average (geometric), then a new one starts there with a system
    prompt drawn by Zipf: ``1 / turns_mean`` of requests open a new conversation."""

    requests: int = 100_000
    seed: int = 0
    system_prompts: int = 100
    system_zipf: float = 1.0
    system_tokens: tuple[int, int] = (500, 4000)
    conversations: int = 4000
    conversation_zipf: float = 0.8
    turns_mean: float = 6.0
    user_tokens: tuple[int, int] = (50, 500)
    output_tokens: tuple[int, int] = (100, 800)
    max_context: int = 32_768
    insert_output: bool = False  # cache the reply too (hicache's engine caches the prompt only)

    def __post_init__(self) -> None:
        if min(self.requests, self.system_prompts, self.conversations) < 1:
            raise ConfigError(f"requests, system prompts and conversations must be >= 1: {self}")
        if not 1 <= self.turns_mean < math.inf:
            raise ConfigError(f"turns_mean must be a finite number >= 1, got {self.turns_mean!r}")
        for name, alpha in (("system_zipf", self.system_zipf), ("conversation_zipf", self.conversation_zipf)):
            if not alpha >= 0:  # a zipf exponent: 0 is uniform, inf only the first; NaN draws nothing
                raise ConfigError(f"{name} must be a number >= 0, got {alpha!r}")
        for name, (lo, hi) in (
            ("system_tokens", self.system_tokens),
            ("user_tokens", self.user_tokens),
            ("output_tokens", self.output_tokens),
        ):
            if not 1 <= lo <= hi:
                raise ConfigError(f"{name} ({lo}, {hi}): a token range needs 1 <= min <= max")
        if self.max_context < self.system_tokens[1] + self.user_tokens[1]:
            raise ConfigError(f"max_context {self.max_context} cannot hold a first turn")


@dataclass(frozen=True, slots=True)
class Request:
    prompt: int  # tokens
    usable: int  # pages a hit may cover: the last prompt token is always computed
    match_path: tuple[tuple[Hashable, int], ...]
    insert_path: tuple[tuple[Hashable, int], ...]


def _zipf_cum(n: int, alpha: float) -> list[float]:
    cum, total = [], 0.0
    for rank in range(1, n + 1):
        total += rank**-alpha
        cum.append(total)
    return cum


def make_request(sys_id: int, sys_tokens: int, conv_id: int, prompt: int, cached: int, page_tokens: int) -> Request:
    """A request of ``prompt`` tokens (a system prompt, then its conversation) that leaves its
    first ``cached`` tokens in the caches. Keys: even for system prompts, odd for
    conversations; the page that holds the end of the system prompt and the start of the
    conversation belongs to the conversation's chain."""
    sys_pages = sys_tokens // page_tokens

    def path(pages: int) -> tuple[tuple[Hashable, int], ...]:
        return ((2 * sys_id, sys_pages), (2 * conv_id + 1, pages - sys_pages))

    return Request(prompt, (prompt - 1) // page_tokens, path(prompt // page_tokens), path(cached // page_tokens))


def make_requests(w: Workload, page_tokens: int) -> list[Request]:
    """The request sequence (the same for every fleet size); deterministic for ``w.seed``."""
    rng = random.Random(w.seed)
    sys_len = [rng.randint(*w.system_tokens) for _ in range(w.system_prompts)]
    conv_cum = _zipf_cum(w.conversations, w.conversation_zipf)
    slots = rng.choices(range(w.conversations), cum_weights=conv_cum, k=w.requests)
    sys_cum = _zipf_cum(w.system_prompts, w.system_zipf)
    state: dict[int, list[int]] = {}  # slot -> [conversation id, system prompt, context tokens, turns left]
    next_conv = 0
    out: list[Request] = []
    for slot in slots:
        conv = state.get(slot)
        if conv is None or conv[3] <= 0 or conv[2] + w.user_tokens[1] > w.max_context:
            (sys_id,) = rng.choices(range(w.system_prompts), cum_weights=sys_cum)
            u = 1.0 - rng.random()
            turns = 1 + (int(math.log(u) / math.log(1 - 1 / w.turns_mean)) if w.turns_mean > 1 else 0)
            conv = state[slot] = [next_conv, sys_id, sys_len[sys_id], turns]
            next_conv += 1
        conv_id, sys_id, context, _ = conv
        prompt = context + rng.randint(*w.user_tokens)
        stored = prompt + rng.randint(*w.output_tokens)
        conv[2], conv[3] = stored, conv[3] - 1
        cached = stored if w.insert_output else prompt
        out.append(make_request(sys_id, sys_len[sys_id], conv_id, prompt, cached, page_tokens))
    return out


# -- the fleet --------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Fleet:
    """Per-instance tier sizes (tokens) and the router. ``shared_l3_tokens`` None: the shared
    store holds as much as all local L3s together (``instances * l3_tokens``)."""

    l1_tokens: int = 500_000
    l2_tokens: int = 1_500_000
    l3_tokens: int = 6_000_000
    shared_l3_tokens: int | None = None
    router: Router = "round_robin"
    warmup: float = 0.2  # fraction of requests simulated but left out of the figures

    def __post_init__(self) -> None:
        if min(self.l1_tokens, self.l2_tokens, self.l3_tokens) < 0 or (self.shared_l3_tokens or 0) < 0:
            raise ConfigError(f"tier sizes must be >= 0: {self}")
        if self.router not in ("round_robin", "random"):
            raise ConfigError(f"router must be round_robin or random, got {self.router!r}")
        if not 0 <= self.warmup < 1:
            raise ConfigError(f"warmup must be in [0, 1), got {self.warmup}")


@dataclass
class Tally:
    """One L3 mode's per-request figures (measured requests only), in request order."""

    prompt: list[int] = field(default_factory=list)
    found: list[int] = field(default_factory=list)  # tokens reachable from L1+L2+L3
    used: list[int] = field(default_factory=list)  # tokens not recomputed (per the cost model)
    ttft_s: list[float] = field(default_factory=list)
    tiers: dict[str, int] = field(default_factory=lambda: {"L1": 0, "L2": 0, "L3": 0})  # requests per source

    def summary(self) -> dict[str, float]:
        prompt = sum(self.prompt)
        ttft = sorted(self.ttft_s)
        return {
            "requests": len(self.prompt),
            "prompt_tokens": prompt,
            "hit_rate": sum(self.used) / prompt,
            "found_rate": sum(self.found) / prompt,
            "recomputed_tokens": prompt - sum(self.used),
            "mean_ttft_ms": statistics.fmean(ttft) * 1e3,
            "p90_ttft_ms": ttft[min(len(ttft) - 1, math.ceil(0.9 * len(ttft)) - 1)] * 1e3,
            **{f"from_{t.lower()}": k for t, k in self.tiers.items()},
        }


def simulate(
    requests: Sequence[Request], instances: int, fleet: Fleet, costs: Costs, seed: int = 0, progress: bool = False
) -> dict[Mode, Tally]:
    """Run ``requests`` through ``instances`` engines once for all three L3 modes (L1 and L2
    contents do not depend on L3 or on the restore choice: every tier is written through)."""
    if instances < 1:
        raise ConfigError(f"instances must be >= 1, got {instances}")
    pt = costs.page_tokens
    l1 = [PrefixStore(fleet.l1_tokens // pt) for _ in range(instances)]
    l2 = [PrefixStore(fleet.l2_tokens // pt) for _ in range(instances)]
    local = [PrefixStore(fleet.l3_tokens // pt) for _ in range(instances)]
    shared_tokens = fleet.shared_l3_tokens if fleet.shared_l3_tokens is not None else instances * fleet.l3_tokens
    shared = PrefixStore(shared_tokens // pt)
    links = {mode: costs.l3(mode) for mode in MODES}
    tallies: dict[Mode, Tally] = {mode: Tally() for mode in MODES}
    router = random.Random(seed + 1)
    start = int(fleet.warmup * len(requests))
    for j, r in enumerate(tqdm(requests, desc=f"{instances} instances", disable=not progress, leave=False)):
        i = j % instances if fleet.router == "round_robin" else router.randrange(instances)
        u = r.usable
        n1 = min(l1[i].match(r.match_path), u) * pt
        n2 = max(n1, min(l2[i].match(r.match_path), u) * pt)
        if j >= start:
            modes: tuple[tuple[Mode, int], ...] = (
                ("none", n2),
                ("local", max(n2, min(local[i].match(r.match_path), u) * pt)),
                ("shared", max(n2, min(shared.match(r.match_path), u) * pt)),
            )
            for mode, n3 in modes:
                plan = decide(r.prompt, n1, n2, n3, costs, links[mode])
                t = tallies[mode]
                t.prompt.append(r.prompt)
                t.found.append(n3)
                t.used.append(plan.tokens)
                t.ttft_s.append(plan.ttft_s)
                t.tiers[plan.tier] += 1
        for store in (l1[i], l2[i], local[i], shared):
            store.insert(r.insert_path)
    return tallies


# -- the run ----------------------------------------------------------------------------------


def plot(rows: list[dict[str, Any]], meta: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    labels = {"none": "no L3", "local": "L3 per instance (local disk)", "shared": "one shared L3 store"}
    # "no L3" is drawn wide underneath: where a slow local L3 is never worth reading it
    # coincides with "L3 per instance".
    style: dict[str, dict[str, Any]] = {
        "none": {"color": "tab:grey", "marker": "s", "lw": 5, "ms": 9, "alpha": 0.5},
        "local": {"color": "tab:blue", "marker": "o"},
        "shared": {"color": "tab:red", "marker": "^"},
    }
    fig, (hit, ttft) = plt.subplots(1, 2, figsize=(12, 4.5))
    for mode in MODES:
        pts = [r for r in rows if r["l3"] == mode]
        x = [r["instances"] for r in pts]
        dashed = {"color": style[mode]["color"], "ls": "--", "alpha": 0.6}
        hit.plot(x, [100 * r["hit_rate"] for r in pts], label=labels[mode], **style[mode])
        hit.plot(x, [100 * r["found_rate"] for r in pts], **dashed)
        ttft.plot(x, [r["mean_ttft_ms"] for r in pts], label=labels[mode], **style[mode])
        ttft.plot(x, [r["p90_ttft_ms"] for r in pts], **dashed)
    xs = sorted({r["instances"] for r in rows})
    for ax in (hit, ttft):
        ax.set_xscale("log", base=2)
        ax.set_xticks(xs, [str(x) for x in xs])
        ax.minorticks_off()
        ax.set_xlabel("engine instances (cache-unaware router)")
        ax.grid(alpha=0.3)
    hit.set_ylim(0, 100)
    hit.set_ylabel("prefix hit rate (% of prompt tokens)")
    hit.set_title("solid: served from cache (cost model), dashed: found")
    ttft.set_ylim(bottom=0)
    ttft.set_ylabel("estimated TTFT (ms)")
    ttft.set_title("solid: mean, dashed: p90")
    hit.legend(fontsize=8, loc="lower left")
    w = meta["workload"]
    fig.suptitle(
        f"Fleet simulation, {w['requests']:,} requests, {w['conversations']:,} conversations, "
        f"{w['system_prompts']} system prompts, {meta['fleet']['router']} router ({meta['date']})"
    )
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def run(
    workload: Workload, fleet: Fleet, costs: Costs, instances: Sequence[int], progress: bool = False
) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    """The summary rows (one per instance count and L3 mode) and the meta of a run."""
    t0 = time.perf_counter()
    requests = make_requests(workload, costs.page_tokens)
    rows = []
    for n in instances:
        for mode, tally in simulate(requests, n, fleet, costs, workload.seed, progress).items():
            rows.append({"instances": n, "l3": mode, **tally.summary()})
    meta = {
        "date": date.today().isoformat(),
        "git_commit": git_commit() or "unknown",
        "seed": workload.seed,
        "instances": list(instances),
        "workload": asdict(workload),
        "fleet": asdict(fleet),
        "costs": asdict(costs),
        "cost_sources": SOURCES,
        "ttft": "service time of one request alone: recompute fixed + recomputed tokens + restore; no queueing",
        "hit_rate": "tokens not recomputed (per the cost model) / prompt tokens; found_rate: tokens in any tier",
        "runtime_s": round(time.perf_counter() - t0, 2),
        "python": platform.python_version(),
    }
    return meta, rows


def number(low: float, *, above: bool = False, inf: bool = False) -> Callable[[str], float]:
    """An argparse type: a number >= ``low`` (> ``low`` if ``above``), infinity too if ``inf``
    (a zipf exponent: only the first; a link: free), never NaN."""

    def parse(text: str) -> float:
        try:
            value = strict_float(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{_shown(text)}: not a number") from None
        if math.isnan(value):
            raise argparse.ArgumentTypeError(f"{text.strip()}: not a number")
        if math.isinf(value) and not inf:
            raise argparse.ArgumentTypeError(f"{text.strip()}: not a finite number")
        if value < low or (above and value == low):
            raise argparse.ArgumentTypeError(f"{text.strip()}: must be {'>' if above else '>='} {low:g}")
        return value

    return parse


def below_one(text: str) -> float:
    """An argparse type: a fraction in [0, 1)."""
    value = nonneg_float(text)
    if value >= 1:
        raise argparse.ArgumentTypeError(f"{text.strip()}: must be in [0, 1)")
    return value


def main(argv: list[str] | None = None) -> int:
    d_w, d_f, d_c = Workload(), Fleet(), Costs()
    ap = ArgParser("python bench/fleet.py", __doc__)
    ap.add_argument("--instances", type=at_least(1), nargs="+", default=[1, 4, 16, 64])
    ap.add_argument("--requests", type=at_least(1), default=None, help=f"default: {d_w.requests} (--quick: 6000)")
    ap.add_argument("--seed", type=at_least(0), default=d_w.seed)
    ap.add_argument(
        "--system-prompts", type=at_least(1), default=None, help=f"default: {d_w.system_prompts} (--quick: 20)"
    )
    ap.add_argument("--system-zipf", type=number(0, inf=True), default=d_w.system_zipf)
    ap.add_argument("--system-tokens", type=at_least(1), nargs=2, default=d_w.system_tokens, metavar=("MIN", "MAX"))
    ap.add_argument(
        "--conversations",
        type=at_least(1),
        default=None,
        help=f"conversation slots (default: {d_w.conversations}; --quick: 300)",
    )
    ap.add_argument("--conversation-zipf", type=number(0, inf=True), default=d_w.conversation_zipf)
    ap.add_argument(
        "--turns-mean", type=number(1), default=d_w.turns_mean, help="1/this of requests start a conversation"
    )
    ap.add_argument("--user-tokens", type=at_least(1), nargs=2, default=d_w.user_tokens, metavar=("MIN", "MAX"))
    ap.add_argument("--output-tokens", type=at_least(1), nargs=2, default=d_w.output_tokens, metavar=("MIN", "MAX"))
    ap.add_argument("--max-context", type=at_least(1), default=d_w.max_context)
    ap.add_argument("--insert-output", action="store_true", help="cache replies too (SGLang does; hicache: prompt)")
    ap.add_argument("--l1-tokens", type=at_least(1), default=None, help=f"default: {d_f.l1_tokens} (--quick: 40000)")
    ap.add_argument("--l2-tokens", type=at_least(0), default=None, help=f"default: {d_f.l2_tokens} (--quick: 120000)")
    ap.add_argument(
        "--l3-tokens",
        type=at_least(0),
        default=None,
        help=f"per-instance L3 (default: {d_f.l3_tokens}; --quick: 480000)",
    )
    ap.add_argument("--shared-l3-tokens", type=at_least(0), default=None, help="default: instances x --l3-tokens")
    ap.add_argument("--router", choices=["round_robin", "random"], default=d_f.router)
    ap.add_argument("--warmup", type=below_one, default=d_f.warmup, help="fraction of requests left out of the figures")
    for name, value in asdict(d_c).items():
        if name not in ("bytes_per_token", "page_tokens"):  # NOTE: fixed costs may be 0
            kind = number(0, above=not name.endswith("_ms"), inf=True)
            ap.add_argument(f"--{name.replace('_', '-')}", type=kind, default=value)
    ap.add_argument("--bytes-per-token", type=at_least(1), default=d_c.bytes_per_token)
    ap.add_argument("--page-tokens", type=at_least(1), default=d_c.page_tokens)
    ap.add_argument("--quick", action="store_true", help="a small run for tests (seconds)")
    default_out = Path(os.environ.get("HICACHE_BENCH_OUT", "/tmp/hicache-bench"))
    ap.add_argument("--out", type=out_dir, default=default_out)
    ap.add_argument("--tag", type=tag_name, default=None, help="file name tag (default: quick or sim)")
    args = ap.parse_args(argv)
    for flag in ("system_tokens", "user_tokens", "output_tokens"):
        lo, hi = getattr(args, flag)
        if lo > hi:
            raise FlagError(f"--{flag.replace('_', '-')}", f"{lo} {hi}", "MIN must be <= MAX")
    # --quick: a smaller world, ~15x fewer requests, conversations and tier sizes (a flag given wins)
    sizes = {
        "requests": (d_w.requests, 6000),
        "conversations": (d_w.conversations, 300),
        "system_prompts": (d_w.system_prompts, 20),
        "l1_tokens": (d_f.l1_tokens, 40_000),
        "l2_tokens": (d_f.l2_tokens, 120_000),
        "l3_tokens": (d_f.l3_tokens, 480_000),
    }
    for name, (full, quick) in sizes.items():
        if getattr(args, name) is None:
            setattr(args, name, quick if args.quick else full)
    workload = Workload(
        requests=args.requests,
        seed=args.seed,
        system_prompts=args.system_prompts,
        system_zipf=args.system_zipf,
        system_tokens=tuple(args.system_tokens),
        conversations=args.conversations,
        conversation_zipf=args.conversation_zipf,
        turns_mean=args.turns_mean,
        user_tokens=tuple(args.user_tokens),
        output_tokens=tuple(args.output_tokens),
        max_context=args.max_context,
        insert_output=args.insert_output,
    )
    fleet = Fleet(args.l1_tokens, args.l2_tokens, args.l3_tokens, args.shared_l3_tokens, args.router, args.warmup)
    costs = Costs(**{name: getattr(args, name) for name in asdict(d_c)})
    meta, rows = run(workload, fleet, costs, args.instances, progress=not args.quick and sys.stderr.isatty())
    head = f"{'inst':>5} {'L3':>7} {'hit %':>6} {'found %':>8} {'recomputed':>13} {'mean ms':>8} {'p90 ms':>8}"
    print(head + f" {'from L1/L2/L3':>18}")
    for r in rows:
        restores = f"{r['from_l1']}/{r['from_l2']}/{r['from_l3']}"
        print(
            f"{r['instances']:>5} {r['l3']:>7} {100 * r['hit_rate']:>6.1f} {100 * r['found_rate']:>8.1f} "
            f"{r['recomputed_tokens']:>13,} {r['mean_ttft_ms']:>8.1f} {r['p90_ttft_ms']:>8.1f} {restores:>18}"
        )
    args.out.mkdir(parents=True, exist_ok=True)
    stem = args.out / f"fleet-{meta['date']}-{args.tag or ('quick' if args.quick else 'sim')}"
    stem.with_suffix(".json").write_text(json.dumps({"meta": meta, "rows": rows}, indent=1))
    plot(rows, meta, stem.with_suffix(".png"))
    print(f"wrote {stem}.json and .png ({meta['runtime_s']} s simulated)")
    return 0


if __name__ == "__main__":
    guarded(main)
