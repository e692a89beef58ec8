"""Shared by the end-to-end benchmarks: page fingerprints (the bit-identity gate), result
files, device naming."""

from __future__ import annotations

import json
from datetime import date
from pathlib import Path
from typing import Any

import torch
import xxhash

from hicache.engine import Engine, Output

RESULTS = Path(__file__).parent / "results"


def device_name(device: str) -> str:
    return torch.cuda.get_device_name() if device.startswith("cuda") else "CPU"


def tag_of(device: str) -> str:
    name = device_name(device)
    return "h200" if "H200" in name else name.lower().replace(" ", "-")


def fingerprint(engine: Engine, tokens: list[int], n_pages: int) -> str | None:
    """xxh3 of the L1 bytes of ``tokens``' first ``n_pages`` pages, or None if they are not
    all in L1. Equal fingerprints before saving and after a restore = bit-identical pages."""
    core = engine.cache.core
    hit = core.match(tokens).l1
    pages = core.pages_l1(hit)[:n_pages]
    if len(pages) < n_pages:
        return None
    data = engine.cache.l1.buffer[:, :, pages].contiguous().cpu()
    return xxhash.xxh3_128_hexdigest(data.view(torch.uint8).numpy().tobytes())


class PageCheck:
    """Records a prefix's page fingerprint whenever it is computed; checks every restore of
    it against the last one. ``mismatches`` must stay 0."""

    def __init__(self) -> None:
        self.saved: dict[int, str] = {}
        self.checked = 0
        self.mismatches = 0

    def observe(self, engine: Engine, key: int, tokens: list[int], n_pages: int, out: Output) -> None:
        fp = fingerprint(engine, tokens, n_pages)
        if fp is None or out.error is not None:
            return
        if out.restored_from in ("L2", "L3") and key in self.saved:
            self.checked += 1
            self.mismatches += fp != self.saved[key]
        elif out.cached_tokens < n_pages * engine.page_size:  # this request computed them
            self.saved[key] = fp

    def to_dict(self) -> dict[str, int]:
        return {"restores_checked": self.checked, "page_mismatches": self.mismatches}


def write_results(
    out: Path, stem: str, device: str, meta: dict[str, Any], rows: list[dict[str, Any]], tag: str | None = None
) -> Path:
    """``out/stem-DATE-TAG.json``; returns the path without suffix (for the PNG)."""
    out.mkdir(parents=True, exist_ok=True)
    meta = {"date": date.today().isoformat(), "device": device_name(device), **meta}
    path = out / f"{stem}-{meta['date']}-{tag or tag_of(device)}"
    path.with_suffix(".json").write_text(json.dumps({"meta": meta, "rows": rows}, indent=1, default=str))
    return path
