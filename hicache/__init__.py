"""hicache: a hierarchical (GPU / pinned host / file) KV cache for LLM inference engines."""

import logging

from hicache.errors import (
    ConfigError,
    HandleError,
    HiCacheError,
    IntegrityError,
    MisuseError,
    PageOwnershipError,
    TransitionRefused,
)

__version__ = "0.1.0"

logging.getLogger("hicache").addHandler(logging.NullHandler())  # quiet unless the app configures logging

__all__ = [
    "ConfigError",
    "HandleError",
    "HiCacheError",
    "IntegrityError",
    "MisuseError",
    "PageOwnershipError",
    "TransitionRefused",
    "__version__",
]
