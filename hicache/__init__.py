"""hicache: a hierarchical (GPU / pinned host / file) KV cache for LLM inference engines."""

import logging
from typing import TYPE_CHECKING

from hicache.errors import (
    ConfigError,
    HandleError,
    HiCacheError,
    IntegrityError,
    MisuseError,
    PageContentError,
    PageOwnershipError,
    TransitionRefused,
)

if TYPE_CHECKING:
    from hicache.facade import HiCache, HiCacheConfig

__version__ = "0.1.0"


def __getattr__(name: str) -> object:
    # The facade imports torch and the backends: load it on first use only.
    if name in ("HiCache", "HiCacheConfig"):
        from hicache import facade

        return getattr(facade, name)
    raise AttributeError(name)


logging.getLogger("hicache").addHandler(logging.NullHandler())  # quiet unless the app configures logging

__all__ = [
    "ConfigError",
    "HandleError",
    "HiCache",
    "HiCacheConfig",
    "HiCacheError",
    "IntegrityError",
    "MisuseError",
    "PageContentError",
    "PageOwnershipError",
    "TransitionRefused",
    "__version__",
]
