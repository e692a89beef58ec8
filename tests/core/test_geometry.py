"""Geometry and tier sizes: the smallest valid values pass, anything below is a ConfigError."""

from __future__ import annotations

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
