"""Two separate engine processes on the tiny model share one Mooncake Store: B restores from
the store the prefix A computed, bit-exactly, and generates the same tokens as a recompute."""

from __future__ import annotations

import json
import sys

from tests.mooncake.cluster import MooncakeCluster

# Each child prints one JSON line: its outputs and the fingerprint of the prefix's L1 pages.
ENGINE = r"""
import json, sys, random, xxhash
from hicache.engine import Engine

extra, role = json.loads(sys.argv[1]), sys.argv[2]
rng = random.Random(7)
prefix = [rng.randrange(512) for _ in range(96)]
e = Engine("tiny", device="cpu", page_size=16, num_pages=64, enable_hicache=True, l2_pages=64, l3_pages=256,
           policy="always", transfer_backend="torch", storage_backend="mooncake", storage_extra=extra)
assert e.cache.storage is not None and e.cache.storage.available, e.cache.storage.status()
prompt = prefix + [5, 6, 7]
out = e.generate(prompt, max_new_tokens=4)
e.cache.drain()
core = e.cache.core
pages = core.pages_l1(core.match(prefix).l1)
fp = xxhash.xxh3_64_hexdigest(e.cache.l1.buffer[:, :, pages].contiguous().numpy().tobytes())
m = e.cache.metrics
print(json.dumps({"role": role, "tokens": out.tokens, "from": out.restored_from, "cached": out.cached_tokens,
                  "fingerprint": fp, "discovered": m.l3_discovered_pages, "restores": m.restores}))
e.close()
"""

RECOMPUTE = r"""
import json, sys, random
from hicache.engine import Engine
rng = random.Random(7)
prefix = [rng.randrange(512) for _ in range(96)]
e = Engine("tiny", device="cpu", page_size=16, num_pages=64)
print(json.dumps({"tokens": e.generate(prefix + [5, 6, 7], max_new_tokens=4).tokens}))
e.close()
"""


def _last_json(out: str) -> dict[str, object]:
    line = [x for x in out.splitlines() if x.startswith("{")][-1]
    result: dict[str, object] = json.loads(line)
    return result


def test_a_second_engine_process_restores_what_the_first_computed(mooncake_cluster: MooncakeCluster) -> None:
    extra = json.dumps(mooncake_cluster.extra())
    a = _last_json(mooncake_cluster.run([sys.executable, "-c", ENGINE, extra, "a"], "engine-a"))
    b = _last_json(mooncake_cluster.run([sys.executable, "-c", ENGINE, extra, "b"], "engine-b"))
    plain = _last_json(mooncake_cluster.run([sys.executable, "-c", RECOMPUTE], "recompute"))
    assert a["from"] == "L1" and a["cached"] == 0  # A computed everything
    assert b["from"] == "L3" and b["cached"] == 96 and b["discovered"] == 6 and b["restores"] == 1
    assert b["fingerprint"] == a["fingerprint"]  # the pages B restored are the bytes A computed
    assert b["tokens"] == a["tokens"] == plain["tokens"]


UNCLOSED = r"""
import json, sys, random
from hicache.engine import Engine

extra, seed = json.loads(sys.argv[1]), int(sys.argv[2])
e = Engine("tiny", device="cpu", page_size=16, num_pages=64, enable_hicache=True, l2_pages=64, l3_pages=256,
           policy="always", transfer_backend="torch", storage_backend="mooncake", storage_extra=extra)
rng = random.Random(seed)
for _ in range(6):  # each prompt's backup goes on to the store as the next one runs
    e.generate([rng.randrange(512) for _ in range(200)], max_new_tokens=2)
print("EXITING", flush=True)  # never closed: the exit finds puts in flight
"""


def test_a_process_that_never_closed_its_mooncake_engine_exits_cleanly(mooncake_cluster: MooncakeCluster) -> None:
    """An engine on the Mooncake store never closed, its backups still being put as the
    interpreter ends: the process exits with status 0. The client torn down with puts in
    flight aborted it ("terminate called without an active exception") in about one run in
    three; so six runs. Its store is closed at exit instead, as ``close()`` would."""
    extra = json.dumps(mooncake_cluster.extra())
    for i in range(6):
        out = mooncake_cluster.run([sys.executable, "-c", UNCLOSED, extra, str(i)], f"unclosed-{i}")  # rc 0 or raises
        assert "EXITING" in out and "terminate called" not in out
