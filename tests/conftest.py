"""Hypothesis profiles: ``ci`` (default in the test command), ``dev``, ``long``.

Pick one with ``--hypothesis-profile=NAME`` or ``HYPOTHESIS_PROFILE=NAME``.
"""

from __future__ import annotations

import os

from hypothesis import HealthCheck, settings

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
