"""``HiCache(..., mover=...)``: an embedder's own L1 <-> L2 mover is the one the cache copies
with (backups and restores, bit-exact), and a factory that is not one is a ConfigError
naming why, with nothing left open."""

from __future__ import annotations

import threading
from pathlib import Path
from typing import Any

import pytest
import torch

from hicache import HiCache, HiCacheConfig
from hicache.core.geometry import KVGeometry
from hicache.errors import ConfigError
from hicache.spec.model import Tier
from tests.threads import settle

G = KVGeometry(2, 1, 4, 2, torch.float32)


def config(**kw: object) -> HiCacheConfig:
    args: dict[str, object] = dict(geometry=G, l1_pages=4, l2_pages=8, device="cpu", policy="always")
    args.update(kw)
    return HiCacheConfig(**args)  # type: ignore[arg-type]


class Counting:
    """Our mover, counting the copies the cache asks of it."""

    def __init__(self, cache: HiCache) -> None:
        self.inner, self.calls = cache.device, {"d2h": 0, "h2d": 0}
        assert cache.l1 is not None and cache.l2 is not None and cache.config is not None

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)

    def d2h(self, src: list[int], dst: list[int]) -> Any:
        self.calls["d2h"] += 1
        return self.inner.d2h(src, dst)

    def h2d(self, src: list[int], dst: list[int], layer_events: Any = None) -> Any:
        self.calls["h2d"] += 1
        return self.inner.h2d(src, dst, layer_events=layer_events)


def test_the_cache_copies_with_the_mover_it_is_given() -> None:
    made: list[Counting] = []

    def mover(cache: HiCache) -> Counting:
        made.append(Counting(cache))
        return made[-1]

    with HiCache(config(), mover=mover) as c:  # type: ignore[arg-type]
        tokens = list(range(4))
        req = c.admit(tokens)
        pages = c.allocate(req, 2)
        assert pages is not None
        c.l1.buffer[:, :, pages] = torch.randn(c.l1.buffer[:, :, pages].shape)
        kv = c.l1.buffer[:, :, pages].clone()
        c.insert(req, pages)
        c.release(req)
        c.drain()
        assert made[0].calls == {"d2h": 1, "h2d": 0}
        c.core.evict(Tier.L1, 10**6)
        req = c.admit(tokens)
        assert c.restore(req)
        assert made[0].calls == {"d2h": 1, "h2d": 1}
        assert torch.equal(c.l1.buffer[:, :, c.prefix_pages(req)], kv)
        c.release(req)


class _Half:
    def __init__(self, cache: HiCache) -> None:
        self.d2h = self.h2d = cache.device.d2h


class _Uncallable:
    """Every member, but ``status`` and ``h2d`` are not methods."""

    def __init__(self, cache: HiCache) -> None:
        self.layered, self.layer_groups, self.d2h = False, cache.device.layer_groups, cache.device.d2h
        self.h2d, self.status = 0, None


@pytest.mark.parametrize(
    ("mover", "error"),
    [
        ("not callable", r"^mover must be a callable that takes the cache and returns a DeviceMover$"),
        (lambda cache: 1 / 0, r"^mover\(cache\) raised ZeroDivisionError\('division by zero'\)$"),
        (_Half, r"^mover\(cache\) must return a DeviceMover; _Half lacks layered, layer_groups, status$"),
        (
            _Uncallable,
            r"^mover\(cache\) must return a DeviceMover; "
            r"_Uncallable lacks h2d \(not callable\), status \(not callable\)$",
        ),
    ],
    ids=["not callable", "raises", "lacks members", "members not callable"],
)
def test_a_mover_factory_that_is_not_one_is_a_config_error_leaving_nothing_open(
    mover: object, error: str, tmp_path: Path
) -> None:
    path = tmp_path / "l3"
    cfg = config(l3_pages=8, storage_backend="dir", storage_path=str(path), model_id="m")
    settle()
    threads = threading.active_count()
    with pytest.raises(ConfigError, match=error):
        HiCache(cfg, mover=mover)  # type: ignore[arg-type]
    assert threading.active_count() == threads
    with HiCache(cfg) as c:  # the directory is not held
        assert c.storage is not None and c.storage.available
