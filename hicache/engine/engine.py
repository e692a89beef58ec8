"""The reference engine: continuous batching, greedy decoding, prefix caching through
:class:`~hicache.HiCache`, and the overlap loop.

One scheduler thread owns everything. Each :meth:`Engine.step`:

1. polls the cache: restores that finished (published, failed or cancelled) make their
   requests ready to prefill (a failed restore means the request recomputes);
2. admits waiting requests up to ``max_batch``: match, pin the L1 hit, ask the cost model
   (``plan``); a restore from L2/L3 is *started* and the request parks until it is published
   (with ``prefetch=False`` the restore blocks here instead, the seed's baseline). A
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
   the restore time hidden behind useful work.

Without ``enable_hicache`` the engine keeps its L1 prefix cache (policy ``never``, no L2/L3)
and no transfer ever runs.
"""

from __future__ import annotations

import itertools
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Literal, get_args

import torch

from hicache.backends.transfer import TransferBackend
from hicache.core.controller import PendingRestore, Request, WritePolicy
from hicache.core.cost import CostPriors
from hicache.core.geometry import DevicePage
from hicache.core.tokens import as_tokens
from hicache.engine.model import AttentionImpl, CudnnUse, ModelRunner, build_model, kv_geometry
from hicache.errors import ConfigError
from hicache.facade import HiCache, HiCacheConfig
from hicache.spec.model import Tier


@dataclass(frozen=True)
class Output:
    id: int
    tokens: list[int]  # generated tokens
    first_logits: torch.Tensor | None  # logits of the first generated token (CPU, float32)
    ttft_s: float  # submit -> first token (includes queueing and any restore)
    latency_s: float  # submit -> last token
    cached_tokens: int  # prompt tokens not recomputed (L1 hit + restored)
    restored_from: str  # "L1" (nothing restored), "L2" or "L3"
    restore_failed: bool = False  # a restore was planned but failed: the request recomputed
    error: str | None = None  # "aborted", or why the request could not be served
    restore_wait_s: float = 0.0  # restore started -> seen finished by a poll (0 without one)
    prefill_s: float = 0.0  # the prefill forward and its first token (GPU included)


State = Literal["waiting", "restoring", "ready", "decoding"]


@dataclass(eq=False)
class _Seq:
    id: int
    prompt: list[int]
    max_new: int
    arrived: float
    state: State = "waiting"
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
    own: list[DevicePage] = field(default_factory=list)  # private pages allocated ahead (layered restore)
    held: torch.Tensor | None = None  # logits of a layered prefill, valid once its restore is published
    held_cached: int = 0  # the prompt tokens that prefill read from the restored prefix
    held_prefix: list[DevicePage] = field(default_factory=list)  # the pages it read them from


@dataclass
class EngineStats:
    submitted: int = 0
    finished: int = 0
    aborted: int = 0
    errors: int = 0
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
    layered_launch_s: float = 0.0  # the part of it launching layered prefills
    restores_started: int = 0
    restores_failed: int = 0
    layered_prefills: int = 0  # launched beside their restore's copy
    layered_used: int = 0  # their logits served the request (the rest recomputed)
    idle_polls: int = 0
    cache_s: float = 0.0  # in hicache calls (bookkeeping; excludes blocking restore waits)


class Engine:
    def __init__(
        self,
        model: str = "tiny",
        *,
        device: str = "cuda" if torch.cuda.is_available() else "cpu",
        dtype: torch.dtype = torch.float32,
        page_size: int = 16,
        num_pages: int = 1024,
        enable_hicache: bool = False,
        l2_pages: int = 0,
        l3_pages: int = 0,
        storage_path: str | None = None,
        storage_direct: bool = False,
        policy: str = "cost",
        write_policy: WritePolicy | str = WritePolicy.WRITE_THROUGH,
        transfer_backend: TransferBackend = "auto",
        priors: CostPriors | None = None,
        prefetch: bool = True,
        max_batch: int = 32,
        prefills_before_decode: int = 1,
        cuda_graphs: bool = True,
        graph_short_prefills: bool | None = None,
        attention: AttentionImpl = "auto",
        cudnn: CudnnUse = "off",
        verify_pages: bool = False,
        layered_restore: bool | None = None,
        seed: int = 0,
        net: torch.nn.Module | None = None,
    ) -> None:
        if max_batch < 1:
            raise ConfigError(f"max_batch must be >= 1, got {max_batch}")
        if prefills_before_decode < 1:
            raise ConfigError(f"prefills_before_decode must be >= 1, got {prefills_before_decode}")
        if enable_hicache and not l2_pages:
            raise ConfigError("enable_hicache needs l2_pages > 0")
        self.net = net if net is not None else build_model(model, device=device, dtype=dtype, seed=seed)
        geometry = kv_geometry(self.net, page_size)
        self.enabled = enable_hicache
        self.prefetch = prefetch
        self.max_batch = max_batch
        self.cache = HiCache(
            HiCacheConfig(
                geometry,
                l1_pages=num_pages,
                l2_pages=l2_pages if enable_hicache else 0,
                l3_pages=l3_pages if enable_hicache else 0,
                storage_path=storage_path,
                storage_direct=storage_direct,
                policy=policy if enable_hicache else "never",
                write_policy=write_policy,
                transfer_backend=transfer_backend,
                priors=priors or CostPriors(),
                device=str(device),
                verify_pages=verify_pages,
            )
        )
        groups = getattr(self.cache.device, "layer_groups", None)
        self.runner = ModelRunner(
            self.net,
            self.cache.l1,
            cuda_graphs=cuda_graphs,
            graph_short_prefills=graph_short_prefills,
            attention=attention,
            cudnn=cudnn,
            layer_groups=groups() if groups is not None else None,
        )
        if layered_restore and enable_hicache and not prefetch:
            raise ConfigError("layered_restore needs prefetch (a blocking restore has no forward to overlap)")
        if layered_restore is None:  # auto: where the copy can signal layers as they land
            layered_restore = bool(getattr(self.cache.device, "layered", False))
        self.layered = layered_restore and enable_hicache and prefetch  # without hicache nothing restores
        self.page_size = page_size
        self.cuda = torch.device(device).type == "cuda"
        self.stats = EngineStats()
        self._ids = itertools.count(1)
        self._waiting: deque[_Seq] = deque()
        self._active: dict[int, _Seq] = {}  # restoring, ready or decoding, in arrival order
        self._finished: list[Output] = []
        self.prefills_before_decode = prefills_before_decode
        self._prefills_in_row = 0

    # -- requests ----------------------------------------------------------------------------

    def submit(self, prompt: list[int], max_new_tokens: int = 1) -> int:
        """Queue a request; returns its id. Served by :meth:`step`."""
        if isinstance(max_new_tokens, bool) or not isinstance(max_new_tokens, int) or max_new_tokens < 1:
            raise ConfigError(f"max_new_tokens must be an int >= 1, got {max_new_tokens!r}")
        toks = as_tokens(prompt)  # one C-level pass; raises MisuseError naming a bad token
        vocab = int(getattr(self.net.config, "vocab_size", 0))
        if min(toks) < 0 or max(toks) >= vocab:
            bad = next(t for t in toks if not 0 <= t < vocab)
            raise ConfigError(f"prompt token {bad!r} is not in [0, {vocab})")
        seq = _Seq(next(self._ids), list(toks), max_new_tokens, time.perf_counter())
        self._waiting.append(seq)
        self.stats.submitted += 1
        return seq.id

    def abort(self, rid: int) -> bool:
        """Abort a request wherever it is (queued, restoring, decoding). Its pages and pins go
        back at once; a restore in flight completes in the background into the tree. False if
        the request is not known (finished or never submitted)."""
        seq = self._active.pop(rid, None)
        if seq is None:
            seq = next((s for s in self._waiting if s.id == rid), None)
            if seq is None:
                return False
            self._waiting.remove(seq)
        if seq.held is not None:
            self.runner.join_layered()  # its pages go back now: later users wait for its writes
        if seq.req is not None:
            self.cache.release(seq.req)
        self.stats.aborted += 1
        self._emit(seq, error="aborted")
        return True

    @property
    def pending(self) -> int:
        """Requests submitted and not yet finished or aborted."""
        return len(self._waiting) + len(self._active)

    def step(self) -> list[Output]:
        """One scheduler iteration (see the module docstring); returns requests finished in it."""
        cache = self.cache
        t0 = time.perf_counter()
        finished = cache.poll()
        self.stats.cache_s += time.perf_counter() - t0
        for restore in finished:
            self._restored(restore)
        while self._waiting and len(self._active) < self.max_batch:
            self._admit(self._waiting.popleft())
        ready = next((s for s in self._active.values() if s.state == "ready"), None)
        decoding = [s for s in self._active.values() if s.state == "decoding"]
        ran = False
        restoring = any(s.state == "restoring" for s in self._active.values())
        if ready is not None and not (decoding and self._prefills_in_row >= self.prefills_before_decode):
            t0 = time.perf_counter()
            ran = self._prefill(ready)
            self._prefills_in_row += ran
            if ran and restoring:
                self.stats.prefill_s_while_restoring += time.perf_counter() - t0
        if not ran:
            if decoding:
                self._decode(decoding, restoring)
                self._prefills_in_row = 0
            elif ready is not None and not restoring:
                self._fail(ready, f"no room in L1 for a prompt of {len(ready.prompt)} tokens")
            elif self._active:
                self.stats.idle_polls += 1
                t0 = time.perf_counter()
                if all(s.held is not None for s in self._active.values()):
                    # NOTE: only layered restores in flight, each with its forward queued
                    # behind its layers: wait for the GPU instead of polling every 50 us.
                    self.runner.wait_layered()
                else:
                    time.sleep(50e-6)  # only restores in flight: let the copy engine / disk work
                self.stats.idle_s_while_restoring += time.perf_counter() - t0
        done, self._finished = self._finished, []
        return done

    def run(self) -> list[Output]:
        """Step until every submitted request has finished; outputs in completion order."""
        outs: list[Output] = []
        while self.pending:
            outs.extend(self.step())
        return outs

    def generate(self, prompt: list[int], max_new_tokens: int = 1) -> Output:
        """Serve one request to completion (other queued requests are served alongside)."""
        rid = self.submit(prompt, max_new_tokens)
        while True:
            for out in self.step():
                if out.id == rid:
                    if out.error is not None:
                        raise MemoryError(out.error)
                    return out

    # -- scheduling --------------------------------------------------------------------------

    def _admit(self, seq: _Seq) -> None:
        cache = self.cache
        t0 = time.perf_counter()
        seq.req = cache.admit(seq.prompt)
        self._active[seq.id] = seq
        seq.state = "ready"
        plan = cache.plan(seq.req) if self.enabled else None
        self.stats.cache_s += time.perf_counter() - t0
        if plan is None or plan.tier is Tier.L1:
            return
        seq.restored_from = plan.tier.name
        self.stats.restores_started += 1
        if not self.prefetch:
            if not cache.restore(seq.req, plan):
                self._restore_failed(seq)
            return
        t0 = seq.restore_started = time.perf_counter()
        layered = self.layered and plan.tier is Tier.L2 and not self.runner.layered_busy
        events = self.runner.layer_events if layered else None
        seq.restore = cache.start_restore(seq.req, plan, layer_events=events)
        self.stats.cache_s += time.perf_counter() - t0
        if seq.restore is None:
            self._restore_failed(seq)
            return
        seq.state = "restoring"
        if seq.restore.layered:
            self._launch_layered(seq)
        self.stats.restore_issue_s += time.perf_counter() - seq.restore_started

    def _launch_layered(self, seq: _Seq) -> None:
        """Allocate ``seq``'s own pages and launch its prefill over the prefix still landing."""
        restore, req, ps = seq.restore, seq.req, self.page_size
        assert restore is not None and restore.pages is not None and req is not None
        prompt = seq.prompt
        cached = min(len(restore.pages) * ps, (len(prompt) - 1) // ps * ps)
        need = -(-(len(prompt) + seq.max_new) // ps) - cached // ps
        t0 = time.perf_counter()
        own = self.cache.allocate(req, need)
        self.stats.cache_s += time.perf_counter() - t0
        if own is None:
            return  # no room now: the request prefills after its restore, as usual
        seq.own = own
        seq.held_cached = cached
        seq.held_prefix = restore.pages[: cached // ps]
        seq.held = self.runner.forward([(prompt[cached:], seq.held_prefix + own, cached)], layered=True)[0]
        self.stats.layered_prefills += 1
        self.stats.layered_launch_s += time.perf_counter() - t0

    def _restored(self, restore: PendingRestore) -> None:
        seq = self._active.get(self._by_request(restore.request))
        if seq is None or seq.restore is not restore:
            return  # aborted meanwhile: the pages went to the tree
        seq.state = "ready"
        seq.restore_wait = time.perf_counter() - seq.restore_started
        if restore.stage != "done":
            self._restore_failed(seq)
        if seq.held is None:
            return
        self.runner.join_layered()  # its logits and pages are read (or reused) on this stream now
        held, seq.held = seq.held, None
        req, cached = seq.req, seq.held_cached
        assert req is not None
        t0 = time.perf_counter()
        ps = self.page_size
        # Serve its logits only where the normal prefill would read exactly that prefix.
        same = (
            restore.stage == "done"
            and min(req.cached_len, (len(seq.prompt) - 1) // ps * ps) == cached
            and self.cache.prefix_pages(req)[: cached // ps] == seq.held_prefix
        )
        self.stats.cache_s += time.perf_counter() - t0
        if same:  # the prefix it read is the one published: serve its logits
            self.stats.layered_used += 1
            self._first_token(seq, held, cached, seq.own, time.perf_counter(), observe=False)

    def _by_request(self, req: Request) -> int:
        return next((s.id for s in self._active.values() if s.req is req), -1)

    def _restore_failed(self, seq: _Seq) -> None:
        seq.restored_from = "L1"
        seq.restore_failed = True
        self.stats.restores_failed += 1

    def _prefill(self, seq: _Seq) -> bool:
        """Prefill ``seq``'s uncached prompt tail; False (nothing changed) without L1 room."""
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
        logits = self.runner.forward([(prompt[cached:], pages, cached)])[0]
        self._first_token(seq, logits, cached, own, t0, observe=True)
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
            # NOTE: a forward that captured a CUDA graph is one-time setup, not a sample:
            # one such (22 tokens, ~0.5 s) in the recompute window fitted a slope of 0 on
            # the H200, and the cost policy recomputed for the next 32 requests.
            cache.observe_prefill(len(prompt) - cached, now - t0)
        self.stats.prefills += 1
        self.stats.prefill_tokens += len(prompt) - cached
        self.stats.prefill_s += now - t0
        seq.prefill_s = now - t0
        seq.ttft = now - seq.arrived
        seq.first_logits = logits.float().cpu()
        seq.cached = req.cached_len
        aligned = len(prompt) - len(prompt) % ps
        t0 = time.perf_counter()
        cache.insert(req, own[: max(0, aligned // ps - req.cached_len // ps)])
        # Tokens [0, cached_len) now read from the tree's pages, the rest from our own
        # (cached_len < aligned where the tree refused pages: a transfer is in flight there).
        seq.pages = cache.prefix_pages(req) + own[(req.cached_len - cached) // ps :]
        self.stats.cache_s += time.perf_counter() - t0
        seq.out.append(token)
        seq.state = "decoding"
        if len(seq.out) >= seq.max_new:
            self._complete(seq)

    def _decode(self, seqs: list[_Seq], restoring: bool) -> None:
        t0 = time.perf_counter()
        batch = [([s.out[-1]], s.pages, len(s.prompt) + len(s.out) - 1) for s in seqs]
        tokens = self.runner.forward(batch).argmax(-1).tolist()  # waits for the GPU
        seconds = time.perf_counter() - t0
        self.stats.decode_batches += 1
        self.stats.decode_tokens += len(seqs)
        self.stats.decode_s += seconds
        if restoring:
            self.stats.decode_s_while_restoring += seconds
            self.cache.note_decode(seconds)
        for seq, token in zip(seqs, tokens, strict=True):
            seq.out.append(int(token))
            if len(seq.out) >= seq.max_new:
                self._complete(seq)

    def _complete(self, seq: _Seq) -> None:
        del self._active[seq.id]
        assert seq.req is not None
        t0 = time.perf_counter()
        self.cache.release(seq.req)
        self.stats.cache_s += time.perf_counter() - t0
        self.stats.finished += 1
        self._emit(seq)

    def _fail(self, seq: _Seq, why: str) -> None:
        del self._active[seq.id]
        if seq.req is not None:
            self.cache.release(seq.req)
        self.stats.errors += 1
        self._emit(seq, error=why)

    def _emit(self, seq: _Seq, error: str | None = None) -> None:
        self._finished.append(
            Output(
                seq.id,
                seq.out,
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
        )

    def status(self) -> dict[str, object]:
        return {
            "waiting": len(self._waiting),
            "active": {st: sum(1 for s in self._active.values() if s.state == st) for st in get_args(State)},
            "stats": self.stats.__dict__.copy(),
            "graphs": {"replays": self.runner.graph_replays, "eager": self.runner.eager_forwards},
            "cache": self.cache.status().to_dict(),
        }

    def close(self) -> None:
        """Abort everything in flight, then close the cache (drains its transfers) and the
        model runner (hands its CUDA streams on to the next engine's)."""
        for rid in [s.id for s in self._waiting] + list(self._active):
            self.abort(rid)
        self._finished.clear()
        self.cache.close()
        self.runner.close()
