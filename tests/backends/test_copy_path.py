"""The copy path (one strided DMA per page on the copy engine) on CPU, where the same
address arithmetic runs as host copies: bit-exact, nothing else written, any layout."""

from __future__ import annotations

import pytest

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
