"""The ``mooncake_cluster`` fixture: one private Mooncake Store per test session.

Tests that need it skip with the reason when Mooncake or a network namespace cannot be had,
unless ``scripts/setup.sh`` installed Mooncake successfully (it leaves ``READY`` in
``.venv/mooncake-libs``): then they fail, so CI cannot skip them silently.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.mooncake.cluster import READY_MARK, MooncakeCluster, Unavailable


@pytest.fixture(scope="session")
def mooncake_cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[MooncakeCluster]:
    workdir: Path = tmp_path_factory.mktemp("mooncake")
    try:
        with MooncakeCluster.start(workdir) as mc:
            yield mc
    except Unavailable as exc:
        if READY_MARK.exists():
            pytest.fail(f"Mooncake was installed by scripts/setup.sh but cannot run: {exc}")
        pytest.skip(str(exc))
