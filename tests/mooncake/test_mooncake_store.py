"""The ``mooncake`` store between two separate processes through a standalone client:
what A puts, B finds and reads bit-exactly; a missing page is lost; an unreachable or
silent master degrades to no L3 without raising."""

from __future__ import annotations

import json
import sys

from tests.mooncake.cluster import MooncakeCluster

N = 12

PUT = r"""
import json, sys
from hicache.backends.pools import HostPool
from hicache.backends.stores import PageStatus, open_storage
from tests.backends.store_helpers import G, KEYS, page_bytes

extra, n = json.loads(sys.argv[1]), int(sys.argv[2])
host = HostPool(G, n)
for i in range(n):
    host.bytes[i].copy_(page_bytes(i))
s = open_storage("mooncake", G, host, slots=64, extra=extra, chunk_pages=5)
assert s.available and s.keyed and s.shared, s.status()
t = s.write(list(range(n)), list(range(n)), KEYS[:n])
assert t.wait(), t.error
assert t.statuses == [PageStatus.OK] * n, t.statuses
again = s.write(list(range(n)), list(range(n)), KEYS[:n])
assert again.wait() and again.statuses == [PageStatus.EXISTS] * n, again.statuses
s.close()
print("PUT OK")
"""

GET = r"""
import json, sys, torch
from hicache.backends.pools import HostPool
from hicache.backends.stores import PageStatus, open_storage
from tests.backends.store_helpers import G, KEYS, page_bytes

extra, n = json.loads(sys.argv[1]), int(sys.argv[2])
host = HostPool(G, n)
host.bytes.zero_()
s = open_storage("mooncake", G, host, slots=64, extra=extra, chunk_pages=5)
assert s.exists(KEYS[: n + 3]) == n, s.exists(KEYS[: n + 3])
dst = list(reversed(range(n)))
t = s.read(list(range(n)), dst, KEYS[:n])
assert t.wait(), t.error
for i, p in enumerate(dst):
    assert torch.equal(host.bytes[p], page_bytes(i)), f"page {i} differs"
gone = s.read([0, 1], [0, 1], [KEYS[0], KEYS[n + 5]])
assert gone.wait() is False and gone.lost, gone.error
assert gone.statuses == [PageStatus.OK, PageStatus.MISSING], gone.statuses
s.close()
print("GET OK")
"""

DOWN = r"""
import json, sys
from hicache.backends.pools import HostPool
from hicache.backends.stores import open_storage
from tests.backends.store_helpers import G, KEYS

for extra in json.loads(sys.argv[1]):
    s = open_storage("mooncake", G, HostPool(G, 2), slots=8, extra=extra)
    assert not s.available and s.status()["error"], s.status()
    t = s.write([0], [0], KEYS[:1])
    assert t.ok is False and "unavailable" in (t.error or ""), t.error
    assert s.exists(KEYS[:1]) == 0
    s.close()
    print("DOWN OK", s.status()["error"], flush=True)
"""


def test_what_one_process_puts_another_reads_bit_exactly(mooncake_cluster: MooncakeCluster) -> None:
    """Process A stores pages (and a second put finds them all stored); process B, started
    after A exited, finds exactly those keys, reads them bit-exactly into other pages, and
    a key nobody wrote fails its read with ``lost``."""
    extra = json.dumps(mooncake_cluster.extra())
    out = mooncake_cluster.run([sys.executable, "-c", PUT, extra, str(N)], "put")
    assert "PUT OK" in out
    out = mooncake_cluster.run([sys.executable, "-c", GET, extra, str(N)], "get")
    assert "GET OK" in out


def test_an_unreachable_or_silent_master_degrades_to_no_l3(mooncake_cluster: MooncakeCluster) -> None:
    """Nothing listening at the master's address, or a port that accepts but never answers
    as a master: the store is unavailable (with the reason), requests fail at once and
    ``exists`` answers 0 — no exception, bounded by ``connect_timeout_s``."""
    extras = [
        mooncake_cluster.extra(master_server_address="127.0.0.1:1"),
        mooncake_cluster.extra(master_server_address="127.0.0.1:8080", connect_timeout_s=2),  # the metadata server
    ]
    out = mooncake_cluster.run([sys.executable, "-c", DOWN, json.dumps(extras)], "down")
    assert out.count("DOWN OK") == 2
