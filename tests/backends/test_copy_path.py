"""The copy path (one strided DMA per page on the copy engine) on CPU, where the same
address arithmetic runs as host copies: bit-exact, nothing else written, any layout."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from hicache.backends import dma
from hicache.backends.transfer import TransferEngine
from hicache.errors import PageOwnershipError
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


def test_current_stream_makes_each_streams_object_once_and_only_for_its_own_handle(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The caller's-stream lookup keeps torch's stream object per (device, raw handle): the
    same object while the handle stays, another for another handle or device, none kept
    where torch's object has another handle than the one looked up (it is made again)."""
    from hicache.backends import transfer

    raw = {0: 0x10, 1: 0x10}
    made: list[tuple[int, int]] = []

    class Stream:
        def __init__(self, device: int, handle: int) -> None:
            self.device, self.cuda_stream = device, handle

    def lookup(device: int) -> Stream:
        made.append((device, raw[device]))
        return Stream(device, raw[device] if device == 0 else 0x99)  # device 1: another handle

    monkeypatch.setattr(transfer, "_STREAMS", {})
    monkeypatch.setattr(transfer, "_RAW_STREAM", lambda device: raw[device])
    monkeypatch.setattr(torch.cuda, "current_stream", lookup)
    first = transfer.current_stream(0)
    assert transfer.current_stream(0) is first and made == [(0, 0x10)]
    raw[0] = 0x20
    other = transfer.current_stream(0)
    assert other is not first and other.cuda_stream == 0x20 and len(made) == 2
    raw[0] = 0x10
    assert transfer.current_stream(0) is first and len(made) == 2
    transfer.current_stream(1), transfer.current_stream(1)
    assert made[2:] == [(1, 0x10), (1, 0x10)]  # a mismatched handle is never kept
    for handle in range(0x100, 0x100 + 300):
        raw[0] = handle
        transfer.current_stream(0)
    assert len(transfer._STREAMS) <= 256


@pytest.mark.parametrize(
    "kind", ["list", "tuple", "range", "numpy ints", "tensor", "ndarray", "int32 tensor", "0-d tensors"]
)
def test_page_ids_in_any_integer_container_move_the_same_pages(kind: str) -> None:
    """A transfer's pages may come as numpy ints (read back from an array) or as a 1-D
    integer tensor or array, as the facade takes them: the same pages move, bit-exact."""
    import numpy as np

    def form(pages: list[int]) -> Any:
        if kind == "tuple":
            return tuple(pages)
        if kind == "range":
            return range(pages[0], pages[0] + len(pages))
        if kind == "numpy ints":
            return [np.int64(p) for p in pages]
        if kind in ("tensor", "int32 tensor"):
            return torch.tensor(pages, dtype=torch.int64 if kind == "tensor" else torch.int32)
        if kind == "ndarray":
            return np.array(pages, dtype=np.int32)
        if kind == "0-d tensors":
            return [torch.tensor(p) for p in pages]
        return pages

    l1, l2 = pools(16, seed=3)
    eng = TransferEngine(l1, l2, "torch", direct_max_bytes=0)
    want = l1.slabs[:, [4, 5, 6]].clone()
    assert eng.d2h(form([4, 5, 6]), form([9, 10, 11])).wait()
    assert torch.equal(l2.slabs[[9, 10, 11]], want.transpose(0, 1))
    assert eng.h2d(form([9, 10, 11]), form([1, 2, 3])).wait()
    assert torch.equal(l1.slabs[:, [1, 2, 3]], want)


@pytest.mark.parametrize(
    ("pages", "says"),
    [
        ([True], "is a bool"),
        ("np.True_", "is a bool"),
        ([1.0], "is not an int"),
        (["1"], "is not an int"),
        ("float tensor", "1-D sequence of ints"),
        ("2-D tensor", "1-D sequence of ints"),
        ("bool tensor", "1-D sequence of ints"),
        ("float array", "1-D sequence of ints"),
        ({1}, "got set"),
        (None, "got NoneType"),
        ("ab", "got str"),
        ([20], "out of range"),
        ([1, 1], "given twice"),
    ],
)
def test_pages_that_are_not_page_ids_are_refused_with_nothing_moved(pages: Any, says: str) -> None:
    import numpy as np

    pages = (
        {
            "np.True_": [np.True_],
            "float tensor": torch.tensor([1.0]),
            "2-D tensor": torch.tensor([[1]]),
            "bool tensor": torch.tensor([True]),
            "float array": np.array([1.5]),
        }.get(pages, pages)
        if isinstance(pages, str)
        else pages
    )
    l1, l2 = pools(16, seed=4)
    eng = TransferEngine(l1, l2, "torch", direct_max_bytes=0)
    before = (l1.buffer.clone(), l2.buffer.clone())
    n = 2 if says == "given twice" else 1
    with pytest.raises(PageOwnershipError, match=says):
        eng.d2h(pages, list(range(n)))
    with pytest.raises(PageOwnershipError, match=says):
        eng.h2d(list(range(n)), pages)
    assert torch.equal(l1.buffer, before[0]) and torch.equal(l2.buffer, before[1])
    assert sum(eng.paths.values()) == 0
