"""as_tokens: which token sequences the core accepts, and what its refusals say."""

from __future__ import annotations

import re

import numpy as np
import pytest
import torch

from hicache.core.tokens import as_tokens
from hicache.errors import MisuseError


class _ListOnly:
    """Has ``tolist`` but no ``ndim``: not an array, not a sequence."""

    def tolist(self) -> list[int]:
        return [1, 2]


@pytest.mark.parametrize(
    "given",
    [(5, 6, 7), [5, 6, 7], torch.tensor([5, 6, 7]), torch.tensor([5, 6, 7], dtype=torch.int32), np.array([5, 6, 7])],
)
def test_a_one_dimensional_integer_sequence_becomes_a_tuple_of_ints(given: object) -> None:
    """Tuples, lists, integer tensors and arrays of one dimension give the same tuple of ints."""
    out = as_tokens(given)
    assert out == (5, 6, 7)
    assert type(out) is tuple and all(type(x) is int for x in out)


@pytest.mark.parametrize(
    ("given", "message"),
    [
        (torch.tensor([[1, 2]]), "tokens must be 1-D, got a tensor of shape (1, 2)"),
        (torch.tensor(3), "tokens must be 1-D, got a tensor of shape ()"),
        (torch.tensor([1.0, 2.0]), "tokens must be integers, got dtype torch.float32"),
        (torch.tensor([1 + 0j, 2 + 0j]), "tokens must be integers, got dtype torch.complex64"),
        (torch.tensor([True, False]), "tokens must be integers, got dtype torch.bool"),
        (np.array([[1, 2]]), "tokens must be 1-D, got ndim=2"),
        (_ListOnly(), "tokens must be a 1-D sequence of ints, got _ListOnly"),
        ("12", "tokens must be a 1-D sequence of ints, got str"),
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
