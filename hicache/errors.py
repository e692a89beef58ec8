"""One exception hierarchy (DESIGN.md §9).

- Bad configuration and caller misuse raise :class:`ConfigError` / :class:`MisuseError`
  (both ``ValueError``) *before* anything changes.
- Running out of pages is an expected result (``None`` / empty), never an exception; asking
  for more than a tier could ever give is misuse.
- A broken invariant is :class:`IntegrityError`: that is a bug in hicache.
"""

from __future__ import annotations


class HiCacheError(Exception):
    """Base of every error hicache raises on purpose."""


class ConfigError(HiCacheError, ValueError):
    """A configuration value is invalid; the message names it."""


class MisuseError(HiCacheError, ValueError):
    """The caller asked for something the contract forbids; nothing was changed."""


class HandleError(MisuseError):
    """A handle or lease was used after release, released twice, or has gone stale."""


class PageOwnershipError(MisuseError):
    """Pages handed to hicache are out of range, duplicated, or not owned by the caller."""


class PageContentError(MisuseError):
    """The engine wrote an L1 page it did not own (a free page, or a published one): seen by
    ``HiCacheConfig.guard_pages``, raised by ``check_integrity``."""


class TransitionRefused(MisuseError):
    """The page-run spec refuses this operation in the run's current state."""


class IntegrityError(HiCacheError):
    """An invariant of DESIGN.md §4 or §4b is broken. This is a bug: please report it."""

    def __init__(self, invariant: str, where: str, detail: str) -> None:
        super().__init__(f"invariant {invariant!r} broken at {where}: {detail} (this is a bug)")
        self.invariant = invariant
        self.where = where
        self.detail = detail


def is_out_of_memory(exc: BaseException) -> bool:
    """Whether ``exc`` is an allocation failure as Python or torch reports one (host:
    MemoryError or "can't allocate memory"; device: torch.OutOfMemoryError, "out of memory")."""
    text = str(exc)
    return isinstance(exc, MemoryError) or "can't allocate memory" in text or "out of memory" in text.lower()
