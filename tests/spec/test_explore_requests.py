"""The request explorer: the real controller, every interleaving of requests and copies at
small scope, holds every invariant and reaches every request transition — and it finds the
controller bugs it exists to find (each mutation below is a known way to get it wrong)."""

from __future__ import annotations

import functools
import inspect
import textwrap
from collections.abc import Iterator

import pytest

from hicache.core import controller as controller_module
from hicache.core.controller import Controller
from hicache.spec.explorer import ExploreReport
from hicache.spec.request import REQUEST_TABLE
from hicache.testing import explore_requests
from hicache.testing.explore_requests import CONFIGS, run


@functools.cache
def _report(name: str) -> ExploreReport:
    return run(name)


@pytest.mark.slow  # about a minute in all; CI runs it, the mutation run does not
@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_config_holds_every_invariant(name: str) -> None:
    """No interleaving within the configuration's depth breaks an invariant, puts a wrong
    tag in a published page or a live request's prefix, or makes the controller raise."""
    report = _report(name)
    assert report.states > 1
    assert report.violations == [], report.violations[0]


@pytest.mark.slow
def test_configs_together_reach_every_request_transition() -> None:
    """Every transition of the request table is taken by the real controller somewhere."""
    covered: set[object] = set()
    for name in CONFIGS:
        covered |= _report(name).covered.get("request", set())
    assert set(REQUEST_TABLE) <= covered, sorted(map(repr, set(REQUEST_TABLE) - covered))


# (method, the text it holds, what a bug puts there instead, the configuration that shows it)
MUTATIONS = {
    "publish-keeps-old-pin": ("_publish", "core.release(req.lease)", "pass", "wt-warm"),
    "end-restore-keeps-source": ("_end_restore", "self.core.release(restore.source)", "pass", "wt-warm"),
    "promotion-unpinned": (
        "_advance",
        "source = core.lock(TierMatch(Tier.L2, restore.plan.tokens, bottom, bottom.version[Tier.L2]))",
        "source = None",
        "wt-warm",
    ),
    "prefix-pages-reordered": ("_prefix_after", "return [*req.pages, *dst]", "return [*dst, *req.pages]", "wt-ps2"),
    "release-keeps-private": ("release", "self.core.free_private(req.private)", "pass", "wt-ps1"),
}


@pytest.fixture
def mutant(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> Iterator[str]:
    method, original, replacement, config = MUTATIONS[request.param]
    source = textwrap.dedent(inspect.getsource(getattr(Controller, method)))
    assert source.count(original) == 1, f"{method} no longer holds {original!r}: update the mutation"
    namespace: dict[str, object] = {}
    code = compile(source.replace(original, replacement), controller_module.__file__, "exec")
    exec(code, vars(controller_module), namespace)
    monkeypatch.setattr(Controller, method, namespace[method])
    yield config


@pytest.mark.slow
@pytest.mark.parametrize("mutant", sorted(MUTATIONS), indirect=True)
def test_explorer_finds_the_mutation(mutant: str) -> None:
    """With the bug put into the controller, the explorer reports a violation."""
    report = explore_requests.run(mutant)
    assert report.violations, f"the explorer missed the mutation in {mutant}"
