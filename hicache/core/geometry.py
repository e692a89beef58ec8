"""KV geometry, tier sizes and typed page ids (DESIGN.md §2)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import NewType

import torch

from hicache.core.tokens import plain_int
from hicache.errors import ConfigError

DevicePage = NewType("DevicePage", int)
"""A page index in the L1 (GPU) pool."""
HostPage = NewType("HostPage", int)
"""A page index in the L2 (pinned host) pool."""
StorageSlot = NewType("StorageSlot", int)
"""A slot index in the L3 file."""

SUPPORTED_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


# The largest page anyone could allocate (a TiB): past it a size is a typo or an overflow,
# refused here in the geometry's own terms, not later as an L1 pool "too large".
MAX_PAGE_BYTES = 2**40
MAX_PAGE_SIZE = 1 << 16  # tokens per page, as the command line takes


def plain_ints(obj: object, names: tuple[str, ...]) -> None:
    """Set each of ``names`` on a (frozen) dataclass ``obj`` that holds a numpy integer to the
    int it holds (sizes computed with numpy are ints too); anything else is left to be checked."""
    for name in names:
        object.__setattr__(obj, name, plain_int(getattr(obj, name)))


def _positive_int(name: str, value: object) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise ConfigError(f"{name} must be a positive int, got {value!r}")


@dataclass(frozen=True, slots=True)
class KVGeometry:
    """Shape of one rank's MHA/GQA KV cache.

    ``bytes_per_token = 2 * num_layers * num_kv_heads * head_dim * itemsize``;
    Qwen3-8B in bf16 (36 layers, 8 KV heads, head dim 128) gives 147,456.
    """

    num_layers: int
    num_kv_heads: int
    head_dim: int
    page_size: int
    dtype: torch.dtype = torch.bfloat16

    def __post_init__(self) -> None:
        sizes = ("num_layers", "num_kv_heads", "head_dim", "page_size")
        plain_ints(self, sizes)
        for name in sizes:
            _positive_int(name, getattr(self, name))
        if self.page_size > MAX_PAGE_SIZE:
            raise ConfigError(f"page_size must be at most {MAX_PAGE_SIZE:,} tokens, got {self.page_size:,}")
        if self.dtype not in SUPPORTED_DTYPES:
            raise ConfigError(
                f"dtype must be one of {SUPPORTED_DTYPES} (quantized KV pools are not supported), got {self.dtype!r}"
            )
        if self.bytes_per_page > MAX_PAGE_BYTES:
            raise ConfigError(
                f"a page of {self.bytes_per_page:.4g} bytes (2 x num_layers {self.num_layers:,} x num_kv_heads "
                f"{self.num_kv_heads:,} x head_dim {self.head_dim:,} x page_size {self.page_size:,} x "
                f"{self.itemsize} bytes) is more than any machine holds (at most {MAX_PAGE_BYTES / 2**40:.0f} TiB)"
            )

    @property
    def itemsize(self) -> int:
        return torch.empty((), dtype=self.dtype).element_size()

    @property
    def page_elements(self) -> int:
        """Elements of one page in one (K or V, layer) slab: ``page_size*heads*head_dim``."""
        return self.page_size * self.num_kv_heads * self.head_dim

    @property
    def bytes_per_token(self) -> int:
        return 2 * self.num_layers * self.num_kv_heads * self.head_dim * self.itemsize

    @property
    def bytes_per_page(self) -> int:
        return self.page_size * self.bytes_per_token


@dataclass(frozen=True, slots=True)
class TierSizes:
    """Capacity in pages of each tier. L2 and L3 may be 0 (tier disabled)."""

    l1_pages: int
    l2_pages: int = 0
    l3_pages: int = 0
    capacities: tuple[int, int, int] = field(init=False)

    def __post_init__(self) -> None:
        plain_ints(self, ("l1_pages", "l2_pages", "l3_pages"))
        _positive_int("l1_pages", self.l1_pages)
        for name in ("l2_pages", "l3_pages"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                raise ConfigError(f"{name} must be a non-negative int, got {value!r}")
        object.__setattr__(self, "capacities", (self.l1_pages, self.l2_pages, self.l3_pages))
