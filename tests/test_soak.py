"""The CI-sized soak: bench/soak.py on CPU with the tiny model, faults and aborts included;
it exits non-zero on a leak, a failed request, a wrong page or a broken invariant."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


@pytest.mark.slow
def test_soak_ci_sized(tmp_path: Path) -> None:
    requests = int(os.environ.get("HICACHE_SOAK_REQUESTS", "5000"))
    cmd = [sys.executable, "soak.py", "--device", "cpu", "--model", "tiny", "--requests", str(requests)]
    cmd += ["--warmup", "200", "--out", str(tmp_path), "--tag", "ci"]
    run = subprocess.run(cmd, cwd=ROOT / "bench", capture_output=True, text=True, timeout=900)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    (result,) = tmp_path.glob("soak-tiny-*-ci.json")
    row = json.loads(result.read_text())["rows"][0]
    assert row["served"] + row["aborted"] >= requests - 10  # aborts of finished requests count nothing
    assert row["errors"] == 0 and row["verify_failures"] == 0 and not row["leaks"]
    assert row["faults_injected"] > 0 and row["fallbacks"] > 0 and row["aborted"] > 0
    assert sum(row["transfers_failed"].values()) > 0 and row["verified_pages"] > 0
    assert row["final"]["pending_transfers"] == 0 and row["final"]["leases"] == 0
