"""A Mooncake master that dies while a cache is open: restores and backups fail within the
store's deadline, ``close()`` returns in bounded time, and the process then exits cleanly.
A put that outlived its deadline used to come back from the client's native code while the
interpreter was ending, and the process died of a segmentation fault after ``close()``."""

from __future__ import annotations

import json
import os
import signal
import sys
import time
from pathlib import Path

import pytest

from tests.mooncake.cluster import READY_MARK, MooncakeCluster, Unavailable, stop

SCRIPT = r"""
import json, os, sys, time
import torch
from hicache import HiCache, HiCacheConfig
from hicache.core.geometry import KVGeometry

PS = 16
extra, go = json.loads(sys.argv[1]), sys.argv[2]
g = KVGeometry(2, 2, 16, PS, torch.float32)
cfg = HiCacheConfig(g, l1_pages=16, l2_pages=16, l3_pages=256, device="cpu", policy="always",
                    storage_backend="mooncake", storage_extra=extra, model_id="gone", storage_deadline_s=3.0)
prompts = [[1000 * i + j for j in range(100)] for i in range(12)]

def serve(cache, p, seed):
    req = cache.admit(p)
    cache.restore(req)
    need = -(-len(p) // PS) - req.cached_len // PS
    pages = cache.allocate(req, need)
    if pages is None:
        cache.drain()
        pages = cache.allocate(req, need)
    cache.l1.buffer[:, :, pages] = float(seed)
    cache.insert(req, pages[: len(p) // PS - req.cached_len // PS])
    cache.release(req)

cache = HiCache(cfg)
assert cache.status().storage["available"], cache.status().storage
for i in range(8):
    serve(cache, prompts[i], i)
cache.drain()
print("READY", flush=True)
end = time.monotonic() + 60
while not os.path.exists(go) and time.monotonic() < end:
    time.sleep(0.05)
time.sleep(1.0)
for i in (1, 2, 3, 8, 9, 10, 11):  # restores from L3 and new backups, the master gone
    serve(cache, prompts[i], i)
t0 = time.monotonic()
cache.drain()
cache.close()
print(f"DONE close {time.monotonic() - t0:.1f} s", flush=True)
"""


def test_a_cache_whose_master_died_closes_and_exits_cleanly(tmp_path: Path) -> None:
    try:
        with MooncakeCluster.start(tmp_path) as mc:
            go = tmp_path / "go"
            proc = mc.popen([sys.executable, "-c", SCRIPT, json.dumps(mc.extra()), str(go)], "gone")
            log = tmp_path / "gone.log"
            end = time.monotonic() + 120
            while "READY" not in log.read_text() and proc.poll() is None and time.monotonic() < end:
                time.sleep(0.1)
            assert "READY" in log.read_text(), log.read_text()[-3000:]
            master = mc.procs[0]
            os.kill(master.pid, signal.SIGKILL)
            master.wait(10)
            go.touch()
            try:
                rc = proc.wait(150)
            except Exception:
                stop(proc)
                raise
            out = log.read_text()
            assert "DONE" in out, out[-3000:]
            assert rc == 0, f"exited with {rc} after close():\n{out[-3000:]}"
    except Unavailable as exc:
        if READY_MARK.exists():
            pytest.fail(f"Mooncake was installed by scripts/setup.sh but cannot run: {exc}")
        pytest.skip(str(exc))
