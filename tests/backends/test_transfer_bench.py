"""bench/transfer.py runs on CPU (the CI smoke test): JSON with its meta, a PNG, a table."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent.parent


def test_the_transfer_bench_runs_on_cpu_and_writes_json_and_a_plot(tmp_path: Path) -> None:
    cmd = [sys.executable, "bench/transfer.py", "--device", "cpu", "--pages", "1", "3", "--reps", "2"]
    run = subprocess.run(
        [*cmd, "--out", str(tmp_path), "--tag", "t"], cwd=ROOT, capture_output=True, text=True, timeout=300
    )
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    (result,) = tmp_path.glob("transfer-*-t.json")
    assert result.with_suffix(".png").stat().st_size > 0
    data = json.loads(result.read_text())
    assert {"torch", "triton", "commit", "device", "date"} <= set(data["meta"])
    assert data["meta"]["engines"]["default"]["workspace_pinned_bytes"] == 0
    rows = data["rows"]
    assert [r["pages"] for r in rows] == [1, 3]
    for r in rows:
        for d in ("d2h", "h2d"):
            for layout in ("consecutive", "fragmented"):
                assert r[f"{d}_{layout}_ratio"] > 0 and r[f"{d}_{layout}_ring_ratio"] > 0
        assert r["gather_ratio"] > 0 and r["scatter_ratio"] > 0
    assert "ratio to the plain pinned copy" in run.stdout
