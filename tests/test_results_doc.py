"""docs/RESULTS.md against the JSON it cites: each headline figure is the one in its file,
printed to the precision shown, and each verdict follows from the figure and its target."""

from __future__ import annotations

import json
import re
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any, NamedTuple

import pytest

ROOT = Path(__file__).resolve().parent.parent
DOC = ROOT / "docs" / "RESULTS.md"
RESULTS = ROOT / "bench" / "results"

TRANSFER = "transfer-2026-12-05-h200.json"
LATENCY = "bench_hicache-qwen3-8b-2026-12-06-h200-quick.json"
LONG = "bench_hicache-qwen3-8b-2026-12-05-h200-long.json"
ROWS = "bench_hicache-qwen3-8b-2026-12-02-h200-quick-rows.json"
STRAIGHT = "bench_hicache-qwen3-8b-2026-12-02-h200-quick-straight.json"
OVERLAP = "bench_hicache_stress-qwen3-8b-2026-12-05-h200-overlap.json"
OVERLAP_4B = "bench_hicache_stress-qwen3-4b-2026-12-05-h200-overlap.json"
SHARE = "share-qwen3-8b-2026-12-01-h200.json"
FLEET = "fleet-2026-12-01-sim.json"
STRESS = (
    "bench_hicache_stress-qwen3-8b-2026-11-30-h200-s10-default.json",
    "bench_hicache_stress-qwen3-4b-2026-11-30-h200-s10-default.json",
)


class Figure(NamedTuple):
    """What a headline row must print (in its measured cell) and whether it meets its target
    (None: no target)."""

    printed: list[str]
    met: bool | None


def load(name: str) -> Any:
    return json.loads((RESULTS / name).read_text())


def span(values: Iterable[float], digits: int = 2) -> str:
    """``lo–hi`` as the doc prints a range (one number when both ends print alike)."""
    vals = list(values)
    lo, hi = f"{min(vals):.{digits}f}", f"{max(vals):.{digits}f}"
    return lo if lo == hi else f"{lo}–{hi}"


def transfer_rows(pages: Iterable[int]) -> list[dict[str, Any]]:
    want = set(pages)
    return [r for r in load(TRANSFER)["rows"] if r["pages"] in want]


def transfer(pages: Iterable[int], layouts: tuple[str, ...], target: float, digits: int = 2) -> Figure:
    ratios = [r[f"{d}_{lay}_ratio"] for r in transfer_rows(pages) for d in ("d2h", "h2d") for lay in layouts]
    return Figure([span(ratios, digits)], min(ratios) >= target)


def kernels(pages: int) -> Figure:
    ratios = [r[k] for r in transfer_rows([pages]) for k in ("gather_ratio", "scatter_ratio")]
    return Figure([span(ratios)], min(ratios) >= 0.85)


def latency_row(tier: str, prefix: int, name: str = LATENCY) -> dict[str, Any]:
    (row,) = [r for r in load(name)["rows"] if r["tier"] == tier and r["prefix_tokens"] == prefix]
    return dict(row)


def restore(tier: str, prefix: int, target: float | None) -> Figure:
    row, base = latency_row(tier, prefix), latency_row("none", prefix)
    printed = [f"{row['speedup']:.2f}×", f"{row['ttft_ms']:.2f} ms"]
    if tier == "l2":
        printed.append(f"{base['ttft_ms']:.2f} ms")
    return Figure(printed, None if target is None else row["speedup"] >= target)


def layered_paths() -> Figure:
    """The 3,500-token L2 restore by layered H2D path, each against its recompute in its own
    run, the runs one after the other: through the ring and out of it by row DMAs (the
    default at that size), straight into L1 (``--d2d-runs 0``)."""
    rows = [latency_row("l2", 3500, name) for name in (ROWS, STRAIGHT)]
    printed = [" / ".join(f"{r['ttft_ms']:.2f}" for r in rows), " / ".join(f"{r['speedup']:.2f}×" for r in rows)]
    printed.append(" / ".join(f"{r['floor_ratio']:.2f}×" for r in rows))
    return Figure(printed, None)


def bookkeeping(prefix: int, target_pct: float) -> Figure:
    share = 100 * latency_row("l2", prefix)["bookkeeping_ms"] / latency_row("none", prefix)["ttft_ms"]
    return Figure([f"{share:.2f}%"], share <= target_pct)


def pages_exact() -> Figure:
    rows = load(LATENCY)["rows"]
    checked = sum(r["restores_checked"] for r in rows)
    mismatches = sum(r["page_mismatches"] for r in rows)
    return Figure([f"{checked} restored prefixes", f"{mismatches} mismatches"], mismatches == 0)


def floor() -> Figure:
    """The L2 restores' TTFT against their floors (measured in the same run), 3,500 / 350 tokens."""
    rows = [latency_row("l2", n) for n in (3500, 350)]
    ratios = [r["ttft_ms"] / r["floor_ms"] for r in rows]
    assert all(abs(x - r["floor_ratio"]) < 1e-9 for x, r in zip(ratios, rows, strict=True))
    printed = [" / ".join(f"{x:.2f}×" for x in ratios), " / ".join(f"{r['floor_ms']:.2f}" for r in rows)]
    return Figure(printed, max(ratios) <= 1.2)


def long_restore(tier: str, target: float) -> Figure:
    """8,000 / 16,000 / 32,000 tokens: speed-ups (and the L3 rows' bookkeeping against ``target``%)."""
    rows = {n: (latency_row(tier, n, LONG), latency_row("none", n, LONG)) for n in (8000, 16000, 32000)}
    printed = [" / ".join(f"{r['speedup']:.2f}×" for r, _ in rows.values())]
    printed.append(" / ".join(f"{r['ttft_ms']:.2f}" for r, _ in rows.values()))
    if tier == "l2":
        printed.append(" / ".join(f"{b['ttft_ms']:.2f}" for _, b in rows.values()))
        return Figure(printed, all(r["speedup"] >= target for r, _ in rows.values()))
    shares = [100 * r["bookkeeping_ms"] / b["ttft_ms"] for r, b in rows.values()]
    printed.append(" / ".join(f"{x:.2f}%" for x in shares))
    return Figure(printed, all(x <= target for x in shares))


def overlap(name: str = OVERLAP) -> Figure:
    (row,) = [r for r in load(name)["rows"] if r["variant"] == "overlap"]
    return Figure([f"{100 * row['overlap_fraction']:.0f}%"], row["overlap_fraction"] >= 0.85)


def share(store: str) -> Figure:
    (row,) = [r for r in load(SHARE)["rows"] if r["store"] == store]
    return Figure([f"{row['speedup']:.2f}×", f"{row['ttft_ms']:.2f} ms", f"{row['recompute_ms']:.2f} ms"], None)


def store_batch() -> Figure:
    (row,) = [r for r in load(SHARE)["rows"] if r["store"] == "mooncake batch"]
    ratio = row["get_gib_s"] / row["plain_copy_gib_s"]
    return Figure([f"{ratio:.2f}×", f"{row['get_gib_s']:.2f}", f"{row['plain_copy_gib_s']:.2f} GiB/s"], None)


def fleet(instances: int) -> Figure:
    by = {r["l3"]: r for r in load(FLEET)["rows"] if r["instances"] == instances}
    none, shared = by["none"], by["shared"]
    return Figure(
        [
            f"{100 * none['hit_rate']:.0f}% → {100 * shared['hit_rate']:.0f}%",
            f"{none['mean_ttft_ms']:.0f} → {shared['mean_ttft_ms']:.0f} ms",
        ],
        None,
    )


def cost_policy() -> Figure:
    cells = [[r["cost_vs_best_forced"] for r in load(name)["rows"] if r["policy"] == "cost"] for name in STRESS]
    printed = [" / ".join(f"{c:.2f}" for c in model) for model in cells]
    return Figure(printed, all(c >= 0.98 for model in cells for c in model))


CHECKS: dict[str, tuple[Callable[[], Figure], tuple[str, ...]]] = {
    "Transfer, 1 page": (lambda: transfer([1], ("consecutive", "fragmented"), 0.5), (TRANSFER,)),
    "Transfer, 4 pages": (lambda: transfer([4], ("consecutive", "fragmented"), 0.8, digits=3), (TRANSFER,)),
    "Transfer, 16 pages": (lambda: transfer([16], ("consecutive", "fragmented"), 0.8), (TRANSFER,)),
    "Transfer, 64 pages": (lambda: transfer([64], ("consecutive", "fragmented"), 0.95), (TRANSFER,)),
    "Transfer, ≥ 256 pages, consecutive": (lambda: transfer([256, 1024], ("consecutive",), 0.95), (TRANSFER,)),
    "Transfer, ≥ 256 pages, fragmented": (lambda: transfer([256, 1024], ("fragmented",), 0.95), (TRANSFER,)),
    "Gather/scatter, 64 pages": (lambda: kernels(64), (TRANSFER,)),
    "Gather/scatter, 256 pages": (lambda: kernels(256), (TRANSFER,)),
    "Gather/scatter, 1,024 pages": (lambda: kernels(1024), (TRANSFER,)),
    "L2 restore, 3,500 tokens": (lambda: restore("l2", 3500, 10.0), (LATENCY,)),
    "L2 restore, 350 tokens": (lambda: restore("l2", 350, 3.0), (LATENCY,)),
    "L2 restore, 3,500 tokens, by layered path": (layered_paths, (ROWS, STRAIGHT)),
    "Bookkeeping, 3,500 tokens": (lambda: bookkeeping(3500, 1.0), (LATENCY,)),
    "Bookkeeping, 350 tokens": (lambda: bookkeeping(350, 1.5), (LATENCY,)),
    "L2 restore against its floor, 3,500 / 350 tokens": (floor, (LATENCY,)),
    "L2 restore, 8,000 / 16,000 / 32,000 tokens": (lambda: long_restore("l2", 10.0), (LONG,)),
    "L3 restore (local disk), 8,000 / 16,000 / 32,000 tokens": (lambda: long_restore("l3", 1.0), (LONG,)),
    "Restored pages bit-exact": (pages_exact, (LATENCY,)),
    "Decode overlap, Qwen3-8B": (overlap, (OVERLAP,)),
    "Decode overlap, Qwen3-4B": (lambda: overlap(OVERLAP_4B), (OVERLAP_4B,)),
    "Sharing, dir store after a restart": (lambda: share("dir (restart)"), (SHARE,)),
    "Sharing, Mooncake Store on loopback": (lambda: share("mooncake (loopback)"), (SHARE,)),
    "Mooncake batch get against a plain host copy": (store_batch, (SHARE,)),
    "Fleet simulation, 64 instances": (lambda: fleet(64), (FLEET,)),
    "Cost policy against the better forced policy (2026-11-30)": (cost_policy, STRESS),
}


def headline() -> dict[str, list[str]]:
    """The rows of the headline table: first cell -> the other cells."""
    section = DOC.read_text().split("## Headline figures", 1)[1].split("\n## ", 1)[0]
    rows: dict[str, list[str]] = {}
    for line in section.splitlines():
        if not line.startswith("|"):
            continue
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if cells[0] in ("figure", "") or set(cells[0]) <= {"-", ":"}:
            continue
        rows[cells[0]] = cells[1:]
    return rows


@pytest.mark.parametrize("label", sorted(CHECKS))
def test_headline_figure_matches_its_json(label: str) -> None:
    """The measured cell prints the figure its JSON holds, to the precision shown."""
    measured = headline()[label][0]
    for text in CHECKS[label][0]().printed:
        assert text in measured, f"{label}: expected {text!r} in {measured!r}"


@pytest.mark.parametrize("label", sorted(CHECKS))
def test_headline_verdict_follows_from_figure_and_target(label: str) -> None:
    """The verdict says met when the figure reaches its target, missed when not, and nothing
    when there is no target."""
    verdict = headline()[label][2]
    met = CHECKS[label][0]().met
    expected = "—" if met is None else ("met" if met else "missed")
    assert verdict.split(" ", 1)[0] == expected, f"{label}: {verdict!r}"


@pytest.mark.parametrize("label", sorted(CHECKS))
def test_headline_cites_the_file_it_was_checked_against(label: str) -> None:
    """The file cell links each JSON the figure was read from."""
    cell = headline()[label][3]
    for name in CHECKS[label][1]:
        assert f"](../bench/results/{name})" in cell, f"{label}: {cell!r}"


def test_every_headline_row_is_checked() -> None:
    """A headline figure comes with its check here."""
    assert set(headline()) == set(CHECKS)


def readme_results() -> dict[str, str]:
    """README's results table: first cell -> the ratio cell."""
    section = (ROOT / "README.md").read_text().split("## Results", 1)[1].split("\n## ", 1)[0]
    rows = [[c.strip() for c in line.strip().strip("|").split("|")] for line in section.splitlines()]
    return {r[0]: r[-1] for r in rows if len(r) == 3 and r[0] not in ("measured", "") and not set(r[0]) <= {"-", ":"}}


def test_the_readme_results_are_the_current_figures() -> None:
    """Each ratio in the README's results table is the one its JSON holds (ASCII spelling)."""
    ratio = {
        "TTFT, 3500 / 16000-token prompt, prefix in L2": (
            f"{latency_row('l2', 3500)['speedup']:.2f}x / {latency_row('l2', 16000, LONG)['speedup']:.2f}x"
        ),
        "TTFT, 350-token prompt, prefix in L2": f"{latency_row('l2', 350)['speedup']:.2f}x",
        "TTFT, 8000-token prompt, prefix in L3 (local disk)": f"{latency_row('l3', 8000, LONG)['speedup']:.2f}x",
        "L1 <-> L2 transfer speed, 64 / 1024 pages": " / ".join(
            transfer([n], ("consecutive", "fragmented"), 0.95).printed[0] for n in (64, 1024)
        ).replace("–", "-"),
        "decode hidden behind restores": overlap().printed[0],
        "TTFT after an engine restart (dir store)": share("dir (restart)").printed[0].replace("×", "x"),
    }
    assert readme_results() == ratio


def test_links_in_results_resolve() -> None:
    """Every relative link and image on the page names a file in the repository."""
    targets = re.findall(r"\]\(([^)#\s]+)\)", DOC.read_text())
    missing = [t for t in targets if "://" not in t and not (DOC.parent / t).resolve().exists()]
    assert targets and not missing, missing
