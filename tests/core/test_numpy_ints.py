"""Numpy integers, as a tokenizer or an engine's arithmetic hands them, are the ints they
hold wherever the controller takes a count (tokens, at_most, allocate, observe_prefill);
numpy floats and bools are still refused."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from hicache import HiCache, HiCacheConfig
from hicache.core.geometry import KVGeometry
from hicache.errors import MisuseError

G = KVGeometry(2, 1, 4, 2, torch.float32)


def test_numpy_integers_are_taken_as_ints() -> None:
    with HiCache(HiCacheConfig(G, l1_pages=8, l2_pages=8, device="cpu")) as c:
        req = c.admit([np.int64(1), np.int32(2), np.int64(3), np.int64(4), np.uint16(5)], at_most=np.int64(4))  # type: ignore[arg-type]
        assert req.tokens == (1, 2, 3, 4, 5) and all(type(t) is int for t in req.tokens)
        pages = c.allocate(req, np.int64(3))  # type: ignore[arg-type]
        assert pages is not None and len(pages) == 3
        assert c.insert(req, pages[:2]) == 4  # the whole page goes to the tree
        c.observe_prefill(np.int64(5), 0.01)  # type: ignore[arg-type]
        assert list(c.controller.cost.recompute.samples) == [(5, 0.01)]
        c.release(req)
        again = c.admit([1, 2, 3, 4, 5], at_most=np.int8(4))  # type: ignore[arg-type]
        assert again.cached_len == 4  # at_most kept the match to the first page
        c.release(again)


@pytest.mark.parametrize("bad", [np.float64(2.0), np.bool_(True)])
def test_numpy_floats_and_bools_are_still_refused(bad: object) -> None:
    with HiCache(HiCacheConfig(G, l1_pages=8, l2_pages=8, device="cpu")) as c:
        req = c.admit([1, 2, 3])
        with pytest.raises(MisuseError, match=r"^allocate: page count must be an int >= 0"):
            c.allocate(req, bad)  # type: ignore[arg-type]
        with pytest.raises(MisuseError, match=r"^observe_prefill: tokens must be an int"):
            c.observe_prefill(bad, 0.1)  # type: ignore[arg-type]
        with pytest.raises(MisuseError, match=r"^admit: at_most must be None or an int"):
            c.admit([1, 2], at_most=bad)  # type: ignore[arg-type]
        assert c.allocate(req, 1) is not None  # the request goes on
        c.release(req)
