"""Geometry and tier sizes: the smallest valid values pass, anything below is a ConfigError."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from hicache.core.geometry import KVGeometry, TierSizes
from hicache.errors import ConfigError


def test_one_of_everything_is_a_valid_geometry() -> None:
    """1 layer, 1 head, head dim 1, page size 1 (fp32): 8 bytes per token."""
    g = KVGeometry(1, 1, 1, 1, torch.float32)
    assert (g.bytes_per_token, g.bytes_per_page, g.page_elements) == (8, 8, 1)


@pytest.mark.parametrize("field", ["num_layers", "num_kv_heads", "head_dim", "page_size"])
@pytest.mark.parametrize("bad", [0, -1, True, 1.0])
def test_a_non_positive_or_non_int_dimension_is_a_config_error(field: str, bad: object) -> None:
    """Each dimension must be an int >= 1 (a bool is not an int here)."""
    args: dict[str, object] = {"num_layers": 1, "num_kv_heads": 1, "head_dim": 1, "page_size": 1}
    args[field] = bad
    with pytest.raises(ConfigError, match=field):
        KVGeometry(**args)  # type: ignore[arg-type]


def test_tier_sizes_allow_one_l1_page_and_empty_lower_tiers() -> None:
    """L1 needs at least one page; L2 and L3 may be 0; negatives and zero L1 are refused,
    naming the field and the value."""
    assert TierSizes(1).capacities == (1, 0, 0)
    with pytest.raises(ConfigError, match=r"^l1_pages must be a positive int, got 0$"):
        TierSizes(0)
    with pytest.raises(ConfigError, match=r"^l2_pages must be a non-negative int, got -1$"):
        TierSizes(1, -1)
    with pytest.raises(ConfigError, match=r"^l3_pages must be a non-negative int, got -1$"):
        TierSizes(1, 0, -1)


@pytest.mark.parametrize("field", ["num_layers", "num_kv_heads", "head_dim", "page_size"])
def test_a_dimension_past_any_machine_is_a_config_error_naming_the_geometry(field: str) -> None:
    """A dimension of 2**40 (a typo, an overflow) is refused by the geometry in its own
    terms, not later as an L1 pool of so many GiB; the largest page size the command line
    takes and a page of a TiB are still a geometry."""
    args: dict[str, object] = {"num_layers": 1, "num_kv_heads": 1, "head_dim": 1, "page_size": 1}
    args[field] = 2**40
    with pytest.raises(ConfigError, match="page_size must be at most" if field == "page_size" else field):
        KVGeometry(**args)  # type: ignore[arg-type]
    assert KVGeometry(1, 1, 1, 1 << 16, torch.float32).page_size == 1 << 16
    with pytest.raises(ConfigError, match="page_size must be at most 65,536"):
        KVGeometry(1, 1, 1, (1 << 16) + 1, torch.float32)
    assert KVGeometry(2**24, 2**5, 2**4, 2**4, torch.float32).bytes_per_page == 2**40
    with pytest.raises(ConfigError, match="more than any machine holds"):
        KVGeometry(2**24 + 1, 2**5, 2**4, 2**4, torch.float32)


@pytest.mark.parametrize("kind", [np.int8, np.int64, np.uint16])
def test_numpy_integers_are_taken_as_the_ints_they_hold(kind: type) -> None:
    """Sizes computed with numpy (a config read with numpy, a tokenizer's arrays) are ints:
    taken, and held as plain ints (they go into keys, JSON and messages). A numpy bool is
    not one."""
    g = KVGeometry(kind(2), kind(1), kind(4), kind(4), torch.float32)
    assert (g.num_layers, g.num_kv_heads, g.head_dim, g.page_size) == (2, 1, 4, 4)
    assert all(type(getattr(g, f)) is int for f in ("num_layers", "num_kv_heads", "head_dim", "page_size"))
    sizes = TierSizes(kind(8), kind(3), kind(0))
    assert sizes.capacities == (8, 3, 0) and all(type(x) is int for x in sizes.capacities)
    with pytest.raises(ConfigError, match="num_layers"):
        KVGeometry(np.bool_(True), 1, 1, 1, torch.float32)  # type: ignore[arg-type]
