"""Small helpers for vectored file I/O straight into host pages."""

from __future__ import annotations

import errno
import os
from collections.abc import Sequence


def runs(ids: Sequence[int]) -> list[tuple[int, int]]:
    """``(first, end)`` index ranges of ``ids`` that step by one."""
    out: list[tuple[int, int]] = []
    first = 0
    for i in range(1, len(ids)):
        if ids[i] != ids[i - 1] + 1:
            out.append((first, i))
            first = i
    if len(ids):
        out.append((first, len(ids)))
    return out


def skip(iov: list[memoryview], nbytes: int) -> list[memoryview]:
    """The buffers left after the first ``nbytes`` of ``iov`` moved."""
    for i, v in enumerate(iov):
        if nbytes < len(v):
            return [v[nbytes:], *iov[i + 1 :]] if nbytes else iov[i:]
        nbytes -= len(v)
    return []


def write_all(fd: int, iov: list[memoryview], offset: int = 0) -> None:
    """``pwritev`` until every byte is written (short writes loop; no progress is EIO)."""
    total = sum(len(v) for v in iov)
    done = 0
    while done < total:
        n = os.pwritev(fd, skip(iov, done), offset + done)
        if n <= 0:
            raise OSError(errno.EIO, f"pwrite made no progress at byte {offset + done}")
        done += n


def read_all(fd: int, iov: list[memoryview], offset: int = 0) -> None:
    """``preadv`` until every buffer is full (a read past the end of data is EIO)."""
    total = sum(len(v) for v in iov)
    done = 0
    while done < total:
        n = os.preadv(fd, skip(iov, done), offset + done)
        if n <= 0:
            raise OSError(errno.EIO, f"short read: end of data at byte {offset + done}")
        done += n
