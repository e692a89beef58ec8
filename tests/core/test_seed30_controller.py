"""Controller contracts the seed-30 mutation draw found unchecked: a released request holds
no page list, a storage copy with no store is a bug named at its run, and a device mover
that releases the request while it is refused a copy makes the call refuse by name. The
movers hold every copy until told (hicache.testing.tag_movers)."""

from __future__ import annotations

import pytest

from hicache.errors import IntegrityError, MisuseError
from hicache.spec.model import Direction, Tier
from hicache.testing.tag_movers import TagTicket
from tests.core.test_seed26_controller import _cached, _make


def test_a_released_request_holds_an_empty_page_list() -> None:
    """After release a request that had an L1 hit and private pages holds an empty page
    list, no private pages and no pin."""
    c, _ = _make()
    _cached(c, [1, 2, 3, 4])
    req = c.admit([1, 2, 3, 4, 5, 6])
    assert len(req.pages) == 2 and c.allocate(req, 1) is not None
    c.release(req)
    assert (req.pages, req.private, req.lease) == ([], [], None)
    c.close()


def test_a_storage_copy_without_a_store_is_an_integrity_error_at_its_run() -> None:
    """Starting a write to storage when the controller has no store (no public call gets
    there: a bug) raises IntegrityError "structure" at the run, counts no failed copy and
    leaves the run as it was."""
    c, _ = _make()
    tokens = (1, 2, 3, 4)
    _cached(c, list(tokens), Tier.L3)
    node = c.core.match_valid(tokens).l2.node
    c.storage = None
    with pytest.raises(IntegrityError) as refused:
        c._start(Direction.H2S, node, None)
    assert refused.value.invariant == "structure" and refused.value.detail == "H2S without storage"
    assert refused.value.where.startswith(f"Node#{node.id}(len=4, ")  # the run, as it was then
    assert c.metrics.directions[Direction.H2S.name].failed == 0
    assert not node.has(Tier.L3)
    c.check_integrity()
    c.close()


def test_a_restore_whose_mover_releases_the_request_and_fails_is_refused_by_name(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A device mover that releases the request while refusing its restore's copy:
    start_restore raises MisuseError naming itself, the request, its state and the step,
    and counts no fallback; integrity holds."""
    c, _ = _make()
    tokens = [1, 2, 3, 4]
    _cached(c, tokens, Tier.L1)
    req = c.admit(tokens)

    def release_and_refuse(*args: object, **kwargs: object) -> TagTicket:
        c.release(req)
        raise RuntimeError("no copy engine")

    monkeypatch.setattr(c.device, "h2d", release_and_refuse)
    refused = rf"^start_restore: request #{req.id} is released; 'skip' is not allowed there$"
    with pytest.raises(MisuseError, match=refused):
        c.start_restore(req)
    assert c.metrics.fallbacks == 0
    c.check_integrity()
    c.close()
