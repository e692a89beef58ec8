"""The ``dir`` store across restarts, through the engine in separate processes: a restarted
engine restores from disk what an earlier one computed, bit-exactly and with the same
tokens as a recompute; an engine killed (SIGKILL) in the middle of writing leaves nothing
torn that a later one would serve."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

pytest.importorskip("transformers")

ROOT = Path(__file__).resolve().parents[2]

ENGINE = r"""
import json, sys, random, xxhash
from hicache.engine import Engine

path, role, n_prompts = sys.argv[1], sys.argv[2], int(sys.argv[3])
rng = random.Random(11)
prompts = [[rng.randrange(512) for _ in range(160)] for _ in range(n_prompts)]
e = Engine("tiny", device="cpu", page_size=16, num_pages=96, enable_hicache=True, l2_pages=96, l3_pages=512,
           policy="always", transfer_backend="torch", storage_backend="dir", storage_path=path)
rows = []
for i, prompt in enumerate(prompts):
    out = e.generate(prompt + [1, 2], max_new_tokens=3)
    e.cache.drain()
    core = e.cache.core
    pages = core.pages_l1(core.match(prompt).l1)
    fp = xxhash.xxh3_64_hexdigest(e.cache.l1.buffer[:, :, pages].contiguous().numpy().tobytes())
    rows.append({"tokens": out.tokens, "from": out.restored_from, "cached": out.cached_tokens, "fp": fp})
    print("DONE", i, flush=True)
e.cache.check_integrity()
st = e.cache.status()
print(json.dumps({"role": role, "rows": rows, "storage": st.storage, "lost": e.cache.metrics.l3_lost_runs}))
e.close()
"""


def _run(path: Path, role: str, n: int = 2, timeout_s: float = 240) -> dict[str, object]:
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]))
    out = subprocess.run(
        [sys.executable, "-c", ENGINE, str(path), role, str(n)],
        capture_output=True,
        text=True,
        timeout=timeout_s,
        env=env,
        cwd=ROOT,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    line = [x for x in out.stdout.splitlines() if x.startswith("{")][-1]
    result: dict[str, object] = json.loads(line)
    return result


def test_a_restarted_engine_restores_from_disk_what_an_earlier_one_computed(tmp_path: Path) -> None:
    store = tmp_path / "l3"
    first = _run(store, "first")
    second = _run(store, "second")
    rows1, rows2 = first["rows"], second["rows"]
    assert isinstance(rows1, list) and isinstance(rows2, list)
    for a, b in zip(rows1, rows2, strict=True):
        assert a["from"] == "L1" and a["cached"] == 0
        assert b["from"] == "L3" and b["cached"] == 160
        assert b["fp"] == a["fp"] and b["tokens"] == a["tokens"]
    assert (store.stat().st_mode & 0o777) == 0o700
    assert all((p.stat().st_mode & 0o777) == 0o600 for p in store.iterdir() if p.is_file())


def test_an_engine_killed_while_writing_leaves_nothing_torn(tmp_path: Path) -> None:
    """SIGKILL during write-through: the next engine serves only whole pages (or recomputes),
    its tokens equal a run that never saw the store, and its integrity holds."""
    store = tmp_path / "l3"
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]))
    proc = subprocess.Popen(
        [sys.executable, "-c", ENGINE, str(store), "killed", "12"],
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
        text=True,
        env=env,
        cwd=ROOT,
    )
    try:
        assert proc.stdout is not None
        deadline = time.monotonic() + 180
        for line in proc.stdout:  # let it compute and write a few prompts, then kill it mid-run
            if line.startswith("DONE 2") or time.monotonic() > deadline:
                break
        os.kill(proc.pid, signal.SIGKILL)
    finally:
        proc.kill()
        proc.wait(timeout=30)
    after = _run(store, "after", n=4)
    clean = _run(tmp_path / "fresh", "fresh", n=4)
    rows, ref = after["rows"], clean["rows"]
    assert isinstance(rows, list) and isinstance(ref, list)
    for got, want in zip(rows, ref, strict=True):
        assert got["tokens"] == want["tokens"]
        assert got["fp"] == want["fp"]  # restored pages are the bytes a computation gives
    storage = after["storage"]
    assert isinstance(storage, dict) and storage["dropped_corrupt"] == 0


@pytest.mark.parametrize("policy", ["write_through", "write_back", "write_through_selective"])
def test_a_prefix_hit_again_does_not_refuse_the_restore_of_the_pages_below_it(tmp_path: Path, policy: str) -> None:
    """After a restart, a prompt whose first pages are in L1 (hit a second time: the
    selective policy's threshold) and whose next pages are on disk only restores them from
    L3. A backup of the L1 pages begun at that admission would hold them out of L2, where
    the restore must read the pages below (an L2 copy needs its parent's), and the restore
    would be refused: the request recomputed half its prompt under write_through_selective."""
    from hicache.engine import Engine

    rng = __import__("random").Random(5)
    base = [rng.randrange(512) for _ in range(24)]

    def engine() -> Engine:
        return Engine("tiny", device="cpu", page_size=4, num_pages=16, enable_hicache=True, l2_pages=16,
                      l3_pages=128, storage_backend="dir", storage_path=str(tmp_path), policy="always",
                      write_policy=policy, transfer_backend="torch")  # fmt: skip

    e = engine()
    want = e.generate(base, 3).tokens
    e.close()
    e = engine()
    try:
        for n in (8, 9):
            e.generate(base[:n], 3)  # base's first two pages back in L1, then hit again
        before = e.cache.status().metrics["fallbacks"]
        out = e.generate(base, 3)
        assert (out.restored_from, out.restore_failed, out.cached_tokens) == ("L3", False, 20)
        assert e.cache.status().metrics["fallbacks"] == before
        assert out.tokens == want
        e.cache.drain()
        e.cache.check_integrity()
    finally:
        e.close()
