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


@pytest.mark.parametrize(
    ("stream", "current", "raw"),
    [
        (0x5000, 0, True),  # a stream of its own: its handle names it on any device
        (0x5000, 1, True),
        (0, 1, True),  # the default stream, the engine's device current
        (0, 0, False),  # the default stream, another device current: "0" would mean that one's
        (1, 0, False),  # the legacy and the per-thread default stream alike
        (2, 0, False),
    ],
)
def test_the_raw_caller_wait_leaves_a_default_stream_of_another_device_to_torch(
    monkeypatch: pytest.MonkeyPatch, stream: int, current: int, raw: bool
) -> None:
    """The caller's-stream wait on raw handles records the engine's event on the caller's
    stream of the engine's device (1 here). A default-stream handle is resolved by the
    runtime on the current device: with another one current, the raw wait is declined
    (the caller then waits through torch, which sets the device), never recorded there."""
    calls: list[tuple[int, int, int]] = []
    monkeypatch.setattr(dma, "_RAW_STREAM", lambda device: stream if device == 1 else -1)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: current)
    monkeypatch.setattr(dma, "record_wait", lambda event, on, waiter: calls.append((event, on, waiter)))
    assert dma.record_wait_current(0xE, 0xF, 1) is raw
    assert calls == ([(0xE, stream, 0xF)] if raw else [])
