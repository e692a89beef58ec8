"""The copy path (one strided DMA per page on the copy engine) on CPU, where the same
address arithmetic runs as host copies: bit-exact, nothing else written, any layout."""

from __future__ import annotations

import pytest
import torch

from hicache.backends import dma
from hicache.backends.transfer import TransferEngine
from tests.backends.test_ring import pools, round_trip


@pytest.mark.parametrize("fragmented", [False, True])
@pytest.mark.parametrize("n", [1, 2, 7, 24])
def test_the_copy_path_round_trips_bit_exactly(n: int, fragmented: bool) -> None:
    l1, l2 = pools(24, layers=3, seed=n)
    eng = TransferEngine(l1, l2, "torch", copy_max_pages=64, direct_max_bytes=0)
    round_trip(eng, n, fragmented, seed=n)
    assert eng.paths["copy"] == 2 and eng.paths["ring"] == 0
    assert eng.status()["workspace_device_bytes"] == 0  # no ring: nothing allocated


def test_larger_transfers_leave_the_copy_path() -> None:
    l1, l2 = pools(24)
    eng = TransferEngine(l1, l2, "torch", copy_max_pages=4, direct_max_bytes=0)
    round_trip(eng, 8, True, seed=1)
    assert eng.paths["copy"] == 0 and eng.paths["ring"] == 2


def test_the_copy_path_is_off_on_cpu_by_default() -> None:
    l1, l2 = pools(8)
    assert not TransferEngine(l1, l2, "torch").copy_usable


def test_copy_batch_puts_each_copy_in_its_place() -> None:
    """Host form of the batched DMA (the ring's per-run copies): each ``(dst, src, nbytes)``
    lands where its addresses say, a zero-size copy writes nothing, other bytes untouched."""
    src = torch.arange(1, 65, dtype=torch.uint8)
    dst = torch.zeros(64, dtype=torch.uint8)
    d, s = dst.data_ptr(), src.data_ptr()
    dma.copy_batch([(d + 40, s, 8), (d, s + 16, 4), (d + 20, s + 30, 0)], None)
    want = torch.zeros(64, dtype=torch.uint8)
    want[40:48], want[0:4] = src[0:8], src[16:20]
    assert torch.equal(dst, want)


def test_copy_rows_batch_puts_each_strided_copy_in_its_place() -> None:
    """Host form of the batched strided DMAs (the copy path, the layered paths): each
    ``(dst, dpitch, src, spitch, width, rows)`` copies ``rows`` rows of ``width`` bytes, each
    side's rows its pitch apart; empty copies write nothing; other bytes untouched."""
    src = torch.arange(1, 129, dtype=torch.uint8)
    dst = torch.zeros(128, dtype=torch.uint8)
    d, s = dst.data_ptr(), src.data_ptr()
    dma.copy_rows_batch([(d, 8, s + 1, 16, 3, 4), (d + 64, 4, s + 100, 2, 2, 3), (d + 120, 1, s, 1, 0, 5)], None)
    want = torch.zeros(128, dtype=torch.uint8)
    for r in range(4):
        want[8 * r : 8 * r + 3] = src[1 + 16 * r : 4 + 16 * r]
    for r in range(3):
        want[64 + 4 * r : 66 + 4 * r] = src[100 + 2 * r : 102 + 2 * r]
    assert torch.equal(dst, want)


def test_the_batch_table_holds_each_copy_where_the_driver_reads_it() -> None:
    """CUDA_MEMCPY3D_BATCH_OP as the driver lays it out (112 bytes; field offsets of cuda.h,
    checked against cuda-python's struct on the GPU): pointer operands, each side's pitch as
    its row length, depth 1, reads in stream order."""
    import numpy as np

    table = dma.ops([(0x1000, 4096, 0x2000, 512, 256, 7), (0xA0, 64, 0xB0, 32, 16, 1)])
    raw = table.tobytes()
    assert table.dtype.itemsize == 112 and len(raw) == 224

    def u(at: int, size: int = 8) -> int:
        return int.from_bytes(raw[at : at + size], "little")

    assert (u(0, 4), u(8), u(16), u(24)) == (1, 0x2000, 512, 7)  # src: type, ptr, row length, layer height
    assert (u(40, 4), u(48), u(56), u(64)) == (1, 0x1000, 4096, 7)  # dst
    assert (u(80), u(88), u(96), u(104, 4), u(108, 4)) == (256, 7, 1, 1, 0)  # extent, order, flags
    assert (u(112 + 8), u(112 + 48), u(112 + 80), u(112 + 88)) == (0xB0, 0xA0, 16, 1)
    assert not np.frombuffer(raw, dtype=np.uint8)[[*range(4, 8), *range(32, 40), *range(72, 80)]].any()
