"""A fake transfer backend that moves *content tags* instead of bytes.

Every physical page of every tier holds an int tag. A page that holds tokens
``prompt[:(i+1)*ps]`` must carry ``page_tag(prompt[:(i+1)*ps])`` (a chained hash of the
token prefix), so a page that was misrouted, published early or never written is caught.
Destinations are poisoned when a transfer is submitted and written only on completion:
reading one before its transfer completes shows ``POISON``.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence

from hicache.core.cache import CacheCore
from hicache.core.node import Transfer
from hicache.spec.model import Tier

POISON = -1
EMPTY = -2


def page_tag(prefix: Sequence[int]) -> int:
    """The content tag of the page that ends ``prefix``."""
    h = hashlib.blake2b(repr(tuple(prefix)).encode(), digest_size=8)
    return int.from_bytes(h.digest(), "little") >> 1


class FakeBackend:
    """Per-tier tag arrays plus the transfers submitted and not yet finished."""

    def __init__(self, core: CacheCore) -> None:
        self.core = core
        self.content: list[list[int]] = [[EMPTY] * core.sizes.capacities[t] for t in Tier]
        self.submitted: dict[int, Transfer] = {}

    def prefill(self, prompt: Sequence[int], first_page: int, pages: Sequence[int]) -> None:
        """Write the tags a real prefill would compute into private L1 ``pages``, which
        hold pages ``first_page, first_page+1, ...`` of ``prompt``."""
        ps = self.core.page_size
        for i, page in enumerate(pages):
            end = (first_page + i + 1) * ps
            self.content[Tier.L1][page] = page_tag(prompt[:end])

    def submit(self, transfer: Transfer) -> None:
        """The backend accepted the transfer: its destinations are garbage until done."""
        target = self.content[transfer.direction.target]
        for page in transfer.dst:
            target[page] = POISON
        self.submitted[transfer.id] = transfer

    def finish(self, transfer: Transfer, *, ok: bool = True) -> None:
        """Copy (or, failing, don't) and report to the core."""
        del self.submitted[transfer.id]
        if ok:
            src = self.content[transfer.direction.source]
            dst = self.content[transfer.direction.target]
            for s, d in zip(transfer.src, transfer.dst, strict=True):
                dst[d] = src[s]
            self.core.complete(transfer)
        else:
            self.core.fail(transfer)

    def cancel(self, transfer: Transfer) -> None:
        del self.submitted[transfer.id]
        self.core.cancel(transfer)

    def expected_tags(self, prompt: Sequence[int], length: int) -> list[int]:
        ps = self.core.page_size
        return [page_tag(prompt[: (i + 1) * ps]) for i in range(length // ps)]

    def tags(self, tier: Tier, pages: Sequence[int]) -> list[int]:
        return [self.content[tier][p] for p in pages]
