"""Charts of the end-to-end benchmarks, drawn from their JSON (so a result can be redrawn).

python bench/plots.py bench/results/bench_hicache*.json   # rewrites each FILE.png beside FILE.json
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any, NoReturn

import matplotlib

from hicache.engine.cli import ArgParser

matplotlib.use("Agg")
import matplotlib.pyplot as plt
from matplotlib.axes import Axes

POLICY_COLOURS = {"always": "tab:blue", "never": "tab:orange", "cost": "tab:green"}
TIER_STYLE = {  # label, colour, line style
    "none": ("recompute", "black", "--"),
    "l2": ("L2 restore", "tab:blue", "-"),
    "l3": ("L3 restore", "tab:red", "-"),
}
SCENARIOS = {
    ("l2", "-"): "L2\n(host memory)",
    ("l3", "disk"): "L3 on disk\n(O_DIRECT, cold)",
    ("l3", "pagecache"): "L3 on tmpfs\n(page cache)",
}


def _num(value: Any) -> float:
    """A figure from a result file, null (nothing to compare against) as NaN."""
    return float("nan") if value is None else float(value)


def _title(meta: dict[str, Any]) -> str:
    return f"{meta.get('model', '?')} ({meta.get('dtype', '?')}) on {meta.get('device', '?')}, {meta.get('date', '')}"


def _label_bars(ax: Axes, bars: Any, fmt: str) -> None:
    for bar in bars:
        h = bar.get_height()
        ax.annotate(fmt.format(h), (bar.get_x() + bar.get_width() / 2, h), ha="center", va="bottom", fontsize=8)


def plot_latency(rows: list[dict[str, Any]], meta: dict[str, Any], path: Path) -> None:
    """TTFT by prefix length per tier (recompute dashed), and the speed-up over recompute."""
    fig, (ax, sp) = plt.subplots(1, 2, figsize=(11, 4.2))
    tiers = [t for t in TIER_STYLE if any(r["tier"] == t for r in rows)]
    for tier in tiers:
        pts = sorted((r["prefix_tokens"], r["ttft_ms"]) for r in rows if r["tier"] == tier)
        label, colour, style = TIER_STYLE[tier]
        ax.plot([p for p, _ in pts], [t for _, t in pts], style, marker="o", color=colour, label=label)
    ax.set_xlabel("prefix length (tokens)")
    ax.set_ylabel("time to first token (ms, median)")
    ax.set_ylim(bottom=0)
    ax.legend()
    ax.set_title("TTFT by where the prefix comes from")
    prefixes = sorted({r["prefix_tokens"] for r in rows})
    restored = [t for t in tiers if t != "none"]
    width = 0.8 / max(1, len(restored))
    for i, tier in enumerate(restored):
        by = {r["prefix_tokens"]: _num(r.get("speedup")) for r in rows if r["tier"] == tier}
        xs = [j + (i - (len(restored) - 1) / 2) * width for j in range(len(prefixes))]
        label, colour, _ = TIER_STYLE[tier]
        _label_bars(sp, sp.bar(xs, [by.get(p, 0.0) for p in prefixes], width, color=colour, label=label), "{:.1f}x")
    sp.axhline(1.0, color="black", linestyle="--", linewidth=1, label="recompute")
    sp.set_xticks(range(len(prefixes)), [str(p) for p in prefixes])
    sp.set_xlabel("prefix length (tokens)")
    sp.set_ylabel("speed-up over recompute (x)")
    sp.legend()
    sp.set_title("TTFT speed-up")
    fig.suptitle(_title(meta))
    fig.tight_layout()
    fig.savefig(path.with_suffix(".png"), dpi=110)
    plt.close(fig)


def _rotation(ax: Axes, rows: list[dict[str, Any]]) -> None:
    scenarios = [k for k in SCENARIOS if any((r["tier"], r["storage"]) == k for r in rows)]
    policies = [p for p in POLICY_COLOURS if any(r["policy"] == p for r in rows)]
    width = 0.8 / max(1, len(policies))
    for i, policy in enumerate(policies):
        by = {(r["tier"], r["storage"]): r["req_per_s"] for r in rows if r["policy"] == policy}
        xs = [j + (i - (len(policies) - 1) / 2) * width for j in range(len(scenarios))]
        bars = ax.bar(xs, [by.get(s, 0.0) for s in scenarios], width, color=POLICY_COLOURS[policy], label=policy)
        _label_bars(ax, bars, "{:.1f}")
    base = next((r["req_per_s"] for r in rows if r["tier"] == "none"), None)
    if base is not None:
        ax.axhline(base, color="black", linestyle="--", linewidth=1, label=f"recompute ({base:.1f})")
    ax.set_xticks(range(len(scenarios)), [SCENARIOS[s] for s in scenarios])
    ax.set_ylabel("requests / s (one at a time)")
    ax.set_ylim(top=ax.get_ylim()[1] * 1.12)  # room for the value labels
    ax.legend(title="policy", fontsize=8, loc="upper left", bbox_to_anchor=(1.0, 1.0))
    ax.set_title("prefix rotation: throughput by tier and policy")


def _overlap(ax: Axes, rows: list[dict[str, Any]]) -> None:
    names = [r["variant"] for r in rows]
    bars = ax.bar(range(len(rows)), [r["decode_tokens_per_s"] for r in rows], 0.6, color=["tab:green", "tab:gray"])
    for bar, r in zip(bars, rows, strict=True):
        ov = r.get("overlap_fraction")
        note = f"{r['decode_tokens_per_s']:.0f} tok/s\n{r['req_per_s']:.1f} req/s"
        note += "" if ov is None else f"\nrestore {ov:.0%} overlapped"
        ax.annotate(note, (bar.get_x() + bar.get_width() / 2, bar.get_height()), ha="center", va="bottom", fontsize=8)
    ax.set_xticks(
        range(len(rows)), [{"overlap": "overlap loop", "blocking": "blocking restores"}.get(n, n) for n in names]
    )
    ax.set_ylabel("decode tokens / s (background decoders)")
    ax.set_ylim(top=ax.get_ylim()[1] * 1.3)
    ax.set_title("L2 restores beside decoding")


def plot_stress(rows: list[dict[str, Any]], meta: dict[str, Any], path: Path) -> None:
    """Rotation (scenario groups, policy colours, recompute line) and overlap vs blocking,
    as separate charts side by side."""
    rotation = [r for r in rows if r["variant"] == "rotation"]
    overlap = [r for r in rows if r["variant"] != "rotation"]
    panels = [p for p in ((rotation, _rotation, 8.5), (overlap, _overlap, 4.5)) if p[0]]
    fig, axes = plt.subplots(
        1, len(panels), figsize=(sum(w for *_, w in panels), 4.6), width_ratios=[w for *_, w in panels], squeeze=False
    )
    for ax, (subset, draw, _) in zip(axes[0], panels, strict=True):
        draw(ax, subset)
    fig.suptitle(_title(meta))
    fig.tight_layout()
    fig.savefig(path.with_suffix(".png"), dpi=110)
    plt.close(fig)


def _fail(message: str) -> NoReturn:
    """One line and exit status 2, as every CLI of ours ends on bad input."""
    print(f"error: {message}", file=sys.stderr)
    raise SystemExit(2)


def replot(path: Path) -> None:
    if path.is_dir():
        _fail(f"{path}: a directory (give a bench_hicache*.json file)")
    if not path.is_file():
        _fail(f"{path}: no such file")
    if not path.name.startswith("bench_hicache") or path.suffix != ".json":
        _fail(f"{path}: not a bench_hicache result (bench_hicache*.json)")
    try:
        data = json.loads(path.read_text())
    except OSError as exc:
        _fail(f"{path}: cannot read it ({exc.strerror or exc})")
    except ValueError as exc:
        _fail(f"{path}: not JSON ({exc})")
    if not isinstance(data, dict) or not isinstance(data.get("rows"), list) or not isinstance(data.get("meta"), dict):
        _fail(f'{path}: not a bench_hicache result (it needs "rows", a list, and "meta", an object)')
    rows, meta = data["rows"], data["meta"]
    stress = path.name.startswith("bench_hicache_stress-")
    need = ("variant",) if stress else ("tier", "prefix_tokens", "ttft_ms")
    for i, row in enumerate(rows):
        lacks = [k for k in need if not isinstance(row, dict) or k not in row]
        if lacks:
            _fail(f"{path}: row {i} lacks {', '.join(lacks)}")
    draw = plot_stress if stress else plot_latency
    draw(rows, meta, path.with_suffix(""))


if __name__ == "__main__":
    ap = ArgParser("python bench/plots.py", __doc__)
    ap.add_argument("files", nargs="+", type=Path, metavar="FILE.json", help="bench_hicache*.json results")
    for name in ap.parse_args().files:
        replot(name)
