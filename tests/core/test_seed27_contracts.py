"""Contracts the seed-27 mutation draw found unchecked outside the controller and the cache:
how the allocator splits a request no free run can hold, the messages that name bad keys and
dtypes, and a lease handed to a tree that never gave it."""

from __future__ import annotations

import pytest
import torch

from hicache.core import CacheCore, TierSizes
from hicache.core.allocator import PageAllocator
from hicache.core.geometry import KVGeometry
from hicache.core.keys import KEY_BYTES, page_keys
from hicache.errors import ConfigError, HandleError, MisuseError
from hicache.spec.model import Tier
from tests.core.test_tree import prefill


def test_a_request_no_run_can_hold_takes_the_longest_runs_first() -> None:
    """Free runs of 1, 2, 3 and 4 pages, 6 asked: the 4-page run, then 2 of the 3-page run
    (the fewest pieces); the 1- and 2-page runs stay whole."""
    a: PageAllocator[int] = PageAllocator(20)
    everything = a.allocate(20)
    assert everything is not None
    for first, length in ((0, 1), (2, 2), (5, 3), (9, 4)):  # runs apart, separated by held pages
        a.free(range(first, first + length))
    taken = a.allocate(6)
    assert taken is not None
    got = sorted(taken)
    assert got[-4:] == [9, 10, 11, 12]  # the whole longest run
    assert set(got[:2]) <= {5, 6, 7}  # then the next longest
    runs = a.runs()
    assert (0, 1) in runs and (2, 2) in runs and sum(length for _, length in runs) == 4


def test_a_bad_parent_key_is_named() -> None:
    """page_keys with a parent of the wrong length raises MisuseError naming the length
    wanted and the value given."""
    with pytest.raises(MisuseError, match=rf"parent key must be {KEY_BYTES} bytes, got b'abc'"):
        page_keys(b"abc", [1, 2, 3, 4], 2)


def test_a_quantized_dtype_is_named() -> None:
    """A KV geometry in int8 is refused, the message naming the supported dtypes and why."""
    why = r"dtype must be one of .* \(quantized KV pools are not supported\), got torch.int8"
    with pytest.raises(ConfigError, match=why):
        KVGeometry(2, 2, 8, 4, torch.int8)


def test_a_lease_from_another_tree_is_refused_and_changes_nothing() -> None:
    """Releasing on tree B a live lease tree A gave raises HandleError; A's pin holds."""
    a, b = CacheCore(2, TierSizes(8, 8, 8)), CacheCore(2, TierSizes(8, 8, 8))
    node = prefill(a, (1, 2, 3, 4))
    lease = a.tree.lock_node(node, Tier.L1)
    before = b.snapshot()
    with pytest.raises(HandleError, match=rf"lease #{lease.id} on L1 was already released or is unknown"):
        b.tree.release(lease)
    assert b.snapshot() == before and not lease.released and node.refs[Tier.L1.value] == 1
    a.tree.release(lease)
    assert node.refs[Tier.L1.value] == 0
