"""Validation of token sequences handed to the core."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from hicache.errors import MisuseError


def as_tokens(tokens: object) -> tuple[int, ...]:
    """A non-empty 1-D sequence of ints in int64 range (tuple, list, integer tensor or
    array) as a tuple.
    Bools in a sequence count as the ints 0 and 1, as everywhere in Python (a per-token type
    check would cost a pass over every prompt); a bool tensor is refused."""
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
    elif isinstance(tokens, Sequence) and not isinstance(tokens, (str, bytes)):
        out = tuple(tokens)
    elif hasattr(tokens, "tolist") and hasattr(tokens, "ndim"):
        if tokens.ndim != 1:
            raise MisuseError(f"tokens must be 1-D, got ndim={tokens.ndim}")
        out = tuple(tokens.tolist())
    else:
        raise MisuseError(f"tokens must be a 1-D sequence of ints, got {type(tokens).__name__}")
    if not out:
        raise MisuseError("tokens must not be empty")
    # NOTE: one C-level pass: a sum of ints is an int, and any float, complex, Fraction,
    # numpy scalar or string among them makes it something else (or raises).
    try:
        ok = type(sum(out)) is int
    except TypeError:
        ok = False
    if not ok:
        bad = next(x for x in out if type(x) is not int and type(x) is not bool)
        raise MisuseError(f"tokens must be ints, got {bad!r} ({type(bad).__name__})")
    # NOTE: the range every store can name (keys hash tokens as int64), whichever is used.
    low, high = min(out), max(out)
    if low < _INT64_MIN or high > _INT64_MAX:
        bad = low if low < _INT64_MIN else high
        raise MisuseError(f"tokens must be ints in int64 range, got {bad}")
    return out


_INT64_MIN, _INT64_MAX = -(2**63), 2**63 - 1
