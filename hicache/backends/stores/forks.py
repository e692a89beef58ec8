"""Locks a forked child must not keep.

A store's lock is a ``flock`` on an open file, and a child forked while the store is open
(a worker pool's, a tokenizer's) shares that open file: were the parent killed, the child
would keep the store locked for as long as it lives, and the next cache on the path would
be refused ("in use by pid N" of a dead process). So each locking store registers here, and
in every forked child its copies of the locked descriptors are closed at once. Closing them
in the child leaves the parent's lock held (the lock belongs to the open file, which the
parent still has open); the child's store is closed with them, which costs nothing: a cache
is not usable in a forked child anyway (its I/O threads do not exist there).
"""

from __future__ import annotations

import os
import weakref
from typing import Protocol


class Locking(Protocol):
    def drop_in_child(self) -> None:
        """Close this copy's locked descriptors (in a forked child: no locks, no I/O)."""


_stores: weakref.WeakSet[Locking] = weakref.WeakSet()


def drop_in_children(store: Locking) -> None:
    """Have ``store.drop_in_child()`` run in every child forked while it is alive."""
    _stores.add(store)


def _after_fork_in_child() -> None:
    # NOTE: the child's one thread: no lock is taken here (one held at the fork by another
    # thread of the parent would never be released)
    stores = list(_stores)
    _stores.clear()
    for store in stores:
        store.drop_in_child()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_after_fork_in_child)
