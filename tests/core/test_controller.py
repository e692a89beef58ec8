"""The controller over real CPU backends (L2 in memory, L3 a real temporary file)."""

from __future__ import annotations

import json
import os
import threading
from pathlib import Path

import pytest
import torch

from hicache import HiCache, HiCacheConfig
from hicache.backends.verify import DigestVerifier
from hicache.core.controller import Request
from hicache.core.cost import CostPriors
from hicache.core.geometry import KVGeometry
from hicache.errors import ConfigError, HandleError, MisuseError
from hicache.spec.model import Direction, Tier

G = KVGeometry(2, 2, 8, 2, torch.float32)


def make(**kw: object) -> HiCache:
    cfg = dict(geometry=G, l1_pages=8, l2_pages=8, l3_pages=16, policy="always", tracing=True, device="cpu")
    cfg.update(kw)
    return HiCache(HiCacheConfig(**cfg))  # type: ignore[arg-type]


def prefill(c: HiCache, tokens: list[int]) -> tuple[Request, torch.Tensor]:
    """Admit, allocate, 'compute' random KV into the private pages, insert."""
    req = c.admit(tokens)
    n = len(tokens) // G.page_size - req.cached_len // G.page_size
    pages = c.allocate(req, n)
    assert pages is not None
    c.l1.buffer[:, :, pages] = torch.randn(c.l1.buffer[:, :, pages].shape)
    c.insert(req, pages)
    return req, c.l1.buffer[:, :, c.prefix_pages(req)].clone()


def drain(c: HiCache) -> None:
    for _ in range(1000):
        c.poll()
        st = c.status()
        if not st.pending_backups and not st.pending_restores:
            return
        threading.Event().wait(0.001)
    raise AssertionError("transfers never finished")


def evict_all(c: HiCache, *tiers: Tier) -> None:
    for t in tiers:
        c.core.evict(t, 10**6)


def cached(c: HiCache, tokens: list[int], *drop: Tier) -> torch.Tensor:
    """Prefill ``tokens``, write them through to L3, release, then drop the given tiers.
    Returns the KV pages as computed."""
    req, kv = prefill(c, tokens)
    c.release(req)
    drain(c)
    evict_all(c, *drop)
    return kv


@pytest.mark.parametrize("blocking", [True, False])
@pytest.mark.parametrize("tier", [Tier.L2, Tier.L3])
def test_restore_is_bit_exact_and_published_before_use(tier: Tier, blocking: bool) -> None:
    c = make()
    tokens = list(range(10))
    req, kv = prefill(c, tokens)
    c.release(req)
    drain(c)
    assert c.core.match(tokens).lengths == (10, 10, 10)
    evict_all(c, Tier.L1, *([Tier.L2] if tier is Tier.L3 else []))
    req = c.admit(tokens)
    assert req.cached_len == 0
    plan = c.plan(req)
    assert plan.tier is tier and plan.tokens == 10
    if blocking:
        assert c.restore(req, plan)
    else:
        pending = c.start_restore(req, plan)
        assert pending is not None and req.cached_len == 0  # nothing usable before publish
        while not pending.finished:
            c.poll()
        assert pending.stage == "done"
    assert req.cached_len == 10
    assert torch.equal(c.l1.buffer[:, :, c.prefix_pages(req)], kv)
    assert c.metrics.hit_tokens[tier.name] == 10 and c.metrics.restores == 1
    if tier is Tier.L3:
        assert c.metrics.promotions >= 1
    c.check_integrity()
    c.release(req)
    c.close()


def test_a_layered_restore_names_the_pages_it_will_publish() -> None:
    """``start_restore(layer_events=...)`` gives the L1 pages of the whole restored prefix
    in token order (the L1-resident parent's, then the H2D's) before publication; they are
    exactly the pages the request reads once published."""
    c = make()
    parent, child = list(range(6)), list(range(6)) + list(range(100, 106))
    kv = cached(c, parent)
    cached(c, child)
    c.core.evict(Tier.L1, 3)  # the child's run (an L1 leaf) only; the parent stays in L1
    req = c.admit(child)
    hit = c.prefix_pages(req)
    assert req.cached_len == 6 and c.core.match(child).lengths[1] == 12
    pending = c.start_restore(req, c.plan(req), layer_events=())
    assert pending is not None and pending.layered and pending.pages is not None
    assert pending.pages[:3] == hit and len(pending.pages) == 6 and req.cached_len == 6
    while not pending.finished:
        c.poll()
    assert pending.stage == "done" and req.cached_len == 12
    assert c.prefix_pages(req) == pending.pages
    assert torch.equal(c.l1.buffer[:, :, pending.pages[:3]], kv)
    plain = c.start_restore(c.admit(parent), None)  # without events: nothing to name
    assert plain is None or not plain.layered
    c.check_integrity()
    c.close()


def test_l3_promotion_stays_with_the_tree_when_h2d_cannot_start() -> None:
    """The seed's second bug: after the S2H is published, failing to get L1 pages for the
    H2D must not hand the promoted L2 pages back to the free list."""
    c = make()
    tokens = list(range(8))
    cached(c, tokens, Tier.L1, Tier.L2)
    blocker = c.admit([99] * 16)  # pins every L1 page so no H2D destination can be found
    assert c.allocate(blocker, 8) is not None
    req = c.admit(tokens)
    pending = c.start_restore(req, c.plan(req))
    assert pending is not None
    while not pending.finished:
        c.poll()
    assert pending.stage == "failed" and "L1" in (pending.error or "")
    assert c.metrics.fallbacks == 1 and req.cached_len == 0
    assert c.core.match(tokens).lengths == (0, 8, 8)  # promoted L2 copy kept by the tree
    c.check_integrity()
    c.release(blocker)
    c.release(req)
    c.check_integrity()
    c.close()


def test_abort_mid_restore_leaks_nothing() -> None:
    c = make()
    tokens = list(range(12))
    req, _kv = prefill(c, tokens)
    c.release(req)
    drain(c)
    evict_all(c, Tier.L1, Tier.L2)
    c.faults.add("slow", op="read", delay_s=0.05)
    req = c.admit(tokens)
    pending = c.start_restore(req, c.plan(req))
    assert pending is not None
    stage_at_start = pending.stage
    c.release(req)  # abort while the S2H is in flight
    drain(c)
    assert (stage_at_start, pending.finished, pending.stage) == ("s2h", True, "cancelled")
    st = c.status().core
    assert st.leases == 0 and st.tiers[0].private == 0
    assert all(t.in_flight == 0 for t in st.tiers)
    c.check_integrity()
    c.close()


def test_pages_the_tree_refuses_stay_with_the_request() -> None:
    """Request B recomputes a prefix whose run has an H2D in flight: the tree refuses B's
    pages there, and B must keep them (a regression: they were freed while B still read
    them, and the engine's page table fell short)."""
    c = make()
    tokens = list(range(8))
    cached(c, tokens, Tier.L1)
    h2d = c.core.start(Direction.H2D, c.core.match(tokens).l2.node)  # a restore in flight
    assert h2d is not None
    b, _ = prefill(c, tokens)  # the same prefix, computed meanwhile
    assert b.cached_len == 0 and len(b.private) == 4
    assert not set(b.private) & set(c.core.l1.free_pages())
    c.core.fail(h2d)
    c.release(b)
    st = c.status().core
    assert st.leases == 0 and st.tiers[0].private == 0
    c.check_integrity()
    c.close()


@pytest.mark.parametrize("tier", [Tier.L2, Tier.L3])
def test_verify_pages_catches_a_page_changed_behind_our_back(tier: Tier) -> None:
    """With verify_pages, every arrival is digest-checked against the page as computed: a
    clean restore passes; an L2 page altered after the backup fails the restore (the
    request recomputes) and is counted."""
    c = make(verify_pages=True)
    tokens = list(range(8))
    kv = cached(c, tokens, Tier.L1)
    req = c.admit(tokens)
    assert c.restore(req, c.plan(req))
    assert torch.equal(c.l1.buffer[:, :, c.prefix_pages(req)], kv)
    assert c.metrics.verified_pages >= 8 and c.metrics.verify_failures == 0
    c.release(req)
    evict_all(c, Tier.L1, *([Tier.L2] if tier is Tier.L3 else []))
    if tier is Tier.L2:
        c.l2.page_buffer[c.core.pages(c.core.match(tokens).l2)[1]].view(-1).view(torch.uint8)[5] ^= 1
    else:  # L3's own checksums pass; the digest catches a bad page written through
        slot = c.core.pages(c.core.match(tokens).l3)[0]
        verifier = c.controller.verifier
        assert isinstance(verifier, DigestVerifier)
        verifier.slot_digests[slot] ^= 1
    req = c.admit(tokens)
    assert not c.restore(req, c.plan(req))
    assert c.metrics.verify_failures == 1 and c.metrics.fallbacks == 1 and req.cached_len == 0
    c.release(req)
    c.check_integrity()
    c.close()


@pytest.mark.parametrize("how", ["truncated", "deleted", "garbled"])
def test_l3_file_changed_underneath(tmp_path: Path, how: str) -> None:
    """Someone truncates, deletes or overwrites the L3 file while we hold pages in it: a
    truncated or garbled file fails the read (EOF / checksum) and the request recomputes;
    a deleted file keeps serving through our open descriptor. Never a wrong page."""
    path = tmp_path / "l3.bin"
    c = make(storage_path=str(path))
    tokens = list(range(8))
    kv = cached(c, tokens, Tier.L1, Tier.L2)
    if how == "truncated":
        os.truncate(path, 0)
    elif how == "deleted":
        path.unlink()
    else:
        with open(path, "r+b") as f:
            f.write(os.urandom(path.stat().st_size))
    req = c.admit(tokens)
    ok = c.restore(req, c.plan(req))
    assert ok == (how == "deleted")
    if ok:
        assert torch.equal(c.l1.buffer[:, :, c.prefix_pages(req)], kv)
    else:
        assert c.metrics.fallbacks == 1 and req.cached_len == 0 and c.metrics.directions["S2H"].failed == 1
    c.release(req)
    st = c.status().core
    assert st.leases == 0 and all(t.in_flight == 0 for t in st.tiers)
    c.check_integrity()
    c.close()


@pytest.mark.parametrize("kind", ["eio", "corrupt", "eof"])
def test_failed_read_falls_back_to_recompute(kind: str) -> None:
    c = make()
    tokens = list(range(8))
    cached(c, tokens, Tier.L1, Tier.L2)
    c.faults.add(kind, op="read")  # type: ignore[arg-type]
    req = c.admit(tokens)
    assert not c.restore(req, c.plan(req))
    assert req.cached_len == 0 and c.metrics.fallbacks == 1
    assert c.metrics.directions["S2H"].failed == 1
    c.check_integrity()
    n = len(tokens) // G.page_size
    pages = c.allocate(req, n)  # the request recomputes
    assert pages is not None and c.insert(req, pages) == 8
    c.release(req)
    c.close()


def test_write_through_reaches_l3_and_skips_when_no_room() -> None:
    c = make(l2_pages=2, l3_pages=4)
    req, _ = prefill(c, list(range(4)))  # 2 pages: fits L2
    drain(c)
    assert c.core.match(list(range(4))).lengths == (4, 4, 4)
    req2, _ = prefill(c, [7] * 8)  # 4 pages: L2 (2 pages, pinned by nothing) cannot hold it
    drain(c)
    assert c.metrics.backups_skipped >= 1
    c.release(req)
    c.release(req2)
    c.check_integrity()
    c.close()


def test_never_policy_restores_nothing_and_counts_the_skip() -> None:
    c = make(policy="never")
    tokens = list(range(8))
    cached(c, tokens, Tier.L1)
    req = c.admit(tokens)
    assert c.start_restore(req) is None and c.metrics.policy_skips == 1
    c.release(req)
    c.close()


def test_cost_policy_recomputes_when_cheaper() -> None:
    c = make(policy="cost", priors=CostPriors(recompute_s_per_token=1e-12))
    tokens = list(range(8))
    cached(c, tokens, Tier.L1)
    req = c.admit(tokens)
    assert c.plan(req).tier is Tier.L1
    c.release(req)
    c.close()


def test_contract_errors() -> None:
    c = make()
    req = c.admit([1, 2, 3, 4])
    with pytest.raises(MisuseError, match="private pages"):
        c.insert(req, [0])  # type: ignore[list-item]
    c.release(req)
    with pytest.raises(HandleError):
        c.release(req)
    errors: list[BaseException] = []

    def other_thread() -> None:
        try:
            c.admit([1, 2])
        except MisuseError as exc:
            errors.append(exc)

    t = threading.Thread(target=other_thread)
    t.start()
    t.join()
    assert errors and "single-threaded" in str(errors[0])
    c.close()
    with pytest.raises(MisuseError, match="closed"):
        c.admit([1, 2])
    with pytest.raises(ConfigError, match="write_policy"):
        make(write_policy="sometimes")
    with pytest.raises(ConfigError, match="L3 needs L2"):
        make(l2_pages=0)


def test_status_and_prometheus() -> None:
    c = make()
    req, _ = prefill(c, list(range(8)))
    drain(c)
    st = c.status().to_dict()
    json.dumps(st)  # JSON-serializable (§8)
    assert st["core"]["tiers"][1]["capacity"] == 8
    assert st["metrics"]["directions"]["D2H"]["count"] == 1
    assert set(st["cost_model"]) >= {"policy", "recompute", "H2D", "S2H"}
    text = c.prometheus()
    assert 'hicache_transfers_total{direction="D2H"} 1.0' in text
    assert "hicache_hit_tokens" in text
    c.release(req)
    c.close()


def test_write_back_backs_up_only_when_evicted_from_l1() -> None:
    c = make(write_policy="write_back", l1_pages=4)
    tokens = list(range(8))  # 4 pages: fills L1
    req, kv = prefill(c, tokens)
    drain(c)
    assert c.core.match(tokens).lengths == (8, 0, 0)  # nothing backed up at insert
    c.release(req)
    other = c.admit([9] * 4)
    assert c.allocate(other, 2) is not None  # L1 pressure: the victim goes to L2 first
    assert c.core.match(tokens).lengths[1] > 0
    c.release(other)
    evict_all(c, Tier.L1)
    req = c.admit(tokens)
    assert c.restore(req, c.plan(req)) and req.cached_len > 0
    assert torch.equal(c.l1.buffer[:, :, c.prefix_pages(req)], kv[:, :, : req.cached_len // G.page_size])
    c.check_integrity()
    c.release(req)
    c.close()


def test_selective_write_through_waits_for_repeat_hits() -> None:
    c = make(write_policy="write_through_selective", selective_hits=2)
    tokens = list(range(8))
    req, _ = prefill(c, tokens)
    drain(c)
    assert c.core.match(tokens).lengths[1] == 0
    c.release(req)
    for _ in range(2):
        c.release(c.admit(tokens))
    drain(c)
    assert c.core.match(tokens).lengths == (8, 8, 8)
    c.close()


def test_a_request_of_another_instance_is_refused() -> None:
    """A live handle admitted by one cache is unknown to another: every call there raises
    HandleError naming it, and the owner still serves it."""
    a, b = make(), make()
    req = a.admit([1, 2, 3, 4])
    for name, call in (
        ("plan", lambda: b.plan(req)),
        ("allocate", lambda: b.allocate(req, 1)),
        ("release", lambda: b.release(req)),
    ):
        with pytest.raises(
            HandleError,
            match=rf"^{name}: request #{req.id} is not a request of this cache \(admitted by another one\)$",
        ):
            call()
    assert a.plan(req).tokens >= 0
    a.release(req)
    a.close()
    b.close()


@pytest.mark.parametrize("how", ["drain", "a blocking restore"])
def test_a_restore_finished_outside_poll_is_reported_by_the_next_poll(how: str) -> None:
    """A restore that ``drain()`` or another request's blocking ``restore()`` finishes is
    still handed back by the next ``poll()``, once: an engine waiting for it from poll would
    otherwise wait forever. The blocking restore's own is not (its caller has it)."""
    c = make(l1_pages=16, l2_pages=16)
    a_tokens, b_tokens = list(range(8)), list(range(100, 108))
    kv_a, kv_b = cached(c, a_tokens), cached(c, b_tokens)
    evict_all(c, Tier.L1)
    a = c.admit(a_tokens)
    pending = c.start_restore(a, c.plan(a))
    assert pending is not None and not pending.finished
    b = None
    if how == "drain":
        c.drain()
    else:
        b = c.admit(b_tokens)
        assert c.restore(b, c.plan(b))
    assert pending.outcome is not None  # finished, and not yet reported
    assert c.poll() == [pending] and c.poll() == []
    assert torch.equal(c.l1.buffer[:, :, c.prefix_pages(a)], kv_a)
    if b is not None:
        assert torch.equal(c.l1.buffer[:, :, c.prefix_pages(b)], kv_b)
        c.release(b)
    c.release(a)
    c.check_integrity()
    c.close()


def test_selective_write_through_counts_a_recomputed_last_page_as_a_hit() -> None:
    """An engine admits below the last prompt token, so a page-aligned prompt's last page
    is recomputed each time, never matched: its reuse counts as a hit all the same, and
    after ``selective_hits`` of them it is backed up with the rest."""
    c = make(write_policy="write_through_selective", selective_hits=2)
    tokens = list(range(8))
    for _ in range(3):
        req = c.admit(tokens, at_most=len(tokens) - 1)
        assert req.cached_len in (0, 6)
        pages = c.allocate(req, 4 - req.cached_len // G.page_size)
        assert pages is not None
        c.l1.buffer[:, :, pages] = 1.0
        c.insert(req, pages)
        c.release(req)
        drain(c)
    assert c.core.match(tokens).lengths == (8, 8, 8)
    c.check_integrity()
    c.close()


def test_allocating_pages_that_could_never_fit_is_refused_and_changes_nothing() -> None:
    """More L1 pages than the pool holds beside those the request holds (its pinned prefix,
    its private pages) is a MisuseError, nothing changed: None would mean "not now", and a
    caller would wait forever. Exactly the pages left is not refused."""
    c = make(l1_pages=8)
    tokens = list(range(6))
    cached(c, tokens)  # 3 pages in the tree, pinned by a request's admit
    req = c.admit(tokens)
    assert len(c.prefix_pages(req)) == 3
    before = c.status().to_dict()
    with pytest.raises(
        MisuseError, match=r"^allocate: 6 pages for request #\d+, which holds 3, can never fit in L1's 8$"
    ):
        c.allocate(req, 6)
    assert c.status().to_dict() == before and req.private == []
    pages = c.allocate(req, 5)
    assert pages is not None and len(pages) == 5
    with pytest.raises(MisuseError, match="which holds 8, can never fit"):
        c.allocate(req, 1)
    c.release(req)
    c.check_integrity()
    c.close()


def test_a_prompt_backed_up_in_two_jobs_keeps_its_head_in_a_smaller_dir_store(tmp_path: Path) -> None:
    """A prompt's head is written through, then its extension (a longer prompt on it) in a
    second job: the controller gives the head's keys with the extension, so a dir store
    reopened with room for half keeps the head (reachable), not the newer tail. Pages come
    back bit-exact."""
    path = str(tmp_path / "kv")
    c = make(l1_pages=16, l2_pages=16, l3_pages=16, storage_backend="dir", storage_path=path, model_id="m")
    head, whole = list(range(8)), list(range(16))
    first, kv_head = prefill(c, head)
    c.release(first)
    drain(c)
    req, _ = prefill(c, whole)
    c.release(req)
    drain(c)
    assert c.core.match(whole).lengths == (16, 16, 16)
    c.close()
    again = make(l1_pages=16, l2_pages=16, l3_pages=4, storage_backend="dir", storage_path=path, model_id="m")
    req = again.admit(whole)
    assert req.match.lengths == (0, 0, 8)  # the head's 4 pages: reachable from the first
    assert again.restore(req, again.plan(req))
    assert torch.equal(again.l1.buffer[:, :, again.prefix_pages(req)], kv_head)
    again.release(req)
    again.close()


@pytest.mark.parametrize("leave", ["release", "insert"])
def test_a_selective_backup_put_off_at_admission_is_made_when_the_request_leaves(leave: str) -> None:
    """write_through_selective: the backup of an L1 prefix reaching its hits is put off at an
    admission that could restore more from L3 (a D2H begun then would refuse that restore:
    an L2 copy needs its parent's), and made when the request inserts or releases."""
    c = make(write_policy="write_through_selective", selective_hits=2, l1_pages=16, l2_pages=16, l3_pages=32)
    long, short = list(range(16)), list(range(8))
    cached(c, long)
    assert c.flush() >= 1  # the whole prompt on disk
    evict_all(c, Tier.L1, Tier.L2)
    req = c.admit(short)  # recomputed (not restored): the prefix in L1 and L3, not L2
    pages = c.allocate(req, len(short) // G.page_size)
    assert pages is not None
    c.insert(req, pages)
    c.release(req)
    assert c.core.match(long).lengths == (8, 0, 16)
    c.release(c.admit(long))  # the first hit
    req = c.admit(long)  # the second: an L3 restore of [8, 16) may follow

    def put_off() -> object:
        return req.selective

    assert put_off() is not None
    drain(c)
    assert c.core.match(short).lengths[1] == 0  # not begun at admission
    if leave == "insert":
        more = c.allocate(req, (len(long) - req.cached_len) // G.page_size)
        assert more is not None
        c.insert(req, more)
        drain(c)
        assert put_off() is None and c.core.match(short).lengths[1] == 8  # made at insert
    c.release(req)
    drain(c)
    assert put_off() is None
    assert c.core.match(short).lengths[1] == 8
    c.check_integrity()
    c.close()


@pytest.mark.parametrize("other", ["short", "long released"])
def test_an_l3_restore_waits_for_a_backup_above_it_instead_of_being_refused(other: str) -> None:
    """Another request's admission hits the L1 prefix too (write_through_selective: the
    third hit) and starts its backup to L2 at once, or leaves and makes its own put-off one.
    The first request's L3 restore of the pages below must read them into L2 under that
    prefix's L2 copy: it waits for the backup to land and restores, where it was refused and
    the request recomputed half its prompt."""
    c = make(write_policy="write_through_selective", selective_hits=2, l1_pages=16, l2_pages=16, l3_pages=32)
    long, short = list(range(16)), list(range(8))
    kv = cached(c, long)
    assert c.flush() >= 1
    evict_all(c, Tier.L1, Tier.L2)
    req = c.admit(short)
    pages = c.allocate(req, len(short) // G.page_size)
    assert pages is not None
    c.l1.buffer[:, :, pages] = kv[:, :, : len(pages)]
    c.insert(req, pages)
    c.release(req)
    c.release(c.admit(long))  # the first hit
    req = c.admit(long)  # the second: its own backup put off
    if other == "short":
        second = c.admit(short)  # nothing below it in L3: backed up at once
    else:
        c.release(c.admit(long))  # leaves first: its put-off backup starts as it goes
    assert c.status().pending_backups == 1
    before = c.metrics.fallbacks
    restore = c.start_restore(req, c.plan(req))
    assert restore is not None and c.metrics.fallbacks == before
    drain(c)
    assert req.cached_len == len(long)
    assert torch.equal(c.l1.buffer[:, :, c.prefix_pages(req)], kv)
    if other == "short":
        c.release(second)
    c.release(req)
    drain(c)
    c.check_integrity()
    c.close()
