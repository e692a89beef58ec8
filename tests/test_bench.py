"""The latency benchmark on CPU (tiny model): its rows carry the host-time split that
README's bookkeeping figures come from."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def test_latency_bench_splits_hicache_time_into_bookkeeping_and_issuing_copies(tmp_path: Path) -> None:
    cmd = [sys.executable, "bench_hicache.py", "--model", "tiny", "--device", "cpu", "--prefix-tokens", "200"]
    cmd += ["--iterations", "3", "--warmup", "1", "--no-clock-burst", "--out", str(tmp_path), "--tag", "t"]
    run = subprocess.run(cmd, cwd=ROOT / "bench", capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    (result,) = tmp_path.glob("bench_hicache-tiny-*-t.json")
    rows = {r["tier"]: r for r in json.loads(result.read_text())["rows"]}
    assert set(rows) == {"none", "l2", "l3"}
    assert rows["none"]["transfer_issue_ms"] == 0  # without hicache nothing is copied
    for tier in ("l2", "l3"):
        r = rows[tier]
        assert r["restores_checked"] > 0 and r["page_mismatches"] == 0
        assert r["transfer_issue_ms"] > 0 and r["cache_calls_ms"]["start_restore"] > 0
        calls = sum(r["cache_calls_ms"].values())
        assert abs(r["bookkeeping_ms"] + r["transfer_issue_ms"] - calls) < 1e-6
        assert r["transfer_issue_ms"] < calls <= r["cache_ms"] * 1.05  # the engine's own count, plus timer cost
