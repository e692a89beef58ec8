"""The storage movers take the StorageMover protocol's parameters, defaults included."""

from __future__ import annotations

import inspect

import pytest

from hicache.backends.stores.mover import StoreMover
from hicache.core.protocols import StorageMover
from hicache.testing.tag_movers import TagStorage

_METHODS = ("write", "read", "exists", "close", "status")


def _params(f: object) -> list[tuple[str, object, object]]:
    """Name, kind and default of each parameter (annotations may narrow: not compared)."""
    return [(p.name, p.kind, p.default) for p in inspect.signature(f).parameters.values()]  # type: ignore[arg-type]


@pytest.mark.parametrize("impl", [StoreMover, TagStorage])
@pytest.mark.parametrize("name", _METHODS)
def test_a_storage_mover_method_has_the_protocols_signature(impl: type, name: str) -> None:
    """Same parameter names, kinds and defaults as the protocol (``close`` waits by default):
    a caller written against the protocol gets what it reads there."""
    assert _params(getattr(impl, name)) == _params(getattr(StorageMover, name))
