"""Validation of token sequences handed to the core."""

from __future__ import annotations

import struct
from collections.abc import Sequence

import numpy as np
import torch

from hicache.errors import MisuseError


class Tokens(tuple[int, ...]):
    """A tuple of tokens :func:`as_tokens` checked: handed to it again (an engine's prompt,
    checked at submit, then at admit), it is not checked twice."""

    __slots__ = ()


class _Checked(Tokens):
    """What :func:`as_tokens` returns: only these skip the check (a ``Tokens`` made by hand,
    ``Tokens(())`` say, is checked as any tuple)."""

    __slots__ = ()


def as_tokens(tokens: object) -> Tokens:
    """A non-empty 1-D sequence of ints in int64 range (tuple, list, integer tensor or
    array) as a tuple of plain ints.
    Bools in a sequence count as the ints 0 and 1, as everywhere in Python (a per-token type
    check would cost a pass over every prompt), and come back as them; a bool tensor or array
    is refused."""
    if type(tokens) is _Checked:
        return tokens
    if isinstance(tokens, (str, bytes, bytearray, memoryview)):
        # NOTE: text or raw bytes, not token ids (a sequence of ints when indexed, yet never
        # what a caller means by a prompt)
        raise MisuseError(f"tokens must be a 1-D sequence of ints, got {type(tokens).__name__}")
    if isinstance(tokens, tuple):
        out = tokens
    elif isinstance(tokens, torch.Tensor):
        if tokens.is_meta or tokens.layout is not torch.strided or tokens.is_nested:
            where = "on the meta device" if tokens.is_meta else "nested" if tokens.is_nested else str(tokens.layout)
            raise MisuseError(f"tokens must be a tensor with values here, got one {where}")
        if tokens.dim() != 1:
            raise MisuseError(f"tokens must be 1-D, got a tensor of shape {tuple(tokens.shape)}")
        if tokens.dtype.is_floating_point or tokens.dtype.is_complex or tokens.dtype == torch.bool:
            raise MisuseError(f"tokens must be integers, got dtype {tokens.dtype}")
        out = tuple(tokens.tolist())
    elif isinstance(tokens, Sequence):
        out = tuple(tokens)
    elif hasattr(tokens, "tolist") and hasattr(tokens, "ndim"):
        if tokens.ndim != 1:
            raise MisuseError(f"tokens must be 1-D, got ndim={tokens.ndim}")
        dtype = getattr(tokens, "dtype", None)
        if getattr(dtype, "kind", "") == "b":  # NOTE: refused as a bool tensor is
            raise MisuseError(f"tokens must be integers, got dtype {dtype}")
        out = tuple(tokens.tolist())
    else:
        raise MisuseError(f"tokens must be a 1-D sequence of ints, got {type(tokens).__name__}")
    if not out:
        raise MisuseError("tokens must not be empty")
    # NOTE: one C-level pass: a sum of ints is an int, and any float, complex, Fraction,
    # numpy scalar or string among them makes it something else (or raises).
    try:
        with np.errstate(over="ignore"):  # NOTE: numpy integers among them add with wrap-around
            ok = type(sum(out)) is int
    except (TypeError, OverflowError):  # NOTE: a large int added to a narrow numpy integer overflows
        ok = False
    if not ok:
        bad = [x for x in out if type(x) is not int and type(x) is not bool and not _np_int(x)][:1]
        if bad:  # NOTE: a list, not next(..., None): a None token is one to report
            raise MisuseError(f"tokens must be ints, got {bad[0]!r} ({type(bad[0]).__name__})")
        out = tuple(int(x) for x in out)  # numpy integers, as a tokenizer's list may hold
    # NOTE: the range every store can name (keys hash tokens as int64), whichever is used.
    # One C-level pass again: packing them as int64 raises on the first out of range (min
    # and max compare generically and cost twice as much, a tenth of a millisecond on a
    # 3,500-token prompt: a tenth of an L2 restore's bookkeeping).
    fmt = f"<{len(out)}q"
    try:
        packed = struct.pack(fmt, *out)
    except struct.error:
        bad = next(x for x in out if not _INT64_MIN <= x <= _INT64_MAX)
        raise MisuseError(f"tokens must be ints in int64 range, got {bad}") from None
    # NOTE: unpacked, they are plain ints (a bool or an int subclass among them is its
    # value), as the stores hash them and an engine's forward reads them.
    return _Checked(struct.unpack(fmt, packed))


def plain_int(x: object) -> object:
    """A numpy integer as the int it holds; anything else as it is (to be checked)."""
    return int(x) if isinstance(x, np.integer) else x


def _np_int(x: object) -> bool:
    """A numpy integer scalar (a numpy bool is not one)."""
    return isinstance(x, np.integer)


def bounds(tokens: Tokens) -> tuple[int, int]:
    """The smallest and the largest of ``tokens`` (checked ones): by numpy over their int64
    bytes, a few times faster than ``min`` and ``max`` over the ints, which compare generically."""
    packed = np.frombuffer(struct.pack(f"<{len(tokens)}q", *tokens), dtype=np.int64)
    return int(packed.min()), int(packed.max())


_INT64_MIN, _INT64_MAX = -(2**63), 2**63 - 1
