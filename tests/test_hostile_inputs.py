"""Bad inputs a user can hand the public API (facade, engine) and what they must get back: a
typed error raised before anything changed, never an untyped exception or silent acceptance."""

from __future__ import annotations

import contextlib
import re
import signal
from pathlib import Path
from typing import Any

import pytest
import torch

from hicache import HiCache, HiCacheConfig
from hicache.core import interrupts
from hicache.core.geometry import KVGeometry
from hicache.engine import Engine, EngineConfig
from hicache.errors import ConfigError, MisuseError

G = KVGeometry(2, 1, 4, 4, torch.float32)


def _serve(cache: HiCache, prompt: list[int]) -> None:
    req = cache.admit(prompt)
    pages = cache.allocate(req, -(-len(prompt) // G.page_size) - req.cached_len // G.page_size)
    assert pages is not None
    cache.insert(req, pages[: len(prompt) // G.page_size - req.cached_len // G.page_size])
    cache.release(req)
    cache.drain()


def test_admit_refused_by_a_keyed_store_leaves_nothing_pinned(tmp_path: Path) -> None:
    """Tokens a content-keyed store cannot name (outside int64) are refused at admit after
    the L1 hit was matched: the pin taken on that hit is given back, the cache stays whole."""
    cfg = HiCacheConfig(
        G, l1_pages=8, l2_pages=16, l3_pages=32, device="cpu", policy="always", transfer_backend="torch",
        storage_backend="dir", storage_path=str(tmp_path / "l3"), model_id="m",
    )  # fmt: skip
    with HiCache(cfg) as cache:
        _serve(cache, [1, 2, 3, 4])
        before = cache.status()
        with pytest.raises(MisuseError, match="int64"):
            cache.admit([1, 2, 3, 4] + [10**30] * 8)
        after = cache.status()
        l1_before, l1_after = before.core.tiers[0], after.core.tiers[0]
        assert l1_after.protected == l1_before.protected == 0
        assert after.core.leases == before.core.leases == 0
        cache.check_integrity()


@pytest.mark.parametrize("policy", [["always"], {}, ("always",)])
def test_an_unhashable_policy_is_a_config_error(policy: object) -> None:
    """A policy that is not one of the names, even an unhashable one, is a ConfigError."""
    with pytest.raises(ConfigError, match="policy"):
        HiCacheConfig(G, l1_pages=8, l2_pages=8, device="cpu", policy=policy)  # type: ignore[arg-type]


@pytest.mark.parametrize("backend", [["dir"], {}])
def test_an_unhashable_storage_backend_is_a_config_error(backend: object) -> None:
    """A storage backend that is not one of the names, even an unhashable one: ConfigError."""
    with pytest.raises(ConfigError, match="storage_backend"):
        HiCacheConfig(G, l1_pages=8, l2_pages=8, device="cpu", storage_backend=backend)  # type: ignore[arg-type]


@pytest.mark.parametrize("workers", [0, 257, 10**9])
def test_storage_workers_out_of_range_is_a_config_error(workers: int) -> None:
    """Storage worker threads are bounded: 0 or an absurd count is a ConfigError at once."""
    with pytest.raises(ConfigError, match="storage_workers"):
        HiCacheConfig(G, l1_pages=8, l2_pages=8, device="cpu", storage_workers=workers)


def test_a_store_factory_that_does_not_return_a_page_store_is_a_config_error() -> None:
    """``HiCache(config, store=...)``: a factory returning something else, or raising, is a
    ConfigError that names what is wrong."""
    cfg = HiCacheConfig(G, l1_pages=8, l2_pages=8, l3_pages=8, device="cpu", transfer_backend="torch")
    with pytest.raises(ConfigError, match=r"must return a PageStore; int lacks kind, keyed"):
        HiCache(cfg, store=lambda l2: 3)  # type: ignore[arg-type,return-value]

    def broken(l2: object) -> object:
        raise OSError("no such device")

    with pytest.raises(ConfigError, match="no such device"):
        HiCache(cfg, store=broken)  # type: ignore[arg-type]


def test_a_closed_cache_cannot_be_entered_again() -> None:
    """``with cache:`` after close raises instead of handing back a cache that refuses
    every call; entering an open one twice still works."""
    cache = HiCache(HiCacheConfig(G, l1_pages=4, l2_pages=8, device="cpu"))
    with cache as entered:
        assert entered is cache
    assert cache.closed
    with pytest.raises(MisuseError, match=r"^this HiCache is closed$"), cache:
        pass


@pytest.mark.parametrize("pages", [0, -3, "x", True, 2.0, None])
def test_a_bad_num_pages_is_refused_by_its_own_name(pages: object) -> None:
    """The engine's keyword is ``num_pages``: its refusal names that, not the cache's
    ``l1_pages`` it becomes."""
    with pytest.raises(ConfigError, match=r"num_pages \(L1 pages\) must be an int >= 1"):
        Engine("tiny", num_pages=pages)


@pytest.mark.parametrize("config", [None, 123, b"tiny"])
def test_an_engine_config_of_the_wrong_type_says_so(config: object) -> None:
    """Not a model name nor an EngineConfig: the refusal says that, whatever keywords came
    with it (it named the keywords before)."""
    with pytest.raises(ConfigError, match="config must be an EngineConfig or a model name"):
        Engine(config, device="cpu")  # type: ignore[arg-type]


def test_an_unknown_policy_is_refused_even_without_hicache() -> None:
    """A policy that does not exist is a typo whether or not hicache is on."""
    with pytest.raises(ConfigError, match="policy must be one of"):
        Engine("tiny", policy="fast")


def test_a_closed_engine_refuses_status_by_its_own_name() -> None:
    e = Engine("tiny", num_pages=16)
    e.close()
    with pytest.raises(MisuseError, match="this Engine is closed"):
        e.status()


def test_a_pool_past_what_torch_can_size_is_a_config_error() -> None:
    """A pool that does not fit in int64: a ConfigError naming the pool and its
    size in one line (torch's TypeError/RuntimeError, first line only), not a traceback."""
    with pytest.raises(ConfigError, match="page_size must be at most 65,536 tokens"):  # the geometry's own
        KVGeometry(num_layers=1, num_kv_heads=1, head_dim=1, page_size=2**62, dtype=torch.float32)
    g = KVGeometry(num_layers=1, num_kv_heads=1, head_dim=1, page_size=4, dtype=torch.float32)
    pool = r"cannot allocate the L1 pool: l1_pages 4611686018427387904 x page_size 4"
    with pytest.raises(ConfigError, match=pool) as info:
        HiCache(HiCacheConfig(g, l1_pages=2**62, l2_pages=0, device="cpu"))
    assert "\n" not in str(info.value)


def test_an_l3_directory_that_cannot_be_made_is_a_config_error() -> None:
    """A dir store under /proc (mkdir fails with ENOENT): a ConfigError naming the path."""
    g = KVGeometry(num_layers=1, num_kv_heads=1, head_dim=4, page_size=4, dtype=torch.float32)
    config = HiCacheConfig(g, l1_pages=4, l2_pages=4, l3_pages=4, storage_backend="dir",
                           storage_path="/proc/hicache-no-such-dir", model_id="m", device="cpu")  # fmt: skip
    with pytest.raises(ConfigError, match="L3 directory /proc/hicache-no-such-dir: "):
        HiCache(config)


@pytest.mark.parametrize("path", ["/proc/version", "/proc/hicache-l3"])
def test_an_l3_file_on_a_file_system_that_stores_nothing_says_so(path: str) -> None:
    """/proc holds no data: the refusal says so, not "only 0 bytes free" (which sent the
    user looking for disk space)."""
    g = KVGeometry(num_layers=1, num_kv_heads=1, head_dim=4, page_size=4, dtype=torch.float32)
    config = HiCacheConfig(g, l1_pages=4, l2_pages=4, l3_pages=4, storage_path=path, device="cpu")
    with pytest.raises(ConfigError, match=rf"^L3 path {path}: on a file system that stores no data \(such as /proc\)"):
        HiCache(config)


def test_engine_takes_its_model_by_keyword_once() -> None:
    e = Engine(model="tiny", device="cpu", num_pages=16)
    assert e.config.model == "tiny"
    e.close()
    with pytest.raises(ConfigError, match="the model is given twice"):
        Engine("tiny", model="tiny", device="cpu")
    with pytest.raises(ConfigError, match="config must be an EngineConfig or a model name, got int"):
        Engine(model=5, device="cpu")
    with pytest.raises(ConfigError, match=r"model must be a preset name or a checkpoint directory \(a str\), got 5"):
        EngineConfig.create(5)  # type: ignore[arg-type]


def test_a_storage_path_with_a_nul_is_a_config_error() -> None:
    g = KVGeometry(num_layers=1, num_kv_heads=1, head_dim=4, page_size=4, dtype=torch.float32)
    with pytest.raises(ConfigError, match="storage_path must not contain a NUL"):
        HiCacheConfig(g, l1_pages=4, l2_pages=4, l3_pages=4, storage_path="/tmp/a\x00b", device="cpu")


def test_a_prompt_of_bools_is_the_prompt_of_their_ints() -> None:
    """Bools count as the ints 0 and 1 (as in the core): a prompt of bools alone is served,
    with the tokens of the same prompt as ints."""
    e = Engine("tiny", device="cpu", num_pages=16, page_size=4)
    bools = e.generate([True, False, True, True, False], max_new_tokens=3)
    ints = Engine("tiny", device="cpu", num_pages=16, page_size=4).generate([1, 0, 1, 1, 0], max_new_tokens=3)
    assert bools.error is None and bools.tokens == ints.tokens


def test_an_engine_refused_while_built_leaves_its_store_unlocked(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A setting the model runner refuses (paged attention on a CPU) is refused before the
    cache makes its store; refused after it (the check bypassed), the cache is closed again,
    so the next engine opens the same dir store."""
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    kw = dict(device="cpu", num_pages=16, enable_hicache=True, l2_pages=16, l3_pages=32,
              storage_backend="dir", storage_path=str(tmp_path / "kv"))  # fmt: skip
    with pytest.raises(ConfigError, match="needs a CUDA device"):
        Engine("tiny", attention="paged", **kw)  # type: ignore[arg-type]
    assert not (tmp_path / "kv").exists()  # refused before the store was made

    def refuse(*args: object, **kwargs: object) -> None:
        raise ConfigError("refused by the model runner")

    monkeypatch.setattr("hicache.engine.engine.ModelRunner.__init__", refuse)  # refused after the store was made
    with pytest.raises(ConfigError, match="refused by the model runner"):
        Engine("tiny", **kw)  # type: ignore[arg-type]
    monkeypatch.undo()
    e = Engine("tiny", **kw)  # type: ignore[arg-type]
    assert e.generate(list(range(20)), max_new_tokens=1).error is None
    e.close()


@pytest.mark.parametrize(
    ("args", "kwargs", "says"),
    [
        (("boom",), {}, "unknown fault kind 'boom'"),
        (("eio", 0), {}, "count must be an int >= 1, got 0"),
        (("eio", True), {}, "count must be an int >= 1, got True"),
        (("eio", 1.5), {}, "count must be an int >= 1, got 1.5"),
        (("eio",), {"op": "both"}, "op must be 'read', 'write' or 'any', got 'both'"),
        (("slow",), {"delay_s": -1.0}, "delay_s must be a finite number of seconds >= 0, got -1.0"),
        (("slow",), {"delay_s": float("nan")}, "delay_s must be a finite number of seconds >= 0, got nan"),
    ],
)
def test_a_bad_fault_is_refused_and_queues_nothing(
    args: tuple[object, ...], kwargs: dict[str, object], says: str
) -> None:
    from hicache.backends.faults import FaultInjector

    faults = FaultInjector()
    with pytest.raises(MisuseError, match=re.escape(says)):
        faults.add(*args, **kwargs)  # type: ignore[arg-type]
    assert faults.take("read") is None and faults.take("write") is None


def _odd_store(answer: object, *, remote: bool = False, available: bool = True, status: object = None) -> type:
    """A MemoryStore whose ``exists`` answers ``answer`` (a store's bug), ``available``
    raising unless ``available``, and ``status()`` returning ``status`` when given."""
    from hicache.testing.memory_store import MemoryStore

    class Odd(MemoryStore):
        def exists(self, keys: object) -> int:
            return answer  # type: ignore[return-value]

        @property
        def available(self) -> bool:
            if not available:
                raise RuntimeError("available exploded")
            return True

        def status(self) -> dict[str, object]:
            return status if status is not None else super().status()  # type: ignore[return-value]

    Odd.remote = remote
    return Odd


@pytest.mark.parametrize("remote", [False, True], ids=["local", "remote"])
@pytest.mark.parametrize("answer", [None, "2", 2.0, -1, 10**6, True, [1]], ids=repr)
def test_a_store_whose_exists_answers_nonsense_finds_nothing(answer: object, remote: bool) -> None:
    """``exists`` returning something other than how many leading keys it holds is that
    call's failure (counted, logged): admission finds nothing in L3 and goes on."""
    cfg = HiCacheConfig(G, l1_pages=8, l2_pages=8, l3_pages=16, model_id="m", device="cpu", transfer_backend="torch")
    with HiCache(cfg, store=_odd_store(answer, remote=remote)) as cache:
        req = cache.admit(list(range(8)))
        assert req.hit == (0, 0, 0)
        cache.release(req)
        assert cache.status().storage["exists_failed"] >= 1  # type: ignore[index]
        cache.check_integrity()


def test_a_store_whose_available_raises_is_unavailable_not_a_crash() -> None:
    """A store's ``available`` that raises once the cache is open counts as unavailable:
    admission finds nothing, writes fail (the request goes on), status says so."""
    cfg = HiCacheConfig(G, l1_pages=8, l2_pages=8, l3_pages=16, model_id="m", device="cpu", transfer_backend="torch")
    flaky = {"ok": True}
    base = _odd_store(0, status={"error": "down"})

    class Flaky(base):  # type: ignore[misc,valid-type]
        @property
        def available(self) -> bool:
            if not flaky["ok"]:
                raise RuntimeError("available exploded")
            return True

    with HiCache(cfg, store=Flaky) as cache:
        flaky["ok"] = False
        _serve(cache, list(range(8)))  # its backup to L3 fails: the store is unavailable
        req = cache.admit(list(range(8)))
        assert req.hit[2] == 0
        cache.release(req)
        st = cache.status().storage
        assert st is not None and st["available"] is False and st["available_raised"] >= 1 and st["error"] == "down"
        cache.check_integrity()


def test_a_store_whose_members_raise_when_read_is_a_config_error_and_is_closed() -> None:
    """``available`` raising already while the cache checks the store's members: a
    ConfigError naming it, and the store is closed (it kept its resources)."""
    cfg = HiCacheConfig(G, l1_pages=8, l2_pages=8, l3_pages=16, model_id="m", device="cpu", transfer_backend="torch")
    closed: list[object] = []
    base = _odd_store(0, available=False)

    class Closing(base):  # type: ignore[misc,valid-type]
        def close(self) -> None:
            closed.append(self)

    with pytest.raises(ConfigError, match=r"store\(l2\) returned a Closing whose members raised RuntimeError"):
        HiCache(cfg, store=Closing)
    assert len(closed) == 1


@pytest.mark.skipif(not hasattr(signal, "SIGALRM"), reason="no SIGALRM here")
@pytest.mark.parametrize("others", [0, 1], ids=["the-only-cache", "another-open"])
@pytest.mark.parametrize("factory", ["mover", "store"])
def test_a_timeout_while_a_factory_runs_reaches_the_caller_not_a_config_error(factory: str, others: int) -> None:
    """A timeout's SIGALRM handler raising while the cache calls the embedder's ``mover`` or
    ``store`` factory is the caller's timeout, not a ConfigError saying the factory raised:
    whether or not another cache is open (its signals held already). Afterwards the handler
    is the caller's again, and a cache builds and serves as before."""
    from hicache.backends.transfer import TransferEngine

    class Timeout(Exception):
        pass

    def timeout(signum: int, frame: object) -> None:
        raise Timeout

    cfg = HiCacheConfig(G, l1_pages=8, l2_pages=8, l3_pages=16, model_id="m", device="cpu", transfer_backend="torch")
    before = signal.signal(signal.SIGALRM, timeout)
    try:
        with contextlib.ExitStack() as open_ones:
            for _ in range(others):
                open_ones.enter_context(HiCache(HiCacheConfig(G, l1_pages=8, device="cpu", transfer_backend="torch")))

            def signalled(arg: object) -> Any:
                signal.raise_signal(signal.SIGALRM)
                raise AssertionError("the handler's exception comes first")

            with pytest.raises(Timeout):
                if factory == "mover":
                    HiCache(cfg, mover=signalled)
                else:
                    HiCache(cfg, store=signalled)
            if not others:
                # NOTE: nothing left in its place, unless a cache another test left open holds it
                assert signal.getsignal(signal.SIGALRM) is timeout or interrupts._Held.users
            with HiCache(cfg, mover=lambda c: TransferEngine(c.l1, c.l2, "torch")) as fine:
                _serve(fine, list(range(20)))
    finally:
        signal.signal(signal.SIGALRM, before)


def test_sizes_that_are_numpy_integers_are_taken_by_the_config_and_the_engine() -> None:
    """A config's page counts, workers and hits computed with numpy are taken (held as
    ints), as ``allocate`` and ``at_most`` take them; the cache serves exactly as with ints."""
    import numpy as np

    from hicache.engine import Engine

    sizes: dict[str, Any] = dict(l1_pages=np.int64(8), l2_pages=np.int32(8), storage_workers=np.int64(2))
    sizes["selective_hits"] = np.uint8(3)
    cfg = HiCacheConfig(G, device="cpu", transfer_backend="torch", **sizes)
    assert [type(getattr(cfg, f)) for f in ("l1_pages", "l2_pages", "storage_workers", "selective_hits")] == [int] * 4
    with HiCache(cfg) as cache:
        _serve(cache, list(range(20)))
        req = cache.admit(list(range(20)))
        assert req.hit[0] == 20  # every page of the prompt, found in L1
        cache.release(req)
    with Engine("tiny", device="cpu", num_pages=np.int64(24)) as engine:
        assert (
            engine.generate([1, 2, 3], max_new_tokens=2).tokens
            == Engine("tiny", device="cpu").generate([1, 2, 3], max_new_tokens=2).tokens
        )


@pytest.mark.parametrize("backend", ["file", "dir"])
def test_an_empty_storage_path_is_refused_offering_an_unnamed_file_only_where_there_is_one(backend: str) -> None:
    """``storage_path=""``: refused; the file store may be given None (an unnamed file), the
    dir store has no such thing, so its refusal offers none."""
    with pytest.raises(ConfigError) as info:
        HiCacheConfig(G, l1_pages=8, l2_pages=8, l3_pages=8, device="cpu", storage_backend=backend,
                      storage_path="", model_id="m")  # fmt: skip
    assert str(info.value).startswith("storage_path must not be empty")
    assert ("unnamed file" in str(info.value)) == (backend == "file")
