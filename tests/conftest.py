"""Hypothesis profiles: ``ci`` (default in the test command), ``dev``, ``long``.

Pick one with ``--hypothesis-profile=NAME`` or ``HYPOTHESIS_PROFILE=NAME``.
"""

from __future__ import annotations

import os
import warnings
from collections.abc import Iterator

import pytest
import torch
from hypothesis import HealthCheck, settings

from tests.threads import named, settle

# NOTE: must be set before hicache.backends.kernels is imported: Triton reads it at @jit time.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

settings.register_profile(
    "ci",
    max_examples=400,
    stateful_step_count=60,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
    derandomize=True,
)
settings.register_profile("dev", max_examples=50, stateful_step_count=40, deadline=None)
settings.register_profile(
    "long",
    max_examples=3000,
    stateful_step_count=150,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "ci"))


@pytest.fixture(autouse=True)
def _settle_dropped_caches() -> Iterator[None]:
    """A cache a test dropped unclosed closes its storage when the collector finds it: make
    that happen in its own test's teardown, not inside a later test counting threads."""
    before = named("hicache-l3")
    yield
    # NOTE: only after a test that left more storage threads than it found (a collection
    # costs ~0.3 s with torch loaded; caches a module keeps alive are no one's garbage)
    if named("hicache-l3") > before or named("hicache-l3-close"):
        with warnings.catch_warnings(record=True) as seen:
            warnings.simplefilter("always")
            settle()
        for w in seen:  # shown as the run's filters say (-W error::ResourceWarning fails the test)
            warnings.warn_explicit(w.message, w.category, w.filename, w.lineno)


def _methods() -> dict[tuple[type, str], object]:
    """Every function-like attribute in the own namespace of each class of a loaded
    ``hicache`` module: what a test patching a method must leave as it found it."""
    import sys
    import types

    seen: dict[tuple[type, str], object] = {}
    for name, module in list(sys.modules.items()):
        if module is None or not (name == "hicache" or name.startswith("hicache.")):
            continue
        for cls in list(vars(module).values()):
            if not isinstance(cls, type) or cls.__module__ != name:
                continue
            for attr, value in list(vars(cls).items()):
                if isinstance(value, (types.FunctionType, property, staticmethod, classmethod)):
                    seen[(cls, attr)] = value
    return seen


@pytest.fixture(autouse=True)
def _no_patched_method_left() -> Iterator[None]:
    """A method patched by hand and set back with ``setattr`` stays on the class it was
    set on: set back on a subclass that inherited it, it hides every later patch of the
    base's (a scene waiting on the real method for good). monkeypatch undoes it right."""
    before = _methods()
    yield
    after = _methods()
    classes = {cls for cls, _ in before}
    left = sorted(
        f"{cls.__qualname__}.{attr}"
        for (cls, attr), value in after.items()
        if before.get((cls, attr), None if cls in classes else value) is not value
    )
    if left:
        raise AssertionError(f"the test left methods patched: {', '.join(left)}")
