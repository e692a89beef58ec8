"""Shared set-up for backend tests: pools filled with random (never zero) data."""

from __future__ import annotations

import torch

from hicache.backends.pools import DevicePool, HostPool
from hicache.backends.storage import StorageBackend, StorageFile
from hicache.backends.transfer import TransferBackend, TransferEngine
from hicache.core.geometry import KVGeometry


def stack(
    page_size: int,
    dtype: torch.dtype,
    *,
    device: str = "cpu",
    backend: TransferBackend = "torch",
    l1: int = 12,
    l2: int = 10,
    l3: int = 10,
    layers: int = 3,
    heads: int = 2,
    head_dim: int = 8,
    seed: int = 0,
) -> tuple[DevicePool, HostPool, TransferEngine, StorageBackend]:
    g = KVGeometry(layers, heads, head_dim, page_size, dtype)
    gen = torch.Generator().manual_seed(seed)
    dev = DevicePool.allocate(g, l1, device)
    dev.buffer.copy_(torch.randn(dev.buffer.shape, generator=gen).to(dtype))
    host = HostPool(g, l2)
    host.page_buffer.copy_(torch.randn(host.page_buffer.shape, generator=gen).to(dtype))
    return dev, host, TransferEngine(dev, host, backend), StorageBackend(StorageFile(g, l3), host)


def l1_page(pool: DevicePool, page: int) -> torch.Tensor:
    """One L1 page as a CPU tensor in L2 page order ``[2, layer, token, head, dim]``."""
    return pool.buffer[:, :, page].cpu()
