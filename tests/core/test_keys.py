"""Page content keys: equal prefixes give equal keys; any change of model, layout or an
earlier token gives different ones."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import pytest
import torch

from hicache.core.geometry import KVGeometry
from hicache.core.keys import KEY_BYTES, format_seed, page_keys
from hicache.errors import MisuseError

G = KVGeometry(4, 2, 64, 4, torch.bfloat16)
TOKENS = list(range(100, 124))  # 6 pages of 4


def test_same_prefix_same_keys_and_extending_keeps_them() -> None:
    """Two derivations of one prefix agree, and keys of a longer prompt start with them."""
    seed = format_seed("m", G)
    a = page_keys(seed, TOKENS, 4)
    assert a == page_keys(format_seed("m", G), list(TOKENS), 4)
    assert page_keys(seed, [*TOKENS, 7, 8, 9, 10, 11], 4)[: len(a)] == a
    assert len(a) == 6 and all(len(k) == KEY_BYTES for k in a) and len(set(a)) == 6


def test_keys_chain_from_the_parent() -> None:
    """Keying the tail from the key before it equals keying the whole prompt."""
    seed = format_seed("m", G)
    whole = page_keys(seed, TOKENS, 4)
    assert page_keys(whole[2], TOKENS[12:], 4) == whole[3:]


def test_partial_page_gets_no_key() -> None:
    seed = format_seed("m", G)
    assert page_keys(seed, TOKENS[:7], 4) == page_keys(seed, TOKENS[:4], 4)
    assert page_keys(seed, TOKENS[:3], 4) == []


def test_an_earlier_token_changes_every_later_key() -> None:
    seed = format_seed("m", G)
    base = page_keys(seed, TOKENS, 4)
    changed = list(TOKENS)
    changed[5] += 1  # in page 1
    other = page_keys(seed, changed, 4)
    assert other[0] == base[0]
    assert all(x != y for x, y in zip(other[1:], base[1:], strict=True))


@pytest.mark.parametrize(
    "change",
    [
        {"model_id": "m2"},
        {"num_layers": 5},
        {"num_kv_heads": 4},
        {"head_dim": 128},
        {"page_size": 8},
        {"dtype": torch.float16},
        {"format_version": 2},
        {"shard": "tp1/2"},
    ],
)
def test_any_identity_change_gives_other_keys(change: dict[str, object]) -> None:
    """Model, each geometry field, dtype, page size, format version and shard all enter
    the seed: a change of any one never matches."""
    args: dict[str, object] = {"model_id": "m", "format_version": 1, "shard": ""}
    geometry = G
    fields = {f.name for f in dataclasses.fields(KVGeometry)}
    for name, value in change.items():
        if name in fields:
            geometry = dataclasses.replace(geometry, **{name: value})  # type: ignore[arg-type]
        else:
            args[name] = value
    base = page_keys(format_seed("m", G), TOKENS, 4)
    seed = format_seed(str(args["model_id"]), geometry, int(str(args["format_version"])), str(args["shard"]))
    assert seed != format_seed("m", G)
    assert set(page_keys(seed, TOKENS, 4)).isdisjoint(base)


def test_bad_inputs_raise() -> None:
    seed = format_seed("m", G)
    for parent, tokens, ps in (
        (b"short", TOKENS, 4),
        (seed, TOKENS, 0),
        (seed, [1.5, 2, 3, 4], 4),
        (seed, [2**70] * 4, 4),
    ):
        with pytest.raises(MisuseError):
            page_keys(parent, tokens, ps)  # type: ignore[arg-type]
    with pytest.raises(MisuseError):
        format_seed("", G)


def test_format_version_zero_and_page_size_one_are_valid() -> None:
    """The smallest legal values are accepted: format version 0 is its own identity, and
    pages of one token give one key per token."""
    v0 = format_seed("m", G, 0)
    assert v0 != format_seed("m", G, 1)
    keys = page_keys(v0, TOKENS[:5], 1)
    assert len(keys) == 5 and keys[:4] == page_keys(v0, TOKENS[:4], 1)


@pytest.mark.parametrize(
    ("call", "match"),
    [
        (lambda seed: format_seed("m", G, -1), r"format_version .*-1"),
        (lambda seed: format_seed("m", G, True), r"format_version .*True"),
        (lambda seed: format_seed("m", G, shard=3), r"shard must be a str of text, got 3"),  # type: ignore[arg-type]
        (lambda seed: format_seed("m", G, shard="\ud800"), r"shard must be a str of text, got '\\ud800'"),
        (lambda seed: format_seed("m\ud800", G), r"model_id must be a non-empty str of text, got 'm\\ud800'"),
        (lambda seed: page_keys(seed, TOKENS, True), r"page_size .*True"),
        (lambda seed: page_keys(seed, TOKENS, 4.0), r"page_size .*4\.0"),  # type: ignore[arg-type]
        (lambda seed: page_keys(seed, TOKENS, 0), r"page_size .*0"),
        (lambda seed: page_keys(seed, [2**70] * 4, 4), r"tokens must be ints in int64 range"),
        (lambda seed: page_keys(seed, [1.5, 2, 3, 4], 4), r"tokens must be ints in int64 range"),  # type: ignore[list-item]
    ],
)
def test_bad_inputs_name_the_bad_value(call: Callable[[bytes], object], match: str) -> None:
    """Each bad argument raises MisuseError naming the argument (a bool is no int)."""
    with pytest.raises(MisuseError, match=match):
        call(format_seed("m", G))


# format_seed("m", G) as keyed stores have named pages since format v1 (a change of the
# encoding would orphan every page stored)
KNOWN_SEED_M = "ac6b2d7dee18bd3ccc96aa2ac3b359eb"


def test_a_model_id_decoded_from_a_non_utf8_path_has_keys_of_its_own() -> None:
    """A checkpoint name decoded with ``os.fsdecode`` from bytes that are not UTF-8 keeps its
    raw bytes (surrogate escapes): it seeds keys, names of other bytes get other keys, and
    names in UTF-8 keep the keys they had. (Two strings of the same bytes, as ``os.fsencode``
    sees them, are one name: ``"é"`` and its escaped UTF-8 bytes seed alike.)"""
    import os

    name = os.fsdecode(b"ckpt-\xff")
    seeds = {format_seed(name, G), format_seed(os.fsdecode(b"ckpt-\xfe"), G), format_seed("ckpt-\xff", G)}
    assert len(seeds) == 3
    assert format_seed("m", G).hex() == KNOWN_SEED_M  # unchanged: stores keep their pages
