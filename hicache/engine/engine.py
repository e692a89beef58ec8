"""The reference engine: continuous batching, greedy decoding, prefix caching through
:class:`~hicache.HiCache`, and the overlap loop.

One scheduler thread owns everything. Each :meth:`Engine.step`:

1. polls the cache: restores that finished (published, failed or cancelled) make their
   requests ready to prefill (a failed restore means the request recomputes);
2. admits waiting requests up to ``max_batch``: match, pin the L1 hit, ask the cost model
   (``plan``); a restore from L2/L3 is *started* (below) and the request parks until it is
   published (with ``prefetch=False`` the restore blocks here instead, the seed's baseline). A
   *layered* restore (``layered_restore``; the default ``None`` turns it on wherever CUDA
   and cuda-python allow, ``False`` turns it off) also launches the request's prefill at
   once, on its own stream
   (see :class:`~hicache.engine.model.ModelRunner`): each layer waits only for
   its own pages to land, so the forward runs beside the copy. Its logits are held until
   the restore is published (a failed restore discards them and the request recomputes);
3. runs one forward: the oldest ready prefill if any (prefill first keeps TTFT low), else one
   decode batch of every running request; after ``prefills_before_decode`` prefills in a
   row a waiting decode batch goes first (a stream of arrivals must not starve decode).
   Decode time spent while restores are pending is reported with ``note_decode``: that is
   the restore time hidden behind useful work. The restores admitted in this step start
   right after the step's forward (a prefill or a decode batch) is launched and before its
   tokens are read: their host work (issuing the copy, launching a layered prefill) then runs
   while the device computes instead of before it. They are issued behind a mark taken
   before the forward's launch (:meth:`~hicache.engine.model.ModelRunner.after`), so their
   copies and layered forwards run beside it, not queued behind it. With no forward to run
   in the step, they start at once.

Without ``enable_hicache`` the engine keeps its L1 prefix cache (policy ``never``, no L2/L3)
and no transfer ever runs.
"""

from __future__ import annotations

import dataclasses
import functools
import itertools
import logging
import math
import threading
import time
import warnings
from collections import deque
from collections.abc import Mapping
from dataclasses import dataclass, field
from enum import StrEnum
from typing import Any, cast

import torch

from hicache.backends.transfer import TransferBackend
from hicache.core import interrupts
from hicache.core.controller import PendingRestore, Request, WritePolicy
from hicache.core.cost import CostPriors, Plan, Policy
from hicache.core.geometry import DevicePage, KVGeometry
from hicache.core.interrupts import atomic
from hicache.core.tokens import Tokens, as_tokens, bounds, plain_int
from hicache.engine.model import (
    AttentionImpl,
    CudnnUse,
    ModelRunner,
    build_model,
    kv_geometry,
    model_geometry,
    model_identity,
    weights_digest,
)
from hicache.engine.signals import LayerSignals
from hicache.errors import ConfigError, HiCacheError, IntegrityError, MisuseError
from hicache.facade import HiCache, HiCacheConfig, _default_device
from hicache.spec.model import Direction, Tier

log = logging.getLogger(__name__)

# A signalled layered restore launches its forward once this many layer groups of its copy
# are queued (TransferEngine.flush's midway): sooner, the copy engine may run dry while the
# host launches the forward; later, the forward starts later (bench: --forward-after).
FORWARD_AFTER_GROUPS = 3

# An idle step (only restores in flight) sleeps this long before polling again; while every
# restore still reads storage, twice as long after each idle step, at most 2**IDLE_BACKOFF_STEPS
# times as long (Engine._idle_sleep_s).
IDLE_SLEEP_S = 50e-6
IDLE_BACKOFF_STEPS = 5

# A waiting request whose prompt head another request's restore brings into L1 waits for it
# while the restore has run for less than the predicted recompute of that head, and at least
# this long: a restore that takes longer (a slow or hung disk) no longer holds it back.
RESTORE_WAIT_MIN_S = 0.5
# Requests held back in one step at most: past them, admission waits for the next step (a
# burst on one prefix costs each step this many prefix comparisons, not the whole queue's).
DEFERRED_PER_STEP = 64


class RequestFailed(HiCacheError):
    """:meth:`Engine.generate`'s request could not be served (the message says why)."""


@dataclass(frozen=True)
class Output:
    id: int
    tokens: list[int]  # generated tokens
    first_logits: torch.Tensor | None  # logits of the first generated token (CPU, float32)
    ttft_s: float  # submit -> first token (includes queueing and any restore)
    latency_s: float  # submit -> last token
    cached_tokens: int  # prompt tokens not recomputed (L1 hit + restored)
    restored_from: str  # "L2" or "L3" when a restore served the prefix, else "L1" (nothing restored)
    restore_failed: bool = False  # a restore was planned but failed: the request recomputed
    error: str | None = None  # "aborted", or why the request could not be served
    restore_wait_s: float = 0.0  # restore started -> seen finished by a poll (0 without one)
    prefill_s: float = 0.0  # the prefill forward and its first token (GPU included)


class SeqState(StrEnum):
    """Where a sequence is in the engine's loop."""

    WAITING = "waiting"  # submitted, not admitted (the batch is full)
    RESTORING = "restoring"  # its restore is in flight
    READY = "ready"  # to prefill
    DECODING = "decoding"


@dataclass(eq=False)
class _Layered:
    """A prefill launched beside its restore's H2D: its logits are valid once the restore
    is published, and only if the prefix it read is the one published."""

    logits: torch.Tensor
    cached: int  # prompt tokens it read from the restored prefix
    prefix: list[DevicePage]  # the pages it read them from


@dataclass(eq=False)
class _Seq:
    id: int
    prompt: Tokens
    max_new: int
    arrived: float
    state: SeqState = SeqState.WAITING
    req: Request | None = None
    restore: PendingRestore | None = None
    restored_from: str = "L1"
    restore_failed: bool = False
    cached: int = 0  # prompt tokens taken from the cache at prefill
    pages: list[DevicePage] = field(default_factory=list)  # page table of prompt + output
    out: list[int] = field(default_factory=list)
    first_logits: torch.Tensor | None = None
    ttft: float = 0.0
    restore_started: float = 0.0
    restore_wait: float = 0.0
    prefill_s: float = 0.0
    own: list[DevicePage] = field(default_factory=list)  # private pages allocated ahead (layered)
    layered: _Layered | None = None
    emitted: bool = False  # its Output is out (finished, failed or aborted)


@dataclass
class EngineStats:
    submitted: int = 0
    finished: int = 0
    aborted: int = 0
    errors: int = 0
    requeued: int = 0  # requests that gave their pins back for lack of L1 room, to be admitted again
    prefills: int = 0
    prefill_tokens: int = 0
    prefill_s: float = 0.0
    decode_batches: int = 0
    decode_tokens: int = 0
    decode_s: float = 0.0
    decode_s_while_restoring: float = 0.0
    # Where a pending restore's time goes besides decode (the overlap metric counts decode only):
    prefill_s_while_restoring: float = 0.0  # other requests' prefills, run in decode's place
    idle_s_while_restoring: float = 0.0  # nothing else to run: waiting for the copy
    restore_issue_s: float = 0.0  # host time starting restores (and launching layered prefills)
    restore_issue_s_beside_decode: float = 0.0  # the part of it spent while a decode batch ran
    restore_issue_s_beside_prefill: float = 0.0  # ... while another request's prefill ran
    layered_launch_s: float = 0.0  # the part of it launching layered prefills
    restores_started: int = 0
    restores_failed: int = 0
    layered_prefills: int = 0  # launched beside their restore's copy
    layered_used: int = 0  # their logits served the request (the rest recomputed)
    idle_polls: int = 0
    cache_s: float = 0.0  # in hicache calls (bookkeeping; excludes blocking restore waits)


def _check_rid(call: str, rid: object) -> int:
    """``rid`` as the int submit() returned (a numpy integer too: an id read back from an
    array), else MisuseError."""
    rid = plain_int(rid)
    if isinstance(rid, bool) or not isinstance(rid, int):
        raise MisuseError(f"{call}: a request id is the int submit() returned, got {rid!r}")
    return rid


def model_context(net: torch.nn.Module) -> int | None:
    """The positions the model was made for (its config's ``max_position_embeddings``), or
    None where it does not say: a prompt past them runs, but a real checkpoint's outputs
    there are not what it was trained to give."""
    context = getattr(getattr(net, "config", None), "max_position_embeddings", None)
    return context if type(context) is int and context > 0 else None


def _check_seed(value: object) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value < 2**63:
        raise ConfigError(f"seed must be an int in [0, 2**63), got {value!r}")


@dataclass(frozen=True)
class EngineConfig:
    """The engine's settings. ``cache`` fixes the KV layout (its geometry must be the
    model's), the L1 pool size, the device and the tiers; hicache is on when it has L2
    pages (else the engine keeps only its L1 prefix cache, policy ``never``)."""

    cache: HiCacheConfig
    model: str = "tiny"
    max_batch: int = 32
    prefills_before_decode: int = 1
    prefetch: bool = True  # restores park while decode runs (False: blocking restores)
    layered_restore: bool | None = None  # None: wherever the copy can signal layers (CUDA)
    cuda_graphs: bool = True
    graph_short_prefills: bool | None = None
    attention: AttentionImpl = "auto"
    cudnn: CudnnUse = "off"
    seed: int = 0

    def __post_init__(self) -> None:
        if not isinstance(self.cache, HiCacheConfig):
            raise ConfigError(f"cache must be a HiCacheConfig, got {type(self.cache).__name__}")
        for name in ("max_batch", "prefills_before_decode"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ConfigError(f"{name} must be an int >= 1, got {value!r}")
        for name, optional in (("prefetch", False), ("cuda_graphs", False), ("layered_restore", True),
                               ("graph_short_prefills", True)):  # fmt: skip
            value = getattr(self, name)
            if not isinstance(value, bool) and not (optional and value is None):
                raise ConfigError(f"{name} must be a bool{' or None' if optional else ''}, got {value!r}")
        _check_seed(self.seed)
        if self.layered_restore and self.enabled and not self.prefetch:
            raise ConfigError("layered_restore needs prefetch (a blocking restore has no forward to overlap)")

    @property
    def enabled(self) -> bool:
        """hicache's L2 (and L3) behind the L1 prefix cache."""
        return self.cache.l2_pages > 0

    @classmethod
    def create(
        cls,
        model: str = "tiny",
        *,
        device: str | None = None,
        dtype: torch.dtype = torch.float32,
        page_size: int = 16,
        num_pages: int = 1024,
        enable_hicache: bool = False,
        l2_pages: int = 0,
        l3_pages: int = 0,
        storage_path: str | None = None,
        storage_direct: bool = False,
        storage_backend: str = "file",
        storage_extra: Mapping[str, Any] | None = None,
        storage_deadline_s: float | None = 10.0,
        policy: str = "cost",
        write_policy: WritePolicy | str = WritePolicy.WRITE_THROUGH,
        transfer_backend: TransferBackend = "auto",
        priors: CostPriors | None = None,
        verify_pages: bool = False,
        guard_pages: bool = False,
        **engine: Any,
    ) -> EngineConfig:
        """A config from keyword settings (the cache's geometry taken from ``model``;
        ``engine`` holds the other fields of :class:`EngineConfig`)."""
        if not isinstance(model, str):
            raise ConfigError(f"model must be a preset name or a checkpoint directory (a str), got {model!r}")
        if not isinstance(enable_hicache, bool):
            raise ConfigError(f"enable_hicache must be a bool, got {enable_hicache!r}")
        if enable_hicache and not l2_pages:
            raise ConfigError("enable_hicache needs l2_pages > 0")
        if not enable_hicache and (l2_pages or l3_pages):
            warnings.warn(
                f"l2_pages={l2_pages!r}, l3_pages={l3_pages!r} have no effect without enable_hicache=True "
                "(the engine keeps its L1 prefix cache only)",
                UserWarning,
                stacklevel=3,
            )
        if not isinstance(policy, str) or policy not in {k.value for k in Policy}:
            raise ConfigError(f"policy must be one of {[k.value for k in Policy]}, got {policy!r}")
        num_pages = plain_int(num_pages)  # type: ignore[assignment]  # NOTE: a numpy integer is one
        if isinstance(num_pages, bool) or not isinstance(num_pages, int) or num_pages < 1:
            raise ConfigError(f"num_pages (L1 pages) must be an int >= 1, got {num_pages!r}")
        _check_seed(engine.get("seed", 0))
        unknown = set(engine) - {f.name for f in dataclasses.fields(cls)} | ({"cache", "model"} & set(engine))
        if unknown:
            raise ConfigError(f"unknown engine settings {sorted(unknown)}")
        cache = HiCacheConfig(
            model_geometry(model, page_size, dtype),
            l1_pages=num_pages,
            l2_pages=l2_pages if enable_hicache else 0,
            l3_pages=l3_pages if enable_hicache else 0,
            storage_path=storage_path,
            storage_direct=storage_direct,
            storage_backend=storage_backend,
            storage_extra=storage_extra,
            storage_deadline_s=storage_deadline_s,
            model_id=model_identity(model, int(engine.get("seed", 0))),
            policy=policy if enable_hicache else "never",
            write_policy=write_policy,
            transfer_backend=transfer_backend,
            priors=CostPriors() if priors is None else priors,
            device=_default_device() if device is None else str(device),
            verify_pages=verify_pages,
            guard_pages=guard_pages,
        )
        return cls(cache, model, **engine)


# NOTE: a str of its own (not the interned literal), so Engine(model=...) is told from
# Engine("tiny", model=...) by identity.
_DEFAULT_MODEL = "".join(["ti", "ny"])


class Engine:
    """The reference engine (see the module docstring).

    ``Engine(EngineConfig(...))``, or ``Engine("tiny", num_pages=..., ...)`` (or
    ``Engine(model="tiny", ...)``) with the keywords of :meth:`EngineConfig.create`. ``net``
    replaces the model built from ``config.model`` (its KV geometry must match
    ``config.cache.geometry``); with L3, the store's pages are keyed by the weights it runs
    (:func:`~hicache.engine.model.weights_digest`). A setting refused while the engine is
    built leaves nothing open (the cache it made is closed)."""

    def __init__(
        self, config: EngineConfig | str = _DEFAULT_MODEL, *, net: torch.nn.Module | None = None, **options: Any
    ):
        if config is _DEFAULT_MODEL and "model" in options:
            config = options.pop("model")  # Engine(model="tiny", ...) as Engine("tiny", ...)
        elif "model" in options:
            raise ConfigError(f"the model is given twice: {config!r} and model={options['model']!r}")
        if isinstance(config, str):
            config = EngineConfig.create(config, **options)
        elif not isinstance(config, EngineConfig):
            raise ConfigError(f"config must be an EngineConfig or a model name, got {type(config).__name__}")
        elif options:
            raise ConfigError(f"give either an EngineConfig or keyword settings, not both: {sorted(options)}")
        if config.layered_restore and not config.enabled:
            warnings.warn(
                "layered_restore=True has no effect without hicache (no L2 pages: nothing is restored)",
                UserWarning,
                stacklevel=2,
            )
        cc = config.cache
        g = cc.geometry
        if net is None:
            net = build_model(config.model, device=cc.device, dtype=g.dtype, seed=config.seed)
        elif not isinstance(net, torch.nn.Module) or not hasattr(net, "config"):
            raise ConfigError(f"net must be a transformers causal LM (a torch.nn.Module with .config), got {net!r:.80}")
        self.net = net
        if kv_geometry(self.net, g.page_size) != g:
            raise ConfigError(f"the model's KV geometry {kv_geometry(self.net, g.page_size)} differs from {g}")
        ModelRunner.check_settings(config.attention, config.cudnn, cc.device)  # before the cache opens a store
        if config.cudnn != "off" and torch.device(cc.device).type != "cuda":
            warnings.warn(
                f"cudnn={config.cudnn!r} has no effect on {cc.device} (cuDNN attention needs CUDA)",
                UserWarning,
                stacklevel=2,
            )
        if cc.l3_pages and cc.storage_backend != "file":
            # NOTE: a shared store keys pages by the model's identity: the weights actually
            # run name it, not only the model's name (a net given in its place, a checkpoint
            # rewritten in place, a preset built differently elsewhere do not match). The
            # file store is private to this cache: nothing to tell apart.
            cc = dataclasses.replace(cc, model_id=f"{cc.model_id}:weights={weights_digest(self.net)}")
            config = dataclasses.replace(config, cache=cc)
        self.config = config
        self.enabled = config.enabled
        self.prefetch = config.prefetch
        self.max_batch = config.max_batch
        self.cache = HiCache(cc)
        try:
            self._set_up(config, cc, g)
        except BaseException:
            # NOTE: a refused setting, or an interrupt (Ctrl-C) anywhere in the set-up, must not
            # leave the cache open: its store stays locked (a dir store for this process's
            # lifetime) and its pools allocated; nor the runner its streams (the next one's).
            runner = self.__dict__.get("runner")
            if runner is not None:
                runner.close()
            self.cache.close()
            raise

    def _set_up(self, config: EngineConfig, cc: HiCacheConfig, g: KVGeometry) -> None:
        """The engine's state beside its open cache (closed by ``__init__`` if this raises)."""
        self._owner = threading.get_ident()  # the cache's too: both are single-threaded
        self.runner = ModelRunner(
            self.net,
            self.cache.l1,
            cuda_graphs=config.cuda_graphs,
            graph_short_prefills=config.graph_short_prefills,
            attention=config.attention,
            cudnn=config.cudnn,
            layer_groups=self.cache.device.layer_groups(),
        )
        layered = config.layered_restore
        if layered is None:  # auto: where the copy can signal layers as they land
            layered = self.cache.device.layered
        self.layered = bool(layered) and self.enabled and self.prefetch
        self.page_size = g.page_size
        self.cuda = torch.device(cc.device).type == "cuda"
        self.stats = EngineStats()
        self._ids = itertools.count(1)
        self._waiting: deque[_Seq] = deque()
        self._active: dict[int, _Seq] = {}  # restoring, ready or decoding, in arrival order
        self._finished: list[Output] = []
        self._carried: list[Output] = []  # others' outputs seen by generate(), for the next step()/run()
        self.prefills_before_decode = config.prefills_before_decode
        self._prefills_in_row = 0
        self._idle_streak = 0  # idle steps in a row while every restore reads storage
        self._admission_held = False  # a request gave its pins back for others: admit none until one moves
        self._starting: list[tuple[_Seq, Plan]] = []  # admitted in this step, restore not yet started
        # restores of aborted requests still in flight (prompt, restore, started): they go on
        # into the tree, and a request for the same head (a retry) waits for them as for others'
        self._background: list[tuple[Tokens, PendingRestore, float]] = []
        self._interrupted = False  # an exception escaped mid-step and its recovery has not finished
        self._starts_beside_prefill_done: float | None = None  # when this step's starts beside its prefill returned
        self._batch_end: Any = torch.cuda.Event() if self.cuda else None  # type: ignore[no-untyped-call]

    # -- requests ----------------------------------------------------------------------------

    def submit(self, prompt: list[int], max_new_tokens: int = 1) -> int:
        """Queue a request; returns its id. Served by :meth:`step`. Raises MisuseError for a
        prompt that is empty or not ints, ConfigError for tokens outside the vocabulary, a bad
        ``max_new_tokens``, a request longer than the model's context (its config's
        ``max_position_embeddings``), or one the L1 pool can never hold."""
        self._check_open()
        max_new_tokens = plain_int(max_new_tokens)  # type: ignore[assignment]  # a numpy count, as for tokens
        if isinstance(max_new_tokens, bool) or not isinstance(max_new_tokens, int) or max_new_tokens < 1:
            raise ConfigError(f"max_new_tokens must be an int >= 1, got {max_new_tokens!r}")
        toks = as_tokens(prompt)  # one C-level pass; raises MisuseError naming a bad token
        vocab = int(getattr(self.net.config, "vocab_size", 0))
        low, high = bounds(toks)
        if low < 0 or high >= vocab:
            bad = next(t for t in toks if not 0 <= t < vocab)
            raise ConfigError(f"prompt token {bad!r} is not in [0, {vocab})")
        context = model_context(self.net)
        if context is not None and len(toks) + max_new_tokens > context:
            raise ConfigError(
                f"a prompt of {len(toks)} tokens and {max_new_tokens} new needs {len(toks) + max_new_tokens} "
                f"positions, the model has {context} (max_position_embeddings)"
            )
        need = -(-(len(toks) + max_new_tokens) // self.page_size)
        if need > self.config.cache.l1_pages:
            raise ConfigError(
                f"no room in L1 for a prompt of {len(toks)} tokens and {max_new_tokens} new: it needs {need} "
                f"pages of {self.page_size} tokens, the pool has {self.config.cache.l1_pages}"
            )
        # NOTE: plain ints (as_tokens makes bools 0 and 1): the forward sees the prompt as
        # the cache does; and checked, so admitting it does not check it again.
        seq = _Seq(next(self._ids), toks, max_new_tokens, time.perf_counter())
        self._waiting.append(seq)
        self.stats.submitted += 1
        return seq.id

    def abort(self, rid: int) -> bool:
        """Abort a request wherever it is (queued, restoring, decoding). Its pages and pins go
        back at once; a restore in flight completes in the background into the tree. False if
        the request is not known (finished or never submitted)."""
        self._check_open()
        rid = _check_rid("abort", rid)
        seq = self._active.get(rid) or next((s for s in self._waiting if s.id == rid), None)
        if seq is None:
            return False
        try:
            self.stats.aborted += 1
            if seq.state is SeqState.RESTORING:
                seq.restored_from = "L1"  # NOTE: its restore goes on in the background, serving no one
            with interrupts.held():  # NOTE: an Output out and the request still queued: served twice
                self._emit(seq, error="aborted")
                if self._active.pop(rid, None) is None:
                    self._waiting.remove(seq)
            restore = seq.restore if seq.state is SeqState.RESTORING else None
            self._drop(seq)
            if restore is not None and not restore.finished:
                self._background.append((seq.prompt, restore, seq.restore_started))
        except BaseException as exc:
            if not isinstance(exc, IntegrityError):
                self._tidy()
            raise
        return True

    def _check_open(self) -> None:
        if self.cache.closed:
            raise MisuseError("this Engine is closed")
        self._check_thread()

    def _check_thread(self) -> None:
        """Refuse a call from another thread before it changes anything (the cache would
        refuse it part-way: an abort had forgotten its request, the cache still held it)."""
        if threading.get_ident() != self._owner:
            raise MisuseError("Engine is single-threaded: call it from the thread that created it")

    def _drop(self, seq: _Seq) -> None:
        """Give back everything ``seq`` holds in the cache."""
        self._idle_streak = 0  # the requests in flight changed: the next idle wait starts short
        if seq.layered is not None:
            self.runner.join_layered()  # its pages go back now: later users wait for its writes
            seq.layered = None
        if seq.req is not None and not seq.req.released:
            self.cache.release(seq.req)

    def _requeue(self, seq: _Seq) -> None:
        """Give back what ``seq`` holds and put it first in line again; no other request is
        admitted until one of those in flight prefills or decodes, or all have left (each
        such step serves, decodes, requeues or ends one, so a lone request that still cannot
        fit fails: it never fits). An exception out of ``_drop`` after the cache request was
        given back leaves ``seq`` active with it released: :meth:`_tidy` requeues it."""
        self._drop(seq)
        self._requeued(seq)

    @atomic
    def _requeued(self, seq: _Seq) -> None:
        """``seq``, whose cache request is given back, first in line again.

        NOTE: Ctrl-C is held until it returns: between forgetting ``seq`` and queuing it again
        the request is in neither place (a wait for its layered forward in ``_drop`` stays
        interruptible)."""
        del self._active[seq.id]
        self._waiting.appendleft(_Seq(seq.id, seq.prompt, seq.max_new, seq.arrived))
        self._admission_held = True
        self.stats.requeued += 1

    def state_of(self, rid: int) -> SeqState | None:
        """Where request ``rid`` is in the loop; None once finished (or never submitted)."""
        self._check_thread()  # NOTE: the scheduler's queues change under another thread's walk
        rid = _check_rid("state_of", rid)
        seq = self._active.get(rid)
        if seq is not None:
            return seq.state
        return SeqState.WAITING if any(s.id == rid for s in self._waiting) else None

    @property
    def pending(self) -> int:
        """Requests submitted and not yet finished or aborted."""
        self._check_thread()
        return len(self._waiting) + len(self._active)

    def step(self) -> list[Output]:
        """One scheduler iteration (see the module docstring); returns requests finished in it.

        A request that cannot be served (a cache refusal, no room at all, out of device
        memory in its forward) finishes with ``error`` set; the step goes on. An exception
        that is no request's failure (Ctrl-C, a bug outside hicache) propagates; the requests
        it cut short go on at the next call, or finish with ``error="interrupted: ..."`` where
        their pages may already be the tree's, and nothing they held stays held."""
        self._check_open()
        if self._interrupted:
            self._tidy()  # a second interrupt cut the last tidy-up short
        try:
            return self._step()
        except BaseException as exc:
            if not isinstance(exc, IntegrityError):  # a bug in hicache: the cache is not to be trusted
                self._tidy()
            raise

    def _tidy(self) -> None:
        """After an exception escaped a step or an abort: finish the requests that have all
        their tokens and forget those whose Output is out (an interrupt on their way out:
        decoded again, they would get one token too many or a second Output), queue again
        those whose requeue it cut short, then release every cache request no active request
        holds (one admitted but not yet kept, or one whose request was forgotten before its
        release)."""
        self._interrupted = True
        if any(s.emitted for s in self._waiting):  # an abort cut short between its Output and the queue
            self._waiting = deque(s for s in self._waiting if not s.emitted)
        active = list(self._active.values())
        done = [s for s in active if s.emitted or (s.state is SeqState.DECODING and len(s.out) >= s.max_new)]
        for seq in done:
            if not seq.emitted:
                self._emit(seq)
                self.stats.finished += 1
            self._active.pop(seq.id, None)
            try:
                self._drop(seq)
            except HiCacheError as failure:  # NOTE: the exception that escaped is what the caller hears
                log.warning("hicache engine: giving back request %d after an interrupt failed: %r", seq.id, failure)
        for seq in [s for s in self._active.values() if s.req is not None and s.req.released]:
            self._requeued(seq)  # cut short in _requeue, its pages already given back
        held = {id(s.req) for s in self._active.values() if s.req is not None}
        for req in self.cache.requests():
            if id(req) not in held:
                try:
                    self.cache.release(req)
                except HiCacheError as failure:  # NOTE: the others are still given back
                    log.warning("hicache engine: releasing request #%d after an interrupt failed: %r", req.id, failure)
        self._interrupted = False

    def _step(self) -> list[Output]:
        cache = self.cache
        t0 = time.perf_counter()
        finished = cache.poll()
        self.stats.cache_s += time.perf_counter() - t0
        for restore in finished:
            self._restored(restore)
        # NOTE: and every finished restore not handed over: an interrupt after poll() returned
        # (on its way out, or between two hand-overs) lost the rest of its list for good
        for seq in [s for s in self._active.values() if s.state is SeqState.RESTORING]:
            if seq.restore is not None and seq.restore.finished:
                self._restored(seq.restore)
        if not self._active:
            self._admission_held = False  # those it waited for left (finished, aborted, failed)
        deferred: list[_Seq] = []
        held_back = False
        taken: _Seq | None = None  # popped from the queue, maybe not yet admitted, deferred or failed
        try:
            while (
                self._waiting
                and len(self._active) < self.max_batch
                and not self._admission_held
                and len(deferred) < DEFERRED_PER_STEP
            ):
                with interrupts.held():  # NOTE: popped and named as one: an interrupt between them loses it
                    taken = self._waiting.popleft()
                if self._behind_a_restore(taken):
                    deferred.append(taken)  # the restore in flight brings its head: admitted after it lands
                    continue
                self._guarded(taken, self._admit)
                taken = None
        except BaseException:
            # NOTE: an interrupt (or a bug) before the request taken was admitted, deferred or
            # failed: it waits again, behind those held back (as one that re-queued itself)
            if (
                taken is not None
                and not taken.emitted
                and taken.id not in self._active
                and not (self._waiting and self._waiting[0] is taken)
                and not (deferred and deferred[-1] is taken)
            ):
                self._waiting.appendleft(taken)
            raise
        finally:
            # NOTE: also when an exception escapes an admission (a bug, an interrupt): the
            # requests held back wait again, ahead of the one that re-queued itself.
            self._waiting.extendleft(reversed(deferred))
            held_back = bool(deferred)
        ready = next((s for s in self._active.values() if s.state is SeqState.READY), None)
        decoding = [s for s in self._active.values() if s.state is SeqState.DECODING]
        prefill = ready is not None and not (decoding and self._prefills_in_row >= self.prefills_before_decode)
        if not prefill and not decoding:
            self._start_restores()  # no forward to run them beside
        ran = idle = False
        if prefill:
            assert ready is not None
            # restores in flight before this step's starts (those start beside the prefill)
            pending = any(s.state is SeqState.RESTORING and s.restore is not None for s in self._active.values())
            t0, beside = time.perf_counter(), self.stats.restore_issue_s_beside_prefill
            self._starts_beside_prefill_done = None
            try:
                ran = bool(self._guarded(ready, self._prefill))
            except BaseException:
                self._abandon_starts()  # escaped before the prefill's launch started them
                raise
            self._prefills_in_row += ran
            # Prefill time while a restore was pending: all of it (less the starts' host time,
            # which is the restores' own) with one in flight before, else from the starts on.
            now, since = time.perf_counter(), cast("float | None", self._starts_beside_prefill_done)  # set by _prefill
            if ran and pending:
                beside = self.stats.restore_issue_s_beside_prefill - beside
                self.stats.prefill_s_while_restoring += max(0.0, now - t0 - beside)
            elif ran and since is not None and any(s.restore is not None for s in self._active.values()):
                self.stats.prefill_s_while_restoring += max(0.0, now - since)
        if self._starting and (ran or not decoding):
            self._start_restores()  # the prefill did not start them (no room for it, or it failed first)
        restoring = any(s.state is SeqState.RESTORING for s in self._active.values())
        if ran:
            self._admission_held = False
        else:
            if decoding:
                self._decode(decoding)
                self._prefills_in_row = 0
                self._admission_held = False
            elif ready is not None and ready.id in self._active and not restoring:
                if cache.status().pending_backups:
                    cache.drain()  # NOTE: pages pinned by backups free up when they land: wait, not fail
                elif len(self._active) > 1:
                    self._requeue(ready)  # the others' pins fill L1: it waits, they go first
                else:
                    self._fail(ready, f"no room in L1 for a prompt of {len(ready.prompt)} tokens")
            elif self._active or held_back:  # NOTE: held back: behind an aborted request's restore
                idle = True
                self.stats.idle_polls += 1
                t0 = time.perf_counter()
                if self._active and all(s.layered is not None for s in self._active.values()):
                    # NOTE: only layered restores in flight, each with its forward queued
                    # behind its layers: wait for the GPU instead of polling every 50 us.
                    self.runner.wait_layered()
                elif cache.settle():  # every restore a device copy: it waited for the first to land
                    self._idle_streak = 0
                else:
                    time.sleep(self._idle_sleep_s())  # only restores in flight: let the copy engine / disk work
                self.stats.idle_s_while_restoring += time.perf_counter() - t0
        if not idle:
            self._idle_streak = 0
        done, self._finished = self._carried + self._finished, []
        self._carried = []
        return done

    def _idle_sleep_s(self) -> float:
        """How long an idle step sleeps before polling again: 50 us while a copy-engine
        transfer may land or a request waits to run; while every active request is a restore
        still reading storage (milliseconds to seconds), twice as long after each idle step
        up to 1.6 ms, so the read costs the scheduler thread about one poll per 1.6 ms instead
        of one per 50 us (each poll checks every transfer). The poll that sees the read end
        comes up to 1.6 ms late."""
        reading = bool(self._active) and all(
            s.state is SeqState.RESTORING
            and s.restore is not None
            and s.restore.transfer is not None
            and s.restore.transfer.direction is Direction.S2H
            for s in self._active.values()
        )
        self._idle_streak = self._idle_streak + 1 if reading else 0
        return IDLE_SLEEP_S * (1 << min(self._idle_streak, IDLE_BACKOFF_STEPS))

    def _guarded(self, seq: _Seq, fn: Any) -> Any:
        """Run ``fn(seq)``; a failure for this request's sake finishes it with an error."""
        try:
            return fn(seq)
        except IntegrityError:
            raise  # a bug in hicache: never hidden
        except (HiCacheError, torch.OutOfMemoryError) as exc:
            self._fail(seq, f"{type(exc).__name__}: {exc}")
            return None

    def run(self) -> list[Output]:
        """Step until every submitted request has finished; outputs in completion order."""
        self._check_open()
        # NOTE: outputs emitted outside a step (aborts) count too, even with nothing left to step
        outs, self._carried, self._finished = self._carried + self._finished, [], []
        try:
            while self.pending:
                outs.extend(self.step())
        except BaseException:
            # NOTE: an interrupt in a later step: those finished before it come from the next call
            self._carried[:0] = outs
            raise
        return outs

    def generate(self, prompt: list[int], max_new_tokens: int = 1) -> Output:
        """Serve one request to completion (other queued requests are served alongside:
        their outputs come from the next :meth:`step` or :meth:`run`); raises
        :class:`RequestFailed` if it could not be served."""
        rid = self.submit(prompt, max_new_tokens)
        while True:
            outs = self.step()
            mine = None
            try:
                for out in outs:
                    if out.id == rid:
                        mine = out
                    else:
                        self._carried.append(out)
            except BaseException:
                # NOTE: an interrupt while they are sorted: every one not yet carried, this
                # request's too, comes from the next call
                self._carried.extend(o for o in outs if all(o is not c for c in self._carried))
                raise
            if mine is not None:
                if mine.error is not None:
                    raise RequestFailed(f"request {rid}: {mine.error}")
                return mine

    # -- scheduling --------------------------------------------------------------------------

    def _behind_a_restore(self, seq: _Seq) -> bool:
        """Whether another request's restore, started or starting in this step, brings at
        least a page of ``seq``'s usable prompt head into L1, and has run for less than the
        predicted recompute of that head (at least ``RESTORE_WAIT_MIN_S``). Admitted now,
        ``seq`` would find that run's copy in flight and recompute (a counted fallback); it
        waits until the copy lands, then takes the pages as an L1 hit. Past that time (a
        slow or hung disk) it is admitted and recomputes, as without a restore in flight."""
        if not self.enabled:
            return False
        ps, usable = self.page_size, (len(seq.prompt) - 1) // self.page_size * self.page_size
        if usable < ps:
            return False
        starting = {s.id: plan for s, plan in self._starting}
        now = time.perf_counter()
        restores: list[tuple[Tokens, Plan, float | None]] = []  # (prompt, plan, started: None if starting)
        for other in self._active.values():
            if other.state is not SeqState.RESTORING:
                continue
            plan = other.restore.plan if other.restore is not None else starting.get(other.id)
            if plan is not None:
                restores.append((other.prompt, plan, other.restore_started if other.restore is not None else None))
        self._background = [b for b in self._background if not b[1].finished]
        restores += [(prompt, restore.plan, started) for prompt, restore, started in self._background]
        for a, plan, started in restores:
            n = min(plan.tokens, usable)
            b = seq.prompt
            if n < ps or a[n - 1] != b[n - 1] or a[:n] != b[:n]:  # the last token first: cheap
                continue
            if started is None:
                return True  # starts in this step
            recompute = plan.predicted_recompute_s * n / plan.tokens if plan.tokens else 0.0
            if not math.isfinite(recompute):  # a model without samples: the least wait
                recompute = 0.0
            if now - started < max(RESTORE_WAIT_MIN_S, recompute):
                return True
        return False

    def _admit(self, seq: _Seq) -> None:
        cache = self.cache
        t0 = time.perf_counter()
        try:
            self._active[seq.id] = seq
            seq.state = SeqState.READY
            # NOTE: the last prompt token is always computed (its logits start decoding), so
            # a fully cached page-aligned prompt's last page is recomputed into a private
            # page: matched only below it, that page is neither pinned nor restored, and the
            # request fits in the pages submit() checked for.
            seq.req = cache.admit(seq.prompt, at_most=len(seq.prompt) - 1)
        except BaseException as exc:
            if not isinstance(exc, HiCacheError) or isinstance(exc, IntegrityError):
                # NOTE: not the request's failure (a bug, an interrupt): it was not admitted,
                # so it waits again instead of staying active without a cache request.
                self._active.pop(seq.id, None)
                seq.state = SeqState.WAITING
                self._waiting.appendleft(seq)
            raise
        plan = cache.plan(seq.req) if self.enabled else None
        self.stats.cache_s += time.perf_counter() - t0
        if plan is None or plan.tier is Tier.L1:
            return
        seq.restored_from = plan.tier.name
        self.stats.restores_started += 1
        if not self.prefetch:
            seq.restore_started = time.perf_counter()
            try:
                restored = cache.restore(seq.req, plan)
            except BaseException as exc:
                pending = seq.req.restore
                if pending is not None and not isinstance(exc, HiCacheError):
                    if not pending.finished:
                        # NOTE: an interrupt (a timeout's signal) while it waited: the restore goes
                        # on in flight, and a later poll reports it, as a prefetched one's
                        seq.restore, seq.state = pending, SeqState.RESTORING
                    elif not pending.done:  # it ended before the interrupt, and no poll reports it
                        self._restore_failed(seq)
                raise
            if not restored:
                self._restore_failed(seq)
            return
        seq.state = SeqState.RESTORING  # its restore starts later in this step (_start_restores)
        self._starting.append((seq, plan))

    def _start_restores(self, beside: str | None = None) -> None:
        """Start the restores admitted in this step; a refusal fails only its request. If an
        exception escapes (a bug, an interrupt), the requests whose restore did not start
        recompute instead of waiting for a restore that never comes. ``beside``: the forward
        launched before them ("decode" or "prefill"), whose stat gets their host time."""
        starting, self._starting = deque(self._starting), []
        any_started, t0 = bool(starting), time.perf_counter()
        try:
            while starting:
                seq, plan = starting[0]
                if self._active.get(seq.id) is seq:
                    self._guarded(seq, functools.partial(self._start_restore, plan=plan))
                starting.popleft()
        finally:
            for seq, _ in starting:
                if self._active.get(seq.id) is seq and seq.state is SeqState.RESTORING and seq.restore is None:
                    seq.state = SeqState.READY
                    self._restore_failed(seq)
            if beside is not None and any_started:
                name = f"restore_issue_s_beside_{beside}"
                setattr(self.stats, name, getattr(self.stats, name) + time.perf_counter() - t0)

    def _abandon_starts(self) -> None:
        """The restores admitted in this step will not start (an exception escapes the step
        before they could): their requests recompute instead of waiting for them."""
        starting, self._starting = self._starting, []
        for seq, _ in starting:
            if self._active.get(seq.id) is seq and seq.state is SeqState.RESTORING and seq.restore is None:
                seq.state = SeqState.READY
                self._restore_failed(seq)

    def _start_restore(self, seq: _Seq, plan: Plan) -> None:
        cache = self.cache
        assert seq.req is not None
        t0 = seq.restore_started = time.perf_counter()
        layered = self.layered and plan.tier is Tier.L2 and not self.runner.layered_busy
        events = self.runner.layer_events if layered else None
        signals = self.runner.signals if layered else None
        if signals is None:
            # CUDA events: the forward waits for the records made before its launch, so it
            # is launched once the restore's copies (and their records) are all queued.
            seq.restore = cache.start_restore(seq.req, plan, layer_events=events)
            self.stats.cache_s += time.perf_counter() - t0
            if seq.restore is None:  # refused (no room, or the copy could not start): recompute
                self._refused(seq)
                return
            if seq.restore.layered:
                self._launch_layered(seq)
        else:
            self._start_signalled(seq, plan, signals)
        self.stats.restore_issue_s += time.perf_counter() - seq.restore_started

    def _start_signalled(self, seq: _Seq, plan: Plan, signals: LayerSignals) -> None:
        """Commit the restore with its H2D held back, then queue its copies and launch the
        forward over the prefix (its waits are value waits) as soon as the first
        ``FORWARD_AFTER_GROUPS`` layer groups are queued: the forward runs from the first
        groups' landing instead of from the last copy's queuing, and the copy engine has
        work while the host launches it. Every signal is written once and consumed once,
        whatever fails (:mod:`hicache.engine.signals`)."""
        cache, t0 = self.cache, time.perf_counter()
        assert seq.req is not None
        signals.arm()
        layered = False
        launched: list[bool] = []
        try:
            with cache.device.deferring():
                seq.restore = cache.start_restore(seq.req, plan, layer_events=signals.events)
            self.stats.cache_s += time.perf_counter() - t0
            if seq.restore is not None and seq.restore.layered:
                layered = True
                batch = self._layered_batch(seq)
                into = self.runner.replay_target([batch[0]], layered=True) if batch is not None else None
                if batch is not None and into is not None:
                    launch = functools.partial(self._launch_forward, seq, *batch, into=into)
                    cache.device.flush(lambda: launched.append(launch()), after=FORWARD_AFTER_GROUPS)
                elif batch is not None:
                    # NOTE: a capture synchronizes the device, and an eager forward may (its
                    # allocations): launched before its copies are queued, or over signals a
                    # failed copy never wrote, it would wait for them forever.
                    cache.device.flush()
                    self.runner.fill_signals()
                    launched.append(self._launch_forward(seq, *batch))
        finally:
            try:
                cache.device.flush()
            finally:
                if layered or signals.recorded_any:
                    self.runner.end_round(consumed=bool(launched and launched[0]))
        if seq.restore is None:
            self._refused(seq)

    def _refused(self, seq: _Seq) -> None:
        """The restore was refused (no room, or the copy could not start): recompute."""
        seq.state = SeqState.READY
        self._restore_failed(seq)

    def _launch_layered(self, seq: _Seq) -> bool:
        """Allocate ``seq``'s own pages and launch its prefill over the prefix still landing;
        whether it was launched (False: no room for its pages now, and it prefills after its
        restore as usual)."""
        batch = self._layered_batch(seq)
        return batch is not None and self._launch_forward(seq, *batch)

    def _layered_batch(self, seq: _Seq) -> tuple[tuple[list[int], list[DevicePage], int], list[DevicePage]] | None:
        """Allocate ``seq``'s own pages for a layered prefill: its forward's sequence
        ``(tail, prefix + own pages, cached)`` and the prefix's pages; None without room."""
        restore, req, ps = seq.restore, seq.req, self.page_size
        layer_pages = None if restore is None else restore.pages
        assert layer_pages is not None and req is not None
        prompt = seq.prompt
        cached = min(len(layer_pages) * ps, (len(prompt) - 1) // ps * ps)
        need = -(-(len(prompt) + seq.max_new) // ps) - cached // ps
        t0 = time.perf_counter()
        own = self.cache.allocate(req, need)
        self.stats.cache_s += time.perf_counter() - t0
        if own is None:
            return None
        seq.own = own
        prefix = layer_pages[: cached // ps]
        return (list(prompt[cached:]), prefix + own, cached), prefix

    def _launch_forward(
        self,
        seq: _Seq,
        batch: tuple[list[int], list[DevicePage], int],
        prefix: list[DevicePage],
        into: torch.Tensor | None = None,
    ) -> bool:
        """Launch ``seq``'s layered prefill (:meth:`_layered_batch`); True once launched.
        ``into``: where its graph replay puts the logits (:meth:`ModelRunner.replay_target`)."""
        t0 = time.perf_counter()
        try:
            logits = self.runner.forward([batch], layered=True, into=into)[0]
        except BaseException:
            # NOTE: kernels it queued may still write its own pages, which go back to the
            # pool when the request fails: whoever takes them next is ordered after them.
            self.runner.join_layered()
            raise
        seq.layered = _Layered(logits, batch[2], prefix)
        self.stats.layered_prefills += 1
        self.stats.layered_launch_s += time.perf_counter() - t0
        return True

    def _restored(self, restore: PendingRestore) -> None:
        """Hand a finished restore to its request: READY (to prefill its tail), or its first
        token from the layered prefill that ran beside the copy. Once per restore: one
        handed over already (by a sweep, before its poll) is left as it is."""
        seq = self._active.get(self._by_request(restore.request))
        if seq is None or seq.restore is not restore or seq.state is not SeqState.RESTORING:
            return  # aborted meanwhile (the pages went to the tree), or handed over already
        seq.restore_wait = time.perf_counter() - seq.restore_started
        if not restore.done and not seq.restore_failed:
            self._restore_failed(seq)
        layered = seq.layered
        if layered is not None:
            self.runner.join_layered()  # its logits and pages are read (or reused) on this stream now
        # NOTE: READY last: an interrupt before it leaves the request RESTORING, handed over
        # again by the next step's sweep; after it, the tail is prefilled again (no logits)
        seq.layered = None
        seq.state = SeqState.READY
        if layered is None:
            return
        req = seq.req
        assert req is not None
        ps = self.page_size
        # Serve its logits only where the normal prefill would read exactly that prefix.
        same = (
            restore.done
            and min(req.cached_len, (len(seq.prompt) - 1) // ps * ps) == layered.cached
            and req.pages[: layered.cached // ps] == layered.prefix
        )
        if same:
            self.stats.layered_used += 1
            now = time.perf_counter()
            logits, cached = layered.logits, layered.cached
            self._guarded(seq, lambda s: self._first_token(s, logits, cached, s.own, now, observe=False))

    def _by_request(self, req: Request) -> int:
        return next((s.id for s in self._active.values() if s.req is req), -1)

    def _restore_failed(self, seq: _Seq) -> None:
        seq.restored_from = "L1"
        seq.restore_failed = True
        self.stats.restores_failed += 1

    def _prefill(self, seq: _Seq) -> bool:
        """Prefill ``seq``'s uncached prompt tail; False (nothing changed) without L1 room.

        prompt  [0 ........ cached) [cached ................ len) + max_new
                 the cache's pages    own pages (allocated now or ahead)
        """
        cache, ps, req = self.cache, self.page_size, seq.req
        assert req is not None
        prompt = seq.prompt
        # NOTE: at least the last prompt token is computed (its logits start decoding);
        # when the whole prompt is cached, its last page is recomputed into a private page
        # and the tree's shared copy is left untouched.
        cached = min(req.cached_len, (len(prompt) - 1) // ps * ps)
        need = -(-(len(prompt) + seq.max_new) // ps) - cached // ps
        t0 = time.perf_counter()
        # Pages allocated for a layered prefill whose logits were not used serve this one.
        more = cache.allocate(req, need - len(seq.own)) if need > len(seq.own) else []
        if more is None:
            self.stats.cache_s += time.perf_counter() - t0
            return False
        own = (seq.own + more)[:need]
        seq.own = own
        pages = cache.prefix_pages(req)[: cached // ps] + own
        self.stats.cache_s += time.perf_counter() - t0
        t0 = time.perf_counter()
        # NOTE: the restores admitted in this step start after the forward's launch, behind a
        # mark taken before it, as beside a decode batch (_decode): their host work runs while
        # the device prefills, their copies beside it. Safe for the same reason: the forward
        # touches only this request's pages, pinned or its own.
        beside = bool(self._starting)
        mark = self.runner.mark() if beside else None
        launched = starts_done = t0
        try:
            logits = self.runner.forward([(prompt[cached:], pages, cached)])[0]
            launched = time.perf_counter()
            if beside and self._batch_end is not None:
                self._batch_end.record()
        finally:
            if beside:
                with self.runner.after(mark):
                    self._start_restores(beside="prefill")
                starts_done = self._starts_beside_prefill_done = time.perf_counter()
        # The prefill's own time leaves out the starts' host time, unless the forward was still
        # running when they returned (then the wait for its logits is the forward's). On a GPU
        # a forward that ended during the starts ended at some unknown point of them: its time
        # is reported but does not teach the cost model (it would be short of the device's).
        busy = beside and self._batch_end is not None and not self._batch_end.query()
        excluded = starts_done - launched if beside and not busy else 0.0
        unsure = beside and self._batch_end is not None and not busy
        self._first_token(seq, logits, cached, own, t0 + excluded, observe=not unsure)
        return True

    def _first_token(
        self, seq: _Seq, logits: torch.Tensor, cached: int, own: list[DevicePage], t0: float, *, observe: bool
    ) -> None:
        """Take ``seq``'s first token from its prefill ``logits`` (over ``cached`` prompt
        tokens, the rest in ``own``), hand its pages to the tree, start decoding."""
        cache, ps, req, prompt = self.cache, self.page_size, seq.req, seq.prompt
        assert req is not None
        token = int(logits.argmax())  # waits for the GPU
        now = time.perf_counter()
        if observe and not self.runner.captured_last:
            # NOTE: a forward that captured a CUDA graph is one-time setup, not a sample of
            # the recompute cost (it would teach the cost model a slope near 0).
            cache.observe_prefill(len(prompt) - cached, max(now - t0, 0.0))
        self.stats.prefills += 1
        self.stats.prefill_tokens += len(prompt) - cached
        self.stats.prefill_s += now - t0
        seq.prefill_s = now - t0
        seq.ttft = now - seq.arrived
        self.cache.metrics.observe_ttft(seq.ttft)
        seq.first_logits = logits.float().cpu()
        seq.cached = req.cached_len
        aligned = len(prompt) - len(prompt) % ps
        t0 = time.perf_counter()
        try:
            cache.insert(req, own[: max(0, aligned // ps - req.cached_len // ps)])
            # Tokens [0, cached_len) now read from the tree's pages, the rest from our own
            # (cached_len < aligned where the tree refused pages: a transfer is in flight there).
            seq.pages = cache.prefix_pages(req) + own[(req.cached_len - cached) // ps :]
            seq.out.append(token)
            # NOTE: here, not after: a request left READY past its insert would be prefilled
            # again over the tree's pages
            seq.state = SeqState.DECODING
        except BaseException as exc:
            if not isinstance(exc, HiCacheError):
                # NOTE: cut short (Ctrl-C), its pages may be the tree's already: prefilled
                # again over them, it would write the tree's pages. It ends here instead.
                try:
                    self._fail(seq, f"interrupted: {type(exc).__name__}")
                except HiCacheError as failure:  # NOTE: the interrupt is what the caller hears
                    log.warning("hicache engine: giving back request %d failed: %r", seq.id, failure)
            raise
        self.stats.cache_s += time.perf_counter() - t0
        if len(seq.out) >= seq.max_new:
            self._complete(seq)

    def _decode(self, seqs: list[_Seq]) -> None:
        """One decode batch; the restores admitted in this step start after it is launched
        and before its tokens are read (on a GPU their host work overlaps the batch).

        Accounting: the batch's time counts as overlap for a restore started beside it only
        from the restore's start, and only while the batch was still running on the device
        when the last start returned (its end is then when its tokens came back); a batch
        that ended during the starts (on a CPU: before them) credits them nothing, and its
        own time excludes the starts' host time."""
        t0 = time.perf_counter()
        batch = [([s.out[-1]], s.pages, len(s.prompt) + len(s.out) - 1) for s in seqs]
        beside = bool(self._starting)
        pending = any(s.restore is not None for s in self._active.values() if s.state is SeqState.RESTORING)
        mark = self.runner.mark() if beside else None
        launched = starts_done = t0
        busy = False
        try:
            try:
                picked = self.runner.forward(batch).argmax(-1)
                launched = time.perf_counter()  # on a CPU the batch has run by now
                if beside and self._batch_end is not None:
                    self._batch_end.record()
            finally:
                with self.runner.after(mark):  # their copies wait for what came before the batch only
                    self._start_restores(beside="decode")
            starts_done = time.perf_counter()
            busy = beside and self._batch_end is not None and not self._batch_end.query()
            tokens = picked.tolist()  # waits for the GPU
        except torch.OutOfMemoryError as exc:
            for seq in seqs:
                self._fail(seq, f"OutOfMemoryError in decode: {exc}")
            return
        now = time.perf_counter()
        if not self.cuda:
            ended, seconds = launched, launched - t0
        elif not beside or busy:
            ended, seconds = now, now - t0
        else:
            ended, seconds = launched, now - t0 - (starts_done - launched)
        self.stats.decode_batches += 1
        self.stats.decode_tokens += len(seqs)
        self.stats.decode_s += seconds
        part = seconds if pending else max(0.0, min(seconds, ended - launched)) if beside else 0.0
        if part > 0:
            self.stats.decode_s_while_restoring += part
        if pending or beside:
            self.cache.note_decode(seconds, ended=ended)
        for seq, token in zip(seqs, tokens, strict=True):
            seq.out.append(int(token))
            if len(seq.out) >= seq.max_new:
                self._complete(seq)

    # NOTE: each way out emits first, then forgets the request, then gives back what it holds:
    # an interrupt between any two leaves it out once, and what it holds to _tidy.

    def _complete(self, seq: _Seq) -> None:
        assert seq.req is not None
        self._emit(seq)
        self.stats.finished += 1
        del self._active[seq.id]
        t0 = time.perf_counter()
        self.cache.release(seq.req)
        self.stats.cache_s += time.perf_counter() - t0

    def _fail(self, seq: _Seq, why: str) -> None:
        if not seq.emitted:  # NOTE: failed once already when an exception passes two handlers
            self.stats.errors += 1
            self._emit(seq, error=why)
        self._active.pop(seq.id, None)
        self._drop(seq)

    def _emit(self, seq: _Seq, error: str | None = None) -> None:
        out = Output(
            seq.id,
            list(seq.out),
            seq.first_logits,
            seq.ttft,
            time.perf_counter() - seq.arrived,
            seq.cached,
            seq.restored_from,
            seq.restore_failed,
            error,
            seq.restore_wait,
            seq.prefill_s,
        )
        with interrupts.held():  # NOTE: flagged without its Output (or the reverse), it is lost (or doubled)
            self._finished.append(out)
            seq.emitted = True

    def status(self) -> dict[str, object]:
        """Queue, states, counters, graph use and the cache's status (JSON-ready)."""
        self._check_open()
        return {
            "waiting": len(self._waiting),
            "active": {st.value: sum(1 for s in self._active.values() if s.state is st) for st in SeqState},
            "stats": dataclasses.asdict(self.stats),
            "graphs": {"replays": self.runner.graph_replays, "eager": self.runner.eager_forwards},
            "cache": self.cache.status().to_dict(),
        }

    def close(self) -> None:
        """Abort everything in flight, then close the cache (drains its transfers) and the
        model runner (hands its CUDA streams on to the next engine's)."""
        if self.cache.closed:
            return
        self._check_thread()
        for rid in [s.id for s in self._waiting] + list(self._active):
            self.abort(rid)
        self._finished.clear()
        self.cache.close()
        self.runner.close()

    def __enter__(self) -> Engine:
        self._check_open()
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
