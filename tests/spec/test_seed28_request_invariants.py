"""Request invariants the seed-28 mutation draw found unchecked: a lease a transfer holds at
both ends has two holders, and a restore's source pin must be in the source tier *and*
cover its planned length (either failing is a report)."""

from __future__ import annotations

import dataclasses

import pytest

from hicache.spec.model import Tier
from hicache.spec.request_invariants import check_requests
from tests.spec.test_request_invariants import base


def test_a_transfer_whose_destination_lease_is_its_source_lease_holds_it_twice() -> None:
    """A transfer naming one lease as both its source and its destination pin counts as
    two holders of that lease."""
    b = base()
    with_dst = [x for x in b.snap.transfers.values() if x.dst_lease is not None]
    assert with_dst, "the base snapshot has a transfer with a destination pin"
    x = with_dst[0]
    transfers = {**b.snap.transfers, x.id: dataclasses.replace(x, dst_lease=x.src_lease)}
    found = check_requests(dataclasses.replace(b.snap, transfers=transfers))
    assert ("request-holdings.lease-holders", f"lease #{x.src_lease}", "2 holders") in {
        (v.code, v.where, v.detail) for v in found
    }, found


@pytest.mark.parametrize(("tier", "length"), [(Tier.L3, 4), (Tier.L2, 2)], ids=["wrong-tier", "too-short"])
def test_a_source_pin_in_the_wrong_tier_or_too_short_is_reported(tier: Tier, length: int) -> None:
    """The L2 restore's source pin moved to L3 (still long enough), or kept in L2 but
    covering only 2 of the 4 planned tokens, is reported as its source not pinned."""
    b = base()
    assert b.loading.source is not None and b.loading.restore_tokens == 4
    pin = b.snap.leases[b.loading.source]
    assert (pin.tier, pin.length) == (Tier.L2, 4)
    leases = {**b.snap.leases, pin.id: dataclasses.replace(pin, tier=tier, length=length)}
    found = check_requests(dataclasses.replace(b.snap, leases=leases))
    assert ("request-pins.source", f"request #{b.loading.id}", "restoring without its L2 source pinned") in {
        (v.code, v.where, v.detail) for v in found
    }, found
