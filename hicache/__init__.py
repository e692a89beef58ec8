"""hicache: a hierarchical (GPU / pinned host / file) KV cache for LLM inference engines."""

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
