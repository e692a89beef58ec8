"""Hypothesis profiles: ``ci`` (default in the test command), ``dev``, ``long``.

Pick one with ``--hypothesis-profile=NAME`` or ``HYPOTHESIS_PROFILE=NAME``.
"""

from __future__ import annotations

import os
import threading
import warnings
from collections.abc import Iterator

import pytest
import torch
from hypothesis import HealthCheck, settings

from tests.threads import settle

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
    yield
    if any(t.name.startswith("hicache-l3") for t in threading.enumerate()):
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", ResourceWarning)
            settle()
