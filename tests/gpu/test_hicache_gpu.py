"""HiCache on CUDA: a prefix restored from L3 after L1 and L2 eviction is bit-identical."""

from __future__ import annotations

import pytest
import torch

from hicache import HiCache, HiCacheConfig
from hicache.backends.transfer import TransferBackend, TransferEngine
from hicache.core.geometry import KVGeometry
from hicache.errors import ConfigError
from hicache.spec.model import Tier

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]


@pytest.mark.parametrize("backend", ["auto", "torch"])
@pytest.mark.parametrize("blocking", [True, False])
@pytest.mark.parametrize("page_size", [1, 2, 16])
def test_restore_from_l3_on_cuda(page_size: int, blocking: bool, backend: TransferBackend) -> None:
    g = KVGeometry(4, 2, 64, page_size, torch.bfloat16)
    tokens = list(range(96))
    pages = len(tokens) // page_size
    c = HiCache(
        HiCacheConfig(
            g,
            l1_pages=2 * pages,
            l2_pages=2 * pages,
            l3_pages=2 * pages,
            policy="always",
            device="cuda",
            tracing=True,
            transfer_backend=backend,
        )
    )
    req = c.admit(tokens)
    own = c.allocate(req, pages)
    assert own is not None
    c.l1.buffer[:, :, own] = torch.randn(c.l1.buffer[:, :, own].shape, device="cuda").to(g.dtype)
    want = c.l1.buffer[:, :, own].clone()
    c.insert(req, own)
    c.release(req)
    while c.status().pending_backups:
        c.poll()
    assert c.core.match(tokens).lengths == (96, 96, 96)
    c.core.evict(Tier.L1, 10**6)
    c.core.evict(Tier.L2, 10**6)
    c.l1.buffer.normal_()  # L1 garbage: the bytes must come back from the file
    req = c.admit(tokens)
    plan = c.plan(req)
    assert plan.tier is Tier.L3
    if blocking:
        assert c.restore(req, plan)
    else:
        pending = c.start_restore(req, plan)
        assert pending is not None
        while not pending.finished:
            c.poll()
        assert pending.stage == "done"
    torch.cuda.synchronize()
    assert req.cached_len == 96
    assert torch.equal(c.l1.buffer[:, :, c.prefix_pages(req)], want)
    m = c.metrics
    assert m.hit_tokens["L3"] == 96 and m.promotions >= 1 and m.restores == 1
    assert m.directions["S2H"].bytes == m.directions["H2D"].bytes == pages * g.bytes_per_page
    c.check_integrity()
    c.release(req)
    c.close()


def test_the_ring_paths_are_set_up_when_the_cache_is_built(monkeypatch: pytest.MonkeyPatch) -> None:
    """The index buffers and the kernel choice (autotune, compiles) exist before any
    transfer, the ring is freed again until a transfer needs it: a workload whose copies
    take the copy and straight paths first would otherwise pay the setup in its first
    fragmented restore, seconds into serving. A setup that fails otherwise than for memory
    is a ConfigError at construction."""
    g = KVGeometry(4, 2, 64, 16, torch.bfloat16)

    def build(backend: TransferBackend) -> HiCache:
        return HiCache(HiCacheConfig(g, l1_pages=64, l2_pages=64, device="cuda", transfer_backend=backend))

    c = build("auto")
    dev = c.device
    assert dev._ids is not None and dev.gather_backend is not None and dev.scatter_backend is not None
    assert dev.status()["workspaces"] == 0 and sum(dev.paths.values()) == 0  # the ring waits for its first use
    c.close()

    def broken(self: TransferEngine) -> None:
        raise RuntimeError("no Triton here")  # what an explicit backend's first launch raises

    monkeypatch.setattr(TransferEngine, "_choose", broken)
    with pytest.raises(ConfigError, match="setup failed \\(backend 'triton'\\)"):
        build("triton")
