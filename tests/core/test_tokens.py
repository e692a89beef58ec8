"""as_tokens: which token sequences the core accepts, and what its refusals say."""

from __future__ import annotations

import re

import numpy as np
import pytest
import torch

from hicache.core.tokens import Tokens, as_tokens, bounds
from hicache.errors import MisuseError


class _ListOnly:
    """Has ``tolist`` but no ``ndim``: not an array, not a sequence."""

    def tolist(self) -> list[int]:
        return [1, 2]


@pytest.mark.parametrize(
    "given",
    [
        (5, 6, 7),
        [5, 6, 7],
        torch.tensor([5, 6, 7]),
        torch.tensor([5, 6, 7], dtype=torch.int32),
        np.array([5, 6, 7]),
        [np.int64(5), np.int32(6), np.uint8(7)],  # a tokenizer's list of numpy integers
        (5, np.int16(6), 7),
    ],
)
def test_a_one_dimensional_integer_sequence_becomes_a_tuple_of_ints(given: object) -> None:
    """Tuples, lists, integer tensors and arrays of one dimension give the same tuple of ints."""
    out = as_tokens(given)
    assert out == (5, 6, 7)
    assert isinstance(out, tuple) and all(type(x) is int for x in out)


@pytest.mark.parametrize(
    "given",
    [
        [150_000] * 20_000 + [np.int32(5)],  # a system prompt of ints, then a tokenizer's int32s
        [1000, np.int8(1)],
        [-1, np.uint64(5)],
    ],
)
def test_ints_beside_narrow_numpy_integers_are_accepted(given: list[object]) -> None:
    """Summed with a narrow numpy integer a Python int can overflow it (NumPy 2 raises):
    every token here is in range, so the prompt is taken, each token as its int."""
    assert as_tokens(given) == tuple(int(x) for x in given)  # type: ignore[call-overload]


def test_bools_and_int_subclasses_come_back_as_plain_ints() -> None:
    """Bools count as 0 and 1 and come back as those ints (the stores hash them, an engine's
    forward reads them, as ints)."""

    class Id(int):
        pass

    out = as_tokens([True, Id(7), False, 2])
    assert out == (1, 7, 0, 2)
    assert [type(x) for x in out] == [int] * 4


def test_a_checked_sequence_is_not_checked_again() -> None:
    """What as_tokens returns, handed back, is returned as it is (an engine checks a prompt
    at submit; its admit does not check it twice)."""
    out = as_tokens([3, 1, 2])
    assert as_tokens(out) is out
    assert as_tokens(tuple(out)) is not out  # a plain tuple is checked
    assert isinstance(out, Tokens)


@pytest.mark.parametrize(("made", "message"), [((), "empty"), ((1.5, 2), "1.5"), (("a",), "'a'"), ((2**64,), "int64")])
def test_a_tokens_made_by_hand_is_checked_as_any_tuple(made: tuple[object, ...], message: str) -> None:
    """Only what as_tokens returned skips the check: ``Tokens(())`` or ``Tokens((1.5,))``
    built by hand (the class is importable) is refused as the tuple it holds would be."""
    with pytest.raises(MisuseError, match=re.escape(message)):
        as_tokens(Tokens(made))  # type: ignore[arg-type]


@pytest.mark.parametrize("given", [[5], [3, -1, 9], [0, 2**63 - 1, -(2**63)], list(range(1000, 0, -7)), [True, 4]])
def test_bounds_are_the_smallest_and_the_largest_token(given: list[int]) -> None:
    toks = as_tokens(given)
    assert bounds(toks) == (min(given), max(given))


@pytest.mark.parametrize(
    ("given", "message"),
    [
        (torch.tensor([[1, 2]]), "tokens must be 1-D, got a tensor of shape (1, 2)"),
        (torch.tensor(3), "tokens must be 1-D, got a tensor of shape ()"),
        (torch.tensor([1.0, 2.0]), "tokens must be integers, got dtype torch.float32"),
        (torch.tensor([1 + 0j, 2 + 0j]), "tokens must be integers, got dtype torch.complex64"),
        (torch.tensor([True, False]), "tokens must be integers, got dtype torch.bool"),
        (np.array([[1, 2]]), "tokens must be 1-D, got ndim=2"),
        (np.array([True, False]), "tokens must be integers, got dtype bool"),
        (_ListOnly(), "tokens must be a 1-D sequence of ints, got _ListOnly"),
        ("12", "tokens must be a 1-D sequence of ints, got str"),
        (b"12", "tokens must be a 1-D sequence of ints, got bytes"),
        (bytearray(b"12"), "tokens must be a 1-D sequence of ints, got bytearray"),
        (memoryview(b"12"), "tokens must be a 1-D sequence of ints, got memoryview"),
        ((), "tokens must not be empty"),
        ([1, 2.5, 3], "tokens must be ints, got 2.5 (float)"),
        ((7, True, "x"), "tokens must be ints, got 'x' (str)"),
    ],
)
def test_a_bad_token_sequence_is_refused_naming_what_is_wrong(given: object, message: str) -> None:
    """Each refusal is a MisuseError whose message is exactly the shape, dtype, type or
    first bad token at fault."""
    with pytest.raises(MisuseError, match=f"^{re.escape(message)}$"):
        as_tokens(given)


@pytest.mark.parametrize("bad", [np.float64(2.0), np.bool_(True), np.str_("2")])
def test_numpy_scalars_that_are_not_integers_are_refused(bad: object) -> None:
    with pytest.raises(MisuseError, match=f"^{re.escape(f'tokens must be ints, got {bad!r} ({type(bad).__name__})')}$"):
        as_tokens([1, np.int64(2), bad])


def test_a_numpy_integer_past_int64_is_refused() -> None:
    with pytest.raises(MisuseError, match=f"^tokens must be ints in int64 range, got {2**64 - 1}$"):
        as_tokens([1, np.uint64(2**64 - 1)])
