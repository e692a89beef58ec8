"""Content keys of pages (DESIGN.md §6b): what names a page in a persistent or shared L3.

    seed     = format_seed(model, geometry)                      16 bytes
    key[0]   = H(seed   || tokens[0 : ps])
    key[i]   = H(key[i-1] || tokens[i*ps : (i+1)*ps])            H = xxh3-128

A key names the whole prefix up to the end of its page, in one model and one KV layout:
two processes that compute the same prefix with the same seed derive the same keys, and
a different model, layout, page size or format version never matches. Tokens are hashed
as little-endian int64; only whole pages get a key.
"""

from __future__ import annotations

import struct
from collections.abc import Sequence

import xxhash

from hicache.core.geometry import KVGeometry
from hicache.errors import MisuseError

KEY_BYTES = 16
FORMAT_VERSION = 1  # bump when the bytes of a stored page change meaning
_TOKEN_BYTES = 8


def format_seed(model_id: str, geometry: KVGeometry, format_version: int = FORMAT_VERSION, shard: str = "") -> bytes:
    """The key of the empty prefix: model identity (name or checkpoint hash), KV geometry,
    dtype, page size and format version. ``shard`` names this rank's slice of the KV heads
    (e.g. ``"tp0/2"``) when ranks store different heads of the same geometry."""
    if not isinstance(model_id, str) or not model_id or not encodable(model_id):
        raise MisuseError(f"model_id must be a non-empty str of text, got {model_id!r:.80}")
    if isinstance(format_version, bool) or not isinstance(format_version, int) or format_version < 0:
        raise MisuseError(f"format_version must be a non-negative int, got {format_version!r}")
    if not isinstance(shard, str) or not encodable(shard):
        raise MisuseError(f"shard must be a str of text, got {shard!r:.80}")
    g = geometry
    fields = (
        "hicache-kv",
        f"v{format_version}",
        model_id,
        shard,
        f"layers={g.num_layers}",
        f"kv_heads={g.num_kv_heads}",
        f"head_dim={g.head_dim}",
        f"page={g.page_size}",
        f"dtype={g.dtype}",
    )
    # NOTE: length-prefixed fields, so no two different tuples serialize alike.
    raw = [f.encode("utf-8", "surrogateescape") for f in fields]
    blob = b"".join(len(r).to_bytes(4, "little") + r for r in raw)
    return xxhash.xxh3_128_digest(blob)


def page_keys(parent: bytes, tokens: Sequence[int], page_size: int) -> list[bytes]:
    """Keys of the whole pages of ``tokens``, chained from ``parent`` (the key of the page
    before the first, or the seed). A trailing partial page gets no key."""
    if not isinstance(parent, bytes) or len(parent) != KEY_BYTES:
        raise MisuseError(f"parent key must be {KEY_BYTES} bytes, got {parent!r}")
    if isinstance(page_size, bool) or not isinstance(page_size, int) or page_size <= 0:
        raise MisuseError(f"page_size must be a positive int, got {page_size!r}")
    n = len(tokens) // page_size * page_size
    try:
        # NOTE: one struct.pack for the whole prompt is the cheapest int -> bytes here
        # (about half the cost of array/numpy conversions of a Python list).
        raw = struct.pack(f"<{n}q", *tokens[:n])
    except struct.error as exc:
        raise MisuseError(f"tokens must be ints in int64 range: {exc}") from exc
    step = page_size * _TOKEN_BYTES
    digest = xxhash.xxh3_128_digest
    keys: list[bytes] = []
    key = parent
    for offset in range(0, n * _TOKEN_BYTES, step):
        key = digest(key + raw[offset : offset + step])
        keys.append(key)
    return keys


def encodable(text: str) -> bool:
    """Whether ``text`` has bytes: UTF-8, where a name decoded from a non-UTF-8 path
    (``os.fsdecode``) keeps its raw bytes; a lone surrogate of any other kind has none."""
    try:
        text.encode("utf-8", "surrogateescape")
    except UnicodeEncodeError:
        return False
    return True
