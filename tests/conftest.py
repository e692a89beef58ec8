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
