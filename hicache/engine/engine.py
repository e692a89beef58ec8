"""A minimal reference engine: one request at a time, greedy decoding, prefix caching
through :class:`~hicache.HiCache` (blocking restores).

Without ``enable_hicache`` the engine keeps an L1-only prefix cache (no L2/L3, policy
``never``). Continuous batching and the overlap loop (decode while a restore is pending)
are not here yet.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch

from hicache.backends.transfer import TransferBackend
from hicache.core.cost import CostPriors
from hicache.engine.model import ModelRunner, build_model, kv_geometry
from hicache.errors import ConfigError
from hicache.facade import HiCache, HiCacheConfig


@dataclass(frozen=True)
class Output:
    tokens: list[int]  # generated tokens
    first_logits: torch.Tensor  # logits of the first generated token (CPU, float32)
    ttft_s: float  # admit -> first token (includes any restore)
    cached_tokens: int  # prompt tokens not recomputed (L1 hit + restored)
    restored_from: str  # "L1" (nothing restored), "L2" or "L3"


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
        policy: str = "cost",
        transfer_backend: TransferBackend = "auto",
        priors: CostPriors | None = None,
        seed: int = 0,
        net: torch.nn.Module | None = None,
    ) -> None:
        self.net = net if net is not None else build_model(model, device=device, dtype=dtype, seed=seed)
        geometry = kv_geometry(self.net, page_size)
        if enable_hicache and not l2_pages:
            raise ConfigError("enable_hicache needs l2_pages > 0")
        self.enabled = enable_hicache
        self.cache = HiCache(
            HiCacheConfig(
                geometry,
                l1_pages=num_pages,
                l2_pages=l2_pages if enable_hicache else 0,
                l3_pages=l3_pages if enable_hicache else 0,
                storage_path=storage_path,
                policy=policy if enable_hicache else "never",
                transfer_backend=transfer_backend,
                priors=priors or CostPriors(),
                device=str(device),
            )
        )
        self.runner = ModelRunner(self.net, self.cache.l1)
        self.page_size = page_size
        self.cuda = torch.device(device).type == "cuda"

    def _sync(self) -> None:
        if self.cuda:
            torch.cuda.synchronize()

    def generate(self, prompt: list[int], max_new_tokens: int = 1) -> Output:
        """Serve one request: match, restore (per policy), prefill the rest, decode."""
        if max_new_tokens < 1:
            raise ConfigError(f"max_new_tokens must be >= 1, got {max_new_tokens}")
        cache, ps = self.cache, self.page_size
        t0 = time.perf_counter()
        req = cache.admit(prompt)
        try:
            restored_from = "L1"
            if self.enabled:
                plan = cache.plan(req)
                if cache.restore(req, plan):
                    restored_from = plan.tier.name
            # NOTE: at least the last prompt token is computed (its logits start decoding);
            # when the whole prompt is cached, its last page is recomputed into a private
            # page and the tree's shared copy is left untouched.
            cached = min(req.cached_len, (len(prompt) - 1) // ps * ps)
            total = len(prompt) + max_new_tokens
            need = -(-total // ps) - cached // ps
            own = cache.allocate(req, need)
            if own is None:
                raise MemoryError(f"no room for {need} L1 pages (pool of {cache.core.sizes.l1_pages})")
            pages = cache.prefix_pages(req)[: cached // ps] + own
            t1 = time.perf_counter()
            logits = self.runner.forward([(prompt[cached:], pages, cached)])[0]
            token = int(logits.argmax())
            self._sync()
            ttft = time.perf_counter() - t0
            cache.observe_prefill(len(prompt) - cached, time.perf_counter() - t1)
            aligned = len(prompt) - len(prompt) % ps
            cache.insert(req, own[: max(0, aligned // ps - req.cached_len // ps)])
            # Tokens [0, aligned) now read from the tree's pages, the rest from our own.
            pages = cache.prefix_pages(req) + own[(aligned - cached) // ps :]
            out = [token]
            for i in range(max_new_tokens - 1):
                logits_i = self.runner.forward([([out[-1]], pages, len(prompt) + i)])[0]
                out.append(int(logits_i.argmax()))
            cache.poll()
            return Output(out, logits.float().cpu(), ttft, req.cached_len, restored_from)
        finally:
            cache.release(req)

    def close(self) -> None:
        self.cache.close()
