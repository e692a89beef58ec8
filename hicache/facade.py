"""``HiCache``: the one object an engine embeds. The only module that knows both the core
and the concrete backends; it validates a :class:`HiCacheConfig`, builds the pools, movers
and a :class:`~hicache.core.controller.Controller`, and forwards the engine's calls to it."""

from __future__ import annotations

import contextlib
import functools
import os
import re
import sys
import threading
import warnings
import weakref
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Concatenate, ParamSpec, TypeVar

import torch

from hicache.backends.faults import FaultInjector
from hicache.backends.guard import Identity, PageGuard
from hicache.backends.pools import DevicePool, HostPool, validate_l1
from hicache.backends.stores import STORE_KINDS, PageStore, StoreMover, at_exit, open_storage
from hicache.backends.transfer import TransferBackend, TransferEngine
from hicache.backends.verify import DigestVerifier
from hicache.core.cache import CacheCore
from hicache.core.controller import (
    Controller,
    PendingRestore,
    Request,
    WritePolicy,
    check_selective_hits,
    parse_write_policy,
)
from hicache.core.cost import CostModel, CostPriors, Plan, Policy
from hicache.core.geometry import DevicePage, KVGeometry, TierSizes, plain_ints
from hicache.core.interrupts import by_signal, held, hold_signals, release_signals
from hicache.core.keys import encodable, format_seed
from hicache.core.metrics import Metrics
from hicache.core.protocols import DeviceMover
from hicache.core.status import ControllerStatus
from hicache.errors import ConfigError, HiCacheError, MisuseError
from hicache.spec.model import Tier

P = ParamSpec("P")
R = TypeVar("R")

# Storage I/O threads: each is a blocking reader or writer; more than this only adds threads
# (a typo such as 10**9 would otherwise try to start them all).
MAX_STORAGE_WORKERS = 256
# Longer deadlines are forever in practice, and past threading.TIMEOUT_MAX (~9.2e9 s) a
# wait on one raised OverflowError in drain().
MAX_DEADLINE_S = 1e9


MOVER_MEMBERS = ("layered", "layer_groups", "d2h", "h2d", "status")  # what the controller calls
_STORE_MEMBERS = ("kind", "keyed", "shared", "remote", "plan", "put", "get", "exists", "available", "close", "status")
# of those, the ones called (the others are read)
_METHODS = frozenset({"layer_groups", "d2h", "h2d", "status", "plan", "put", "get", "exists", "close"})


def _built(factory: Callable[[Any], Any], arg: object, call: str, kind: str, members: Sequence[str]) -> Any:
    """``factory(arg)``, checked to have ``members`` (what the cache calls on a ``kind``),
    or ConfigError naming the ``call``: one that raised, or what its result lacks."""
    try:
        made = factory(arg)
    except HiCacheError:
        raise
    except Exception as exc:
        if by_signal(exc):
            raise  # NOTE: a signal handler's (a timeout's) while it ran: the caller's, not the factory's
        raise ConfigError(f"{call} raised {exc!r}") from exc
    try:
        missing = [m for m in members if not hasattr(made, m)]
        if not missing:
            missing = [f"{m} (not callable)" for m in members if m in _METHODS and not callable(getattr(made, m))]
    except Exception as exc:  # NOTE: a property of its that raises (hasattr lets all but AttributeError by)
        _close_quietly(made)
        if by_signal(exc):
            raise
        raise ConfigError(f"{call} returned a {type(made).__name__} whose members raised {exc!r}") from exc
    if missing:
        _close_quietly(made)
        raise ConfigError(f"{call} must return a {kind}; {type(made).__name__} lacks {', '.join(missing)}")
    return made


def _custom_store(store: Callable[[HostPool], PageStore], l2: HostPool) -> PageStore:
    """``store(l2)``, checked to be a :class:`PageStore` (its members present), or ConfigError."""
    return _built(store, l2, "store(l2)", "PageStore", _STORE_MEMBERS)  # type: ignore[no-any-return]


def _custom_mover(mover: Callable[[HiCache], DeviceMover], cache: HiCache) -> DeviceMover:
    """``mover(cache)``, checked to be a :class:`DeviceMover` (its members present), or ConfigError."""
    return _built(mover, cache, "mover(cache)", "DeviceMover", MOVER_MEMBERS)  # type: ignore[no-any-return]


def _default_device() -> str:
    return "cuda" if torch.cuda.is_available() else "cpu"


@dataclass(frozen=True)
class HiCacheConfig:
    """Everything an engine chooses; validated here, before anything is allocated or opened.
    L2/L3 of 0 pages disable that tier."""

    geometry: KVGeometry
    l1_pages: int
    l2_pages: int = 0
    l3_pages: int = 0
    storage_path: str | None = None  # file: None = an unnamed 0600 file that vanishes with us; dir: the directory
    storage_direct: bool = False
    storage_workers: int = 4
    storage_backend: str = "file"  # file (default), dir (persistent), mooncake (shared)
    storage_extra: Mapping[str, Any] | None = None  # dir: {"fsync": bool}; mooncake: SGLang's extra-config keys
    storage_deadline_s: float | None = 10.0  # an L3 read or write past this (+10 s/GiB) fails; None: no deadline
    model_id: str = ""  # the model's identity (name or checkpoint hash): seeds the page keys of dir/mooncake
    shard: str = ""  # this rank's slice of the KV heads ("tp0/2"), when ranks of one model share a keyed store
    checksums: bool = True  # file store: an xxh3 per L3 page, checked on read (the dir store always checks)
    transfer_backend: TransferBackend = "auto"
    policy: Policy | str = Policy.COST
    write_policy: WritePolicy | str = WritePolicy.WRITE_THROUGH
    selective_hits: int = 2
    priors: CostPriors = field(default_factory=CostPriors)
    device: str = field(default_factory=_default_device)
    tracing: bool = False  # check every state change against the spec (tests)
    verify_pages: bool = False  # digest every moved page and check it on arrival (slow; soak/bench)
    guard_pages: bool = False  # catch an engine writing L1 pages it does not own (tests, small pools)

    def __post_init__(self) -> None:
        plain_ints(self, ("l1_pages", "l2_pages", "l3_pages", "storage_workers", "selective_hits"))
        if not isinstance(self.geometry, KVGeometry):
            raise ConfigError(f"geometry must be a KVGeometry, got {self.geometry!r}")
        TierSizes(self.l1_pages, self.l2_pages, self.l3_pages)  # validates the sizes
        if self.l3_pages and not self.l2_pages:
            raise ConfigError("L3 needs L2 (pages reach the file through host memory): set l2_pages")
        if not isinstance(self.policy, str) or self.policy not in {k.value for k in Policy}:
            raise ConfigError(f"policy must be one of {[k.value for k in Policy]}, got {self.policy!r}")
        parse_write_policy(self.write_policy)
        check_selective_hits(self.selective_hits)
        if self.transfer_backend not in ("auto", "triton", "torch"):
            raise ConfigError(f"transfer_backend must be auto, triton or torch, got {self.transfer_backend!r}")
        if isinstance(self.storage_workers, bool) or not isinstance(self.storage_workers, int):
            raise ConfigError(f"storage_workers must be an int >= 1, got {self.storage_workers!r}")
        if not 1 <= self.storage_workers <= MAX_STORAGE_WORKERS:
            raise ConfigError(
                f"storage_workers must be an int in [1, {MAX_STORAGE_WORKERS}], got {self.storage_workers!r}"
            )
        if self.storage_path is not None and not isinstance(self.storage_path, (str, os.PathLike)):
            raise ConfigError(f"storage_path must be a path or None, got {self.storage_path!r}")
        if self.storage_path is not None and not os.fspath(self.storage_path):
            unnamed = " (None: an unnamed file)" if self.storage_backend == "file" else ""
            raise ConfigError(f"storage_path must not be empty{unnamed}")
        if self.storage_path is not None and "\x00" in os.fspath(self.storage_path):
            raise ConfigError(f"storage_path must not contain a NUL character, got {self.storage_path!r}")
        if not isinstance(self.storage_backend, str) or self.storage_backend not in STORE_KINDS:
            raise ConfigError(f"storage_backend must be one of {list(STORE_KINDS)}, got {self.storage_backend!r}")
        if self.storage_extra is not None and not isinstance(self.storage_extra, Mapping):
            raise ConfigError(f"storage_extra must be a mapping or None, got {self.storage_extra!r}")
        deadline = self.storage_deadline_s
        if deadline is not None and (
            isinstance(deadline, bool) or not isinstance(deadline, (int, float)) or not 0 < deadline <= MAX_DEADLINE_S
        ):
            raise ConfigError(
                f"storage_deadline_s must be a positive number of seconds up to {MAX_DEADLINE_S:.0f} or None, "
                f"got {deadline!r:.60}"
            )
        if not isinstance(self.model_id, str):
            raise ConfigError(f"model_id must be a str, got {self.model_id!r}")
        if not encodable(self.model_id):  # NOTE: here, before anything is allocated: its bytes seed the keys
            raise ConfigError(f"model_id must be text that encodes to bytes, got {self.model_id!r:.80}")
        if not isinstance(self.shard, str) or not encodable(self.shard):
            raise ConfigError(f'shard must be a str of text ("tp0/2"), got {self.shard!r:.80}')
        if self.shard and not self.model_id:
            raise ConfigError("shard names a slice of a model's pages: set model_id too")
        if self.l3_pages and self.storage_backend != "file" and not self.model_id:
            raise ConfigError(
                f"storage_backend {self.storage_backend!r} names pages by content: set model_id (the model's "
                "name or checkpoint hash), so another model's pages never match"
            )
        for name in ("storage_direct", "checksums", "tracing", "verify_pages", "guard_pages"):
            if not isinstance(getattr(self, name), bool):
                raise ConfigError(f"{name} must be a bool, got {getattr(self, name)!r}")
        if not isinstance(self.priors, CostPriors):
            raise ConfigError(f"priors must be a CostPriors, got {self.priors!r}")
        try:
            dev = torch.device(self.device)
        except (RuntimeError, TypeError, ValueError, OverflowError):
            raise ConfigError(f"device must be a torch device such as 'cpu' or 'cuda', got {self.device!r}") from None
        if dev.type == "cuda" and not torch.cuda.is_available():
            raise ConfigError(f"device {self.device!r}: this torch build has no usable CUDA device")
        if dev.type not in ("cpu", "cuda"):
            raise ConfigError(f"device must be cpu or cuda, got {self.device!r}")
        if dev.type == "cpu" and dev.index not in (None, 0):
            raise ConfigError(f"device {self.device!r}: the host is one device, 'cpu' (or 'cpu:0')")
        if dev.type == "cuda" and dev.index is not None and dev.index >= torch.cuda.device_count():
            raise ConfigError(
                f"device {self.device!r}: this machine has {torch.cuda.device_count()} CUDA device(s), indexed from 0"
            )
        host = _host_memory()
        if host is not None and self.l2_pages * self.geometry.bytes_per_page > host:
            raise ConfigError(
                f"l2_pages={self.l2_pages} needs {self.l2_pages * self.geometry.bytes_per_page / 2**30:.1f} GiB "
                f"of host memory; this machine has {host / 2**30:.1f} GiB"
            )


def _check_memory_for_l1(config: HiCacheConfig) -> None:
    """An L1 pool larger than the device's whole memory is refused in these words, before
    the allocator's own (a C++ source line, or nothing for a size past a tensor's)."""
    dev = torch.device(config.device)
    if dev.type == "cpu":
        have, where = _host_memory(), "this machine's host memory"
    else:
        have, where = torch.cuda.get_device_properties(dev).total_memory, f"the memory of {config.device}"
    if have is not None and config.l1_pages * config.geometry.bytes_per_page > have:
        raise MemoryError(f"more than {where} ({have / 2**30:.1f} GiB)")


def _check_memory_for_l2(config: HiCacheConfig) -> None:
    """L2 lives in host memory, beside L1 when L1 is on the CPU too: pools that together
    outgrow the machine are refused here (each alone could pass, and zeroed pages never
    touched would let the run start and be killed later)."""
    have = _host_memory()
    l2 = config.l2_pages * config.geometry.bytes_per_page
    l1 = config.l1_pages * config.geometry.bytes_per_page if torch.device(config.device).type == "cpu" else 0
    if have is not None and l2 and l1 <= have < l1 + l2:  # NOTE: an L1 too large alone is L1's to refuse
        beside = f" beside the L1 pool's {l1 / 2**30:.4g} GiB" if l1 else ""
        raise MemoryError(f"more than this machine's host memory ({have / 2**30:.1f} GiB){beside}")


def _l2_refused(config: HiCacheConfig, exc: BaseException) -> ConfigError:
    g = config.geometry
    return ConfigError(
        f"cannot allocate the L2 pool: l2_pages {config.l2_pages} x page_size {g.page_size} tokens = "
        f"{config.l2_pages * g.bytes_per_page / 2**30:.4g} GiB: {_first_line(exc)}"
    )


# A container's memory limit (cgroup v2, then v1): the kernel kills a process past it as it
# would one past the machine's memory.
CGROUP_LIMITS = ("/sys/fs/cgroup/memory.max", "/sys/fs/cgroup/memory/memory.limit_in_bytes")


def _host_memory() -> int | None:
    """The memory this process may have, in bytes: the machine's physical memory, or its
    container's limit where that is lower; None where the system does not say (then the
    allocator alone judges a pool's size)."""
    try:
        size = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError):
        size = 0
    for path in CGROUP_LIMITS:
        try:
            text = Path(path).read_text().strip()
        except (OSError, UnicodeDecodeError):
            continue
        if text.isdigit() and int(text) > 0 and (size <= 0 or int(text) < size):
            size = int(text)  # NOTE: "max" (v2) or a huge number (v1) means no limit
        break
    return size if size > 0 else None


def _check_l1_buffer(config: HiCacheConfig, buffer: object) -> None:
    validate_l1(config.geometry, buffer)
    assert isinstance(buffer, torch.Tensor)  # validate_l1 refuses anything else
    if buffer.device.type != torch.device(config.device).type:
        raise ConfigError(f"L1 tensor is on {buffer.device}, config.device is {config.device!r}")
    if buffer.requires_grad:
        raise ConfigError("L1 tensor requires grad; hand hicache the KV pool itself (requires_grad=False)")
    if buffer.is_inference():
        # NOTE: torch refuses in-place writes to it outside inference mode: every restore into
        # it would fail (a fallback each) on the copy paths that write through torch
        raise ConfigError(
            "L1 tensor is an inference tensor (made under torch.inference_mode()), which cannot be written "
            "outside it; allocate the KV pool outside inference mode (torch.no_grad() is fine)"
        )
    if buffer.shape[2] != config.l1_pages:
        raise ConfigError(f"L1 tensor has {buffer.shape[2]} pages, config.l1_pages is {config.l1_pages}")


def _guarded(call: Callable[Concatenate[HiCache, P], R]) -> Callable[Concatenate[HiCache, P], R]:
    """A cache call the page guard watches: what the engine wrote before it, what it freed
    and published (``HiCacheConfig.guard_pages``; nothing without it)."""

    @functools.wraps(call)
    def watched(cache: HiCache, /, *args: P.args, **kwargs: P.kwargs) -> R:
        guard = cache._guard
        if guard is None or cache.closed:
            return call(cache, *args, **kwargs)
        guard.before(*cache._l1_owners())
        try:
            return call(cache, *args, **kwargs)
        finally:
            if not cache.closed:
                guard.after(*cache._l1_owners())

    return watched


class HiCache:
    """The engine-facing cache: L1 (the engine's tensor, or one we allocate), L2 in host
    memory (pinned where CUDA is), an L3 page store (a file, a directory, Mooncake Store or
    one of your own), and a :class:`Controller` over them. Every call is the controller's (see
    :mod:`hicache.core.controller` for the contract)."""

    def __init__(
        self,
        config: HiCacheConfig,
        l1_buffer: torch.Tensor | None = None,
        *,
        store: Callable[[HostPool], PageStore] | None = None,
        mover: Callable[[HiCache], DeviceMover] | None = None,
    ) -> None:
        """``store``: makes an L3 page store of your own (a :class:`PageStore`) over the L2
        pool, used in place of the configured ``storage_backend``; ``config.l3_pages`` is
        then its budget in the tree (a keyed store needs ``config.model_id``).

        ``mover``: makes the L1 <-> L2 mover the cache copies with (a :class:`DeviceMover`),
        given the cache while it is built: ``config``, ``l1``, ``l2`` and ``device`` (our
        :class:`TransferEngine`, to wrap or to ignore) are set, nothing else yet. The
        reference engine drives ``device`` itself, so a mover of your own is for your loop."""
        if not isinstance(config, HiCacheConfig):
            raise ConfigError(f"config must be a HiCacheConfig, got {type(config).__name__}")
        if store is not None and not callable(store):
            raise ConfigError("store must be a callable that takes the L2 pool and returns a PageStore")
        if mover is not None and not callable(mover):
            raise ConfigError("mover must be a callable that takes the cache and returns a DeviceMover")
        g = config.geometry
        if l1_buffer is not None:
            _check_l1_buffer(config, l1_buffer)
            _check_not_shared(l1_buffer)
        self.config = config
        self.faults = FaultInjector()
        try:  # NOTE: before L1 is allocated: a refusal here costs no allocation
            _check_memory_for_l2(config)
        except MemoryError as exc:
            raise _l2_refused(config, exc) from exc
        try:
            if l1_buffer is None:
                _check_memory_for_l1(config)
            self.l1 = (
                DevicePool(g, l1_buffer)
                if l1_buffer is not None
                else DevicePool.allocate(g, config.l1_pages, config.device)
            )
        except (RuntimeError, MemoryError, TypeError, ValueError, OverflowError) as exc:
            # NOTE: torch.OutOfMemoryError is a RuntimeError; a size past int64 is a TypeError
            raise ConfigError(
                f"cannot allocate the L1 pool: l1_pages {config.l1_pages} x page_size {g.page_size} tokens = "
                f"{config.l1_pages * g.bytes_per_page / 2**30:.4g} GiB: {_first_line(exc)}"
            ) from exc
        try:
            self.l2 = HostPool(g, max(1, config.l2_pages))
        except (RuntimeError, MemoryError, TypeError, ValueError, OverflowError) as exc:
            raise _l2_refused(config, exc) from exc
        # NOTE: the set-up's own calls that may block (prepare's autotune, the embedder's
        # factories) run with the held signals' forwarders in place, as a cache's calls do: a
        # timeout handler's exception raised there is known as one (interrupts.by_signal)
        self._holding = hold_signals()
        try:
            self.device = TransferEngine(self.l1, self.l2, config.transfer_backend, faults=self.faults)
            if config.l2_pages:
                self.device.prepare()  # one-time setup here, not in a live request's restore
            storage: StoreMover | None = None
            custom: PageStore | None = None
            try:  # NOTE: a refusal past opening the store closes it (its threads, files and lock)
                copier: DeviceMover = self.device if mover is None else _custom_mover(mover, self)
                if config.l3_pages and store is not None:
                    custom = _custom_store(store, self.l2)
                    if custom.keyed and not config.model_id:
                        raise ConfigError("a keyed store names pages by content: set config.model_id")
                    storage = StoreMover(
                        custom,
                        self.l2,
                        slots=config.l3_pages,
                        workers=config.storage_workers,
                        deadline_s=config.storage_deadline_s,
                        faults=self.faults,
                    )
                elif config.l3_pages:
                    storage = open_storage(
                        config.storage_backend,
                        g,
                        self.l2,
                        slots=config.l3_pages,
                        path=config.storage_path,
                        extra=config.storage_extra,
                        workers=config.storage_workers,
                        checksums=config.checksums,
                        direct=config.storage_direct,
                        faults=self.faults,
                        deadline_s=config.storage_deadline_s,
                    )
                self.storage = storage
                self._start(copier, storage, l1_buffer)
            except BaseException:
                # NOTE: the controller, once made, closes the storage and lets the signals go
                controller = getattr(self, "controller", None)
                _close_quietly(controller if controller is not None else storage if storage is not None else custom)
                raise
        finally:
            if self._holding:  # NOTE: a refusal before _start let them go
                self._holding = False
                release_signals()

    def _start(self, copier: DeviceMover, storage: StoreMover | None, l1_buffer: torch.Tensor | None) -> None:
        """The end of the set-up, from the storage open to the finalizers that close it: run
        as an atomic call (a signal mid-way would leave the storage with no one to close it)."""
        config, g = self.config, self.config.geometry
        with held():
            self.core = CacheCore(
                g.page_size, TierSizes(config.l1_pages, config.l2_pages, config.l3_pages), tracing=config.tracing
            )
            self.controller = Controller(
                self.core,
                copier,
                storage,
                CostModel(g.bytes_per_token, config.priors, config.policy),
                write_policy=config.write_policy,
                selective_hits=config.selective_hits,
                verifier=DigestVerifier(self.l1, self.l2) if config.verify_pages else None,
                key_seed=format_seed(config.model_id, g, shard=config.shard) if config.model_id else None,
            )
            self._guard = PageGuard(self.l1) if config.guard_pages else None
            # NOTE: a pool this cache allocated too: another cache given it as its l1_buffer
            # would hand out the same pages
            _LIVE_L1[id(self)] = _extent(l1_buffer if l1_buffer is not None else self.l1.buffer)
            weakref.finalize(self, _LIVE_L1.pop, id(self), None)
            if storage is not None:
                # NOTE: a cache dropped without close() would leave its L3 threads, open files
                # and the dir store's lock for the life of the process (the threads hold the
                # mover, not the cache): they go when its controller is collected (the one that
                # drives the storage: kept by whoever kept it), with a ResourceWarning.
                self._unclosed = weakref.finalize(self.controller, _close_unclosed, storage)
                # NOTE: at exit the process's end releases a local store's; a remote store's
                # client torn down with the interpreter while its calls run aborts the process
                # ("terminate called without an active exception": Mooncake's, a put in
                # flight): closed first
                self._unclosed.atexit = bool(storage.store.remote)
            if self._holding:  # NOTE: the controller holds them from here on, as long as it is open
                self._holding = False
                release_signals()

    # -- the controller's calls ------------------------------------------------------------

    @_guarded
    def admit(self, tokens: object, *, at_most: int | None = None) -> Request:
        """Match ``tokens`` once (within the first ``at_most`` tokens, if given) and pin the
        L1 hit (:meth:`Controller.admit`)."""
        return self.controller.admit(tokens, at_most=at_most)

    def plan(self, req: Request) -> Plan:
        """Restore from L2, L3 or recompute: a decision only (:meth:`Controller.plan`)."""
        return self.controller.plan(req)

    @_guarded
    def start_restore(
        self, req: Request, plan: Plan | None = None, *, layer_events: Sequence[Any] | None = None
    ) -> PendingRestore | None:
        """Commit a restore, asynchronously (:meth:`Controller.start_restore`)."""
        return self.controller.start_restore(req, plan, layer_events=layer_events)

    @_guarded
    def restore(self, req: Request, plan: Plan | None = None) -> bool:
        """Blocking restore; True if ``cached_len`` grew (:meth:`Controller.restore`)."""
        return self.controller.restore(req, plan)

    @_guarded
    def poll(self) -> list[PendingRestore]:
        """Advance transfers; the restores that finished (:meth:`Controller.poll`): published
        (``done``), failed (recompute), or cancelled by a ``release`` (``request.released``)."""
        return self.controller.poll()

    def settle(self) -> bool:
        """Block until the first restore copy in flight has landed, if every restore in
        flight is a copy to the device; whether it blocked (:meth:`Controller.settle`)."""
        return self.controller.settle()

    @_guarded
    def allocate(self, req: Request, n: int) -> list[DevicePage] | None:
        """``n`` private L1 pages, or None without room now; MisuseError if they could never
        fit (:meth:`Controller.allocate`)."""
        return self.controller.allocate(req, n)

    @_guarded
    def insert(self, req: Request, pages: Sequence[DevicePage]) -> int:
        """Hand the prefilled prompt to the tree (:meth:`Controller.insert`)."""
        return self.controller.insert(req, pages)

    def prefix_pages(self, req: Request) -> list[DevicePage]:
        """L1 pages of ``req.tokens[:req.cached_len]`` (:meth:`Controller.prefix_pages`)."""
        return self.controller.prefix_pages(req)

    @_guarded
    def release(self, req: Request) -> None:
        """Finished or aborted: the request holds nothing (:meth:`Controller.release`)."""
        self.controller.release(req)

    def requests(self) -> list[Request]:
        """The requests admitted and not yet released (:meth:`Controller.requests`)."""
        return self.controller.requests()

    def observe_prefill(self, tokens: int, seconds: float) -> None:
        """Teach the recompute model (:meth:`Controller.observe_prefill`)."""
        self.controller.observe_prefill(tokens, seconds)

    def note_decode(self, seconds: float, *, ended: float | None = None) -> None:
        """Decode time spent while restores were pending (:meth:`Controller.note_decode`)."""
        self.controller.note_decode(seconds, ended=ended)

    @_guarded
    def drain(self) -> None:
        """Block until every transfer in flight has finished."""
        self.controller.drain()

    @_guarded
    def flush(self) -> int:
        """Back up to L3 every run held only in L1 or L2, blocking; the runs written
        (:meth:`Controller.flush`; ``close`` does it for a store that outlives the cache)."""
        return self.controller.flush()

    def status(self) -> ControllerStatus:
        """Typed status (``.to_dict()`` for JSON)."""
        return self.controller.status()

    def prometheus(self) -> str:
        """The metrics in Prometheus text format."""
        return self.controller.prometheus()

    def check_integrity(self) -> None:
        """Raise IntegrityError naming the first broken invariant (page runs and requests);
        with ``guard_pages``, then PageContentError for an L1 page the engine wrote and did
        not own (hicache/backends/guard.py)."""
        self.controller.check_integrity()
        if self._guard is not None and not self.closed:
            self._guard.before(*self._l1_owners())
            self._guard.check()

    def _l1_owners(self) -> tuple[list[int], dict[int, Identity], set[int]]:
        """The free L1 pages, each published one with its run's identity, and the requests' own."""
        core = self.controller.core
        published = {
            p: (n.id, n.version[Tier.L1]) for n in core.tree.iter_nodes() if (ps := n.pages[Tier.L1]) for p in ps
        }
        private: set[int] = set()
        for r in self.controller.requests():
            private.update(r.private)
        return list(core.l1.free_pages()), published, private

    @property
    def cost(self) -> CostModel:
        """The cost model (its state: ``status().cost_model``)."""
        return self.controller.cost

    @property
    def metrics(self) -> Metrics:
        return self.controller.metrics

    @property
    def closed(self) -> bool:
        return self.controller.closed

    def close(self) -> None:
        """Drain transfers, release every request, close storage. Idempotent."""
        self.controller.close()
        _LIVE_L1.pop(id(self), None)
        unclosed = getattr(self, "_unclosed", None)
        if unclosed is not None:
            unclosed.detach()

    def __enter__(self) -> HiCache:
        if self.closed:
            raise MisuseError("this HiCache is closed")
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


# The memory of the L1 buffers given to live caches: two caches over one pool hand out the
# same pages and read each other's KV.
_LIVE_L1: dict[int, tuple[str, int, int]] = {}


def _extent(buffer: torch.Tensor) -> tuple[str, int, int]:
    """The device and byte range of ``buffer`` (contiguous: checked before)."""
    start = buffer.data_ptr()
    return str(buffer.device), start, start + buffer.numel() * buffer.element_size()


def _check_not_shared(buffer: torch.Tensor) -> None:
    device, lo, hi = _extent(buffer)
    if any(d == device and lo < b and a < hi for d, a, b in _LIVE_L1.values()):
        raise ConfigError(
            "l1_buffer shares memory with the L1 pool of another open HiCache: each cache needs a pool "
            "of its own (both would hand out the same pages)"
        )


def _close_unclosed(storage: StoreMover) -> None:
    """A cache with L3 storage was collected without ``close()``: close its storage on a
    thread of its own (a hung disk holds a close for up to the store's close timeout, and
    the collection may run on the engine's thread). At exit (an open cache's finalizer runs
    then) it closes here instead, and closers started before are waited for: a daemon thread
    still in the store's or torch's code when the interpreter ends aborts the process."""
    if storage.shut:  # NOTE: not ``closed``: a close cut short by a signal is finished here
        return
    # NOTE: the close first: under an "error" warnings filter the warning raises here
    if getattr(weakref.finalize, "_shutdown", False) or sys.is_finalizing():
        _close_quietly(storage)
    else:
        closer = threading.Thread(target=_close_quietly, args=(storage,), name="hicache-l3-close", daemon=True)
        closer.start()
        _wait_at_exit(closer, storage.close_timeout_s)
    warnings.warn(
        "a HiCache with L3 storage was not closed: its storage is being closed (call close(), or use it as a "
        "context manager)",
        ResourceWarning,
        stacklevel=1,
    )


def _wait_at_exit(closer: threading.Thread, timeout_s: float) -> None:
    at_exit.wait_at_exit(lambda: not closer.is_alive(), timeout_s + 1.0, "a store's close (a cache never closed)")


def _close_quietly(store: object) -> None:
    close = getattr(store, "close", None)
    if close is None:
        return
    with contextlib.suppress(Exception):  # NOTE: the refusal being raised says more than this
        close()


def _first_line(exc: BaseException) -> str:
    """The first line of ``exc``'s message (torch's carry C++ frames after it), at most 200
    characters; a size torch cannot even take (past int64) is said so."""
    if isinstance(exc, (TypeError, OverflowError)):
        return "more than a tensor can hold"
    text = str(exc).strip()
    line = text.splitlines()[0] if text else type(exc).__name__
    line = re.sub(r"^\[enforce fail at [^\]]*\] (err == 0\. )?", "", line)  # c10's source line, not a reason
    return line if len(line) <= 200 else line[:197] + "..."
