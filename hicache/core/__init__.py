"""Engine-agnostic core: geometry, allocators, the tree and the page-run lifecycle."""

from hicache.core.allocator import PageAllocator
from hicache.core.cache import CacheCore, InsertResult
from hicache.core.geometry import DevicePage, HostPage, KVGeometry, StorageSlot, TierSizes
from hicache.core.node import Lease, Node, Transfer
from hicache.core.status import CoreStatus, TierStatus
from hicache.core.tree import HiRadixTree, MatchResult, TierMatch

__all__ = [
    "CacheCore",
    "CoreStatus",
    "DevicePage",
    "HiRadixTree",
    "HostPage",
    "InsertResult",
    "KVGeometry",
    "Lease",
    "MatchResult",
    "Node",
    "PageAllocator",
    "StorageSlot",
    "TierMatch",
    "TierSizes",
    "TierStatus",
    "Transfer",
]
