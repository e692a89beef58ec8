"""``HiCache``: the one object an engine embeds. The only module that knows both the core
and the concrete backends; it wires them from a :class:`HiCacheConfig`."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import xxhash

from hicache.backends.faults import FaultInjector
from hicache.backends.pools import DevicePool, HostPool
from hicache.backends.storage import StorageBackend, StorageFile
from hicache.backends.transfer import TransferBackend, TransferEngine
from hicache.core.cache import CacheCore
from hicache.core.controller import Controller, WritePolicy
from hicache.core.cost import CostModel, CostPriors, Policy
from hicache.core.geometry import KVGeometry, TierSizes
from hicache.core.node import Transfer
from hicache.errors import ConfigError
from hicache.spec.model import Direction


@dataclass(frozen=True)
class HiCacheConfig:
    """Everything an engine chooses. L2/L3 of 0 pages disable that tier."""

    geometry: KVGeometry
    l1_pages: int
    l2_pages: int = 0
    l3_pages: int = 0
    storage_path: str | None = None  # None: an unnamed 0600 file that vanishes with us
    storage_direct: bool = False
    storage_workers: int = 4
    checksums: bool = True
    transfer_backend: TransferBackend = "auto"
    policy: Policy | str = Policy.COST
    write_policy: WritePolicy | str = WritePolicy.WRITE_THROUGH
    selective_hits: int = 2
    priors: CostPriors = field(default_factory=CostPriors)
    device: str = "cuda" if torch.cuda.is_available() else "cpu"
    tracing: bool = False  # check every state change against the spec (tests)
    verify_pages: bool = False  # digest every moved page and check it on arrival (slow; soak/bench)

    def __post_init__(self) -> None:
        if not isinstance(self.geometry, KVGeometry):
            raise ConfigError(f"geometry must be a KVGeometry, got {self.geometry!r}")
        TierSizes(self.l1_pages, self.l2_pages, self.l3_pages)  # validates the sizes
        if self.l3_pages and not self.l2_pages:
            raise ConfigError("L3 needs L2 (pages reach the file through host memory): set l2_pages")
        for name, kind in (("policy", Policy), ("write_policy", WritePolicy)):
            value = getattr(self, name)
            if value not in {k.value for k in kind}:
                raise ConfigError(f"{name} must be one of {[k.value for k in kind]}, got {value!r}")
        if self.transfer_backend not in ("auto", "triton", "torch"):
            raise ConfigError(f"transfer_backend must be auto, triton or torch, got {self.transfer_backend!r}")


_DIGEST_CHUNK = 8  # L1 pages staged per host copy when digesting (verify_pages)


class HiCache(Controller):
    """A :class:`Controller` over real pools: L1 (the engine's tensor, or one we allocate),
    pinned L2, and an L3 file."""

    def __init__(self, config: HiCacheConfig, l1_buffer: torch.Tensor | None = None) -> None:
        g = config.geometry
        self.config = config
        self.faults = FaultInjector()
        if l1_buffer is not None and l1_buffer.device.type != torch.device(config.device).type:
            raise ConfigError(f"L1 tensor is on {l1_buffer.device}, config.device is {config.device!r}")
        l1 = (
            DevicePool(g, l1_buffer)
            if l1_buffer is not None
            else DevicePool.allocate(g, config.l1_pages, config.device)
        )
        if l1.num_pages != config.l1_pages:
            raise ConfigError(f"L1 tensor has {l1.num_pages} pages, config says {config.l1_pages}")
        self.l1 = l1
        self._page_digest: dict[int, int] = {}  # L2 page -> digest (verify_pages)
        self._slot_digest: dict[int, int] = {}  # L3 slot -> digest (verify_pages)
        self._digest_staging: torch.Tensor | None = None  # host copy of L1 pages being digested
        self.l2 = HostPool(g, max(1, config.l2_pages))
        engine = TransferEngine(l1, self.l2, config.transfer_backend, faults=self.faults)
        storage = None
        if config.l3_pages:
            file = StorageFile(g, config.l3_pages, config.storage_path, direct=config.storage_direct)
            storage = StorageBackend(
                file, self.l2, workers=config.storage_workers, checksums=config.checksums, faults=self.faults
            )
        core = CacheCore(
            g.page_size, TierSizes(config.l1_pages, config.l2_pages, config.l3_pages), tracing=config.tracing
        )
        super().__init__(
            core,
            engine,
            storage,
            CostModel(g.bytes_per_token, config.priors, config.policy),
            write_policy=config.write_policy,
            selective_hits=config.selective_hits,
            bytes_per_page=g.bytes_per_page,
        )

    # -- page verification (verify_pages) ----------------------------------------------------

    def _digest_l1(self, pages: list[int]) -> list[int]:
        # NOTE: through one reused host buffer, a few pages at a time, hashing the buffer in
        # place: a fresh host tensor (and a bytes copy) per call, megabytes per page, made
        # glibc's heap grow by ~170 KB per request in the GPU soak.
        out: list[int] = []
        buf = self.l1.buffer
        for i in range(0, len(pages), _DIGEST_CHUNK):
            part = pages[i : i + _DIGEST_CHUNK]
            if self._digest_staging is None:
                shape = (_DIGEST_CHUNK, *buf.shape[:2], *buf.shape[3:])  # L2 page layout
                self._digest_staging = torch.empty(shape, dtype=buf.dtype, pin_memory=buf.is_cuda)
            staged = self._digest_staging[: len(part)]
            staged.copy_(buf[:, :, part].permute(2, 0, 1, 3, 4, 5))
            rows = staged.view(len(part), -1).view(torch.uint8).numpy()
            out.extend(xxhash.xxh3_64_intdigest(row) for row in rows)
        return out

    def _digest_l2(self, pages: list[int]) -> list[int]:
        rows = self.l2.bytes.numpy()  # [page, bytes_per_page], shares memory
        return [xxhash.xxh3_64_intdigest(rows[p]) for p in pages]

    def _verify(self, transfer: Transfer) -> str | None:
        """With ``verify_pages``: a page's digest is taken where it was computed (L1, at the
        D2H) and checked at every arrival — in L2 after D2H and S2H, in L1 after H2D. L3 reads
        are also checked by the storage's own per-page checksums."""
        if not self.config.verify_pages:
            return None
        d, src, dst = transfer.direction, list(transfer.src), list(transfer.dst)
        if d is Direction.H2S:
            for s, t in zip(src, dst, strict=True):
                self._slot_digest[t] = self._page_digest.get(s) or self._digest_l2([s])[0]
            return None
        if d is Direction.D2H:
            want = self._digest_l1(src)
        elif d is Direction.S2H:
            want = [self._slot_digest.get(s) for s in src]  # type: ignore[misc]
        else:
            want = [self._page_digest.get(s) for s in src]  # type: ignore[misc]
        got = self._digest_l1(dst) if d is Direction.H2D else self._digest_l2(dst)
        self.metrics.verified_pages += len(dst)
        bad = next((i for i, (w, g) in enumerate(zip(want, got, strict=True)) if w is not None and w != g), None)
        if bad is not None:
            return f"{d.name}: page {dst[bad]} differs from the page saved (digest mismatch at position {bad})"
        if d is not Direction.H2D:
            self._page_digest.update(zip(dst, got, strict=True))
        return None
