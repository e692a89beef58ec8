"""Page verification (``HiCacheConfig.verify_pages``): a digest per page where it was
computed, checked at every arrival. A :class:`~hicache.core.protocols.PageVerifier`."""

from __future__ import annotations

from collections.abc import Sequence

import torch
import xxhash

from hicache.backends.pools import DevicePool, HostPool
from hicache.spec.model import Direction

_CHUNK = 8  # L1 pages staged per host copy when digesting


class DigestVerifier:
    """A page's xxh3 digest is taken in L1 at the D2H and checked in L2 after D2H and S2H,
    and in L1 after H2D (L3 reads are also checked by the storage's own checksums)."""

    def __init__(self, l1: DevicePool, l2: HostPool) -> None:
        self.l1 = l1
        self.l2 = l2
        self.page_digests: dict[int, int] = {}  # L2 page -> digest
        self.slot_digests: dict[int, int] = {}  # L3 slot -> digest
        self._staging: torch.Tensor | None = None

    def _digest_l1(self, pages: Sequence[int]) -> list[int]:
        # NOTE: through one reused host buffer, a few pages at a time, hashed in place: a
        # fresh host tensor per call (megabytes a page) grows the heap under a long soak.
        out: list[int] = []
        buf = self.l1.buffer
        for i in range(0, len(pages), _CHUNK):
            part = list(pages[i : i + _CHUNK])
            if self._staging is None:
                shape = (_CHUNK, *buf.shape[:2], *buf.shape[3:])  # L2 page layout
                self._staging = torch.empty(shape, dtype=buf.dtype, pin_memory=buf.is_cuda)
            staged = self._staging[: len(part)]
            staged.copy_(buf[:, :, part].permute(2, 0, 1, 3, 4, 5))
            rows = staged.view(len(part), -1).view(torch.uint8).numpy()
            out.extend(xxhash.xxh3_64_intdigest(row) for row in rows)
        return out

    def _digest_l2(self, pages: Sequence[int]) -> list[int]:
        rows = self.l2.bytes.numpy()  # [page, bytes_per_page], shares memory
        return [xxhash.xxh3_64_intdigest(rows[p]) for p in pages]

    def forget_slots(self, slots: Sequence[int]) -> None:
        for s in slots:
            self.slot_digests.pop(s, None)

    def verify(self, direction: Direction, src: Sequence[int], dst: Sequence[int]) -> str | None:
        if direction is Direction.H2S:
            for s, t in zip(src, dst, strict=True):
                self.slot_digests[t] = self.page_digests.get(s) or self._digest_l2([s])[0]
            return None
        want: list[int | None]
        if direction is Direction.D2H:
            want = list(self._digest_l1(src))
        elif direction is Direction.S2H:
            want = [self.slot_digests.get(s) for s in src]
        else:
            want = [self.page_digests.get(s) for s in src]
        got = self._digest_l1(dst) if direction is Direction.H2D else self._digest_l2(dst)
        bad = next((i for i, (w, g) in enumerate(zip(want, got, strict=True)) if w is not None and w != g), None)
        if bad is not None:
            return f"{direction.name}: page {dst[bad]} differs from the page saved (digest mismatch at position {bad})"
        if direction is not Direction.H2D:
            self.page_digests.update(zip(dst, got, strict=True))
        return None
