"""L1 -> L2 -> L3 -> L2 -> L1 round trips are bit-exact (CPU; CUDA in tests/gpu)."""

from __future__ import annotations

import itertools
import os
from typing import cast

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from hicache.backends import kernels
from hicache.backends.pools import DevicePool, HostPool
from hicache.backends.transfer import TransferBackend, TransferEngine, layer_groups
from hicache.core.geometry import KVGeometry
from hicache.errors import ConfigError, PageOwnershipError
from tests.backends.helpers import l1_page, stack

CASES = [
    # (L1 source pages, L2 pages, L3 slots, L2 pages read back, L1 pages restored)
    ([0, 1, 2, 3], [2, 3, 4, 5], [4, 5, 6, 7], [0, 1, 2, 3], [8, 9, 10, 11]),  # consecutive
    ([7, 2, 9, 4], [6, 1, 8, 3], [9, 0, 5, 2], [5, 9, 0, 7], [3, 11, 0, 6]),  # fragmented
]


@pytest.mark.parametrize("page_size", [1, 2, 16])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("case", range(len(CASES)), ids=["consecutive", "fragmented"])
def test_round_trip_is_bit_exact(page_size: int, dtype: torch.dtype, case: int) -> None:
    src, l2_pages, slots, back, dst = CASES[case]
    dev, host, engine, storage = stack(page_size, dtype)
    want = [l1_page(dev, p).clone() for p in src]
    assert engine.d2h(src, l2_pages).wait()
    assert storage.write(l2_pages, slots).wait()
    host.page_buffer.normal_()  # L2 overwritten: the data must come back from the file
    assert storage.read(slots, back).wait()
    assert engine.h2d(back, dst).wait()
    for w, p in zip(want, dst, strict=True):
        assert torch.equal(l1_page(dev, p), w)
    storage.close()


@pytest.mark.skipif(not kernels.HAVE_TRITON, reason="triton not installed")
@pytest.mark.parametrize("backend", ["triton", "auto"])
@pytest.mark.parametrize("direct_max_bytes", [0, 1 << 30], ids=["ring", "direct"])
def test_triton_backends_round_trip(backend: str, direct_max_bytes: int) -> None:
    """The transfer engine on Triton kernels (interpreted on CPU) moves the same bytes,
    through the ring (gather/scatter + copies) and direct (one kernel on L2 in place)."""

    if os.environ.get("TRITON_INTERPRET") != "1":
        pytest.skip("CPU pools need TRITON_INTERPRET=1 (tests/gpu covers Triton on CUDA)")
    dev, host, _, storage = stack(2, torch.bfloat16)
    engine = TransferEngine(
        dev, host, cast(TransferBackend, backend), direct_max_bytes=direct_max_bytes, min_run_bytes=0
    )
    want = [l1_page(dev, p).clone() for p in (5, 1)]
    assert engine.d2h([5, 1], [7, 3]).wait() and engine.h2d([7, 3], [0, 11]).wait()
    assert torch.equal(l1_page(dev, 0), want[0]) and torch.equal(l1_page(dev, 11), want[1])
    path = "direct" if direct_max_bytes and backend == "triton" else "ring"  # CPU: auto never goes direct
    assert engine.status()["paths"][path] == 2
    assert engine.status()["gather"] in ("triton", "torch")
    if backend == "auto" and not direct_max_bytes:
        assert set(engine.status()["autotune_ms"]) == {
            "gather_torch",
            "gather_triton",
            "scatter_torch",
            "scatter_triton",
        }
    storage.close()


def test_host_buffer_is_the_l1_ordered_view() -> None:
    g = KVGeometry(2, 2, 4, 2, torch.float32)
    host = HostPool(g, 3)
    host.page_buffer.copy_(torch.randn(host.page_buffer.shape))
    assert host.buffer.shape == (2, 2, 3, 2, 2, 4)
    assert torch.equal(host.buffer[1, 0, 2], host.page_buffer[2, 1, 0])
    assert host.bytes.data_ptr() % 4096 == 0


def test_transfers_allocate_no_pinned_workspace() -> None:
    """Neither consecutive nor fragmented L2 pages stage through pinned memory: the ring
    is device memory and fragmented pages go one copy per run (or direct)."""
    _dev, _host, engine, storage = stack(2, torch.float32)
    assert engine.d2h([0, 1, 2], [3, 4, 5]).wait()
    assert engine.d2h([3, 4], [9, 1]).wait()
    assert engine.h2d([9, 1], [6, 7]).wait()
    assert engine.status()["workspace_pinned_bytes"] == 0
    assert engine.status()["workspace_device_bytes"] == engine.status()["ring_cap_bytes"] > 0
    storage.close()


def test_bad_page_lists_raise_before_anything_moves() -> None:
    _dev, host, engine, storage = stack(2, torch.float32)
    before = host.page_buffer.clone()
    for src, dst in (([0, 1], [2]), ([0, 99], [1, 2]), ([0, 1], [3, 3]), ([-1], [0])):
        with pytest.raises(PageOwnershipError):
            engine.d2h(src, dst)
    assert torch.equal(host.page_buffer, before)
    storage.close()


@pytest.mark.parametrize(
    ("make", "message"),
    [
        (lambda g: [torch.zeros(8, 2, 2)], "MLA-style"),  # separate latent buffers
        (lambda g: torch.zeros(8, 2, 2, dtype=torch.float32), "MLA-style"),
        (lambda g: torch.zeros(2, 2, 8, 2, 2, 4, dtype=torch.int8), "quantized"),
        (lambda g: torch.zeros(2, 3, 8, 2, 2, 4), "does not match"),
        (lambda g: torch.zeros(2, 2, 2, 2, 8, 4).permute(0, 1, 4, 2, 3, 5), "contiguous"),
        (lambda g: "not a tensor", "torch.Tensor"),
    ],
)
def test_l1_pool_refuses_unsupported_layouts(make: object, message: str) -> None:
    g = KVGeometry(2, 2, 4, 2, torch.float32)
    with pytest.raises(ConfigError, match=message):
        DevicePool(g, make(g))  # type: ignore[operator]


def test_explicit_triton_without_device_raises(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    if torch.cuda.is_available():
        pytest.skip("CUDA present")
    g = KVGeometry(1, 1, 4, 1, torch.float32)
    with pytest.raises(ConfigError, match="triton"):
        TransferEngine(DevicePool.allocate(g, 2, "cpu"), HostPool(g, 2), "triton")


@pytest.mark.parametrize("backend", ["torch", "triton"])
@pytest.mark.parametrize("min_run_bytes", [0, 1 << 40], ids=["copy-per-run", "direct-if-triton"])
def test_both_fragmented_paths_are_bit_exact(backend: str, min_run_bytes: int) -> None:
    """Fragmented L2 pages go one copy per run from the ring, or (runs too short for a
    DMA each, Triton available) direct."""
    if backend == "triton" and os.environ.get("TRITON_INTERPRET") != "1":
        pytest.skip("CPU pools need TRITON_INTERPRET=1")
    dev, host, _, storage = stack(16, torch.bfloat16)
    engine = TransferEngine(dev, host, backend, min_run_bytes=min_run_bytes, direct_max_bytes=0)  # type: ignore[arg-type]
    src, l2_pages, dst = [4, 5, 9, 0, 1], [2, 3, 7, 8, 0], [10, 11, 2, 3, 6]
    want = [l1_page(dev, p).clone() for p in src]
    assert engine.d2h(src, l2_pages).wait()
    for w, h in zip(want, l2_pages, strict=True):
        assert torch.equal(host.buffer[:, :, h], w)
    assert engine.h2d(l2_pages, dst).wait()
    for w, p in zip(want, dst, strict=True):
        assert torch.equal(l1_page(dev, p), w)
    direct = backend == "triton" and min_run_bytes > 0
    assert engine.status()["paths"] == {"copy": 0, "direct": 2 * direct, "ring": 2 * (not direct), "layered": 0}
    storage.close()


def test_triton_failure_falls_back_under_auto_and_raises_when_explicit(monkeypatch: pytest.MonkeyPatch) -> None:
    """auto: a failing Triton kernel is replaced by torch with a warning, bytes still right;
    an explicit 'triton' backend raises instead of silently degrading."""
    from hicache.backends import transfer

    def broken(*args: object) -> None:
        raise RuntimeError("triton compile failed")

    monkeypatch.setitem(transfer.GATHER, "triton", broken)
    dev, host, _, storage = stack(2, torch.float32)
    auto = TransferEngine(dev, host, "torch")
    auto.requested, auto.gather_backend, auto.scatter_backend = "auto", "triton", "torch"
    want = l1_page(dev, 3).clone()
    with pytest.warns(RuntimeWarning, match="falling back to torch"):
        assert auto.d2h([3], [0]).wait()
    assert auto.gather_backend == "torch" and torch.equal(host.buffer[:, :, 0], want)
    strict = TransferEngine(dev, host, "torch")
    strict.requested, strict.gather_backend, strict.scatter_backend = "triton", "triton", "torch"
    with pytest.raises(RuntimeError, match="compile failed"):
        strict.d2h([3], [1])
    strict.gather_backend = "torch"
    assert strict.d2h([3], [1]).wait(), "a failed issue left the engine unusable"
    assert torch.equal(host.buffer[:, :, 1], want)
    storage.close()


def test_a_directions_first_enqueue_is_one_time_setup() -> None:
    """The first transfer of each direction (autotune, kernel compile) is setup, excluded
    from the recurring time the cost model learns; later ones are not."""
    eng = stack(2, torch.float32)[2]
    first = eng.h2d([0, 1], [3, 4])
    first.wait()
    assert first.timings.setup_s == first.timings.enqueue_s > 0
    assert first.timings.recurring_s == pytest.approx(
        first.timings.queue_s + first.timings.service_s + first.timings.complete_s
    )
    second = eng.h2d([2, 3], [5, 6])
    second.wait()
    assert second.timings.setup_s < second.timings.enqueue_s
    d2h = eng.d2h([0], [7])  # its own first
    d2h.wait()
    assert d2h.timings.setup_s == d2h.timings.enqueue_s


@given(
    layers=st.integers(1, 128),
    most=st.integers(1, 16),
    first=st.integers(1, 16),
    last=st.integers(1, 16),
)
def test_layer_groups_cover_every_layer_once_within_their_sizes(layers: int, most: int, first: int, last: int) -> None:
    first, last = min(first, most), min(last, most)
    groups = layer_groups(layers, first, most, last)
    sizes = [hi - lo for lo, hi in groups]
    assert groups[0][0] == 0 and groups[-1][1] == layers
    assert all(a[1] == b[0] for a, b in itertools.pairwise(groups))
    assert all(1 <= size <= most for size in sizes)
    assert sizes[0] == min(first, layers)
    if layers >= first + last and last < most:
        assert sizes[-1] == last
    # the middle is cut evenly: no group between the ramps is under half the largest
    ramp_up = len(list(itertools.takewhile(lambda s: s < most, sizes)))
    ramp_down = len(list(itertools.takewhile(lambda s: s < most, reversed(sizes))))
    middle = sizes[ramp_up : len(sizes) - ramp_down]
    assert not middle or max(middle) - min(middle) <= 1 or len(set(sizes)) <= 2


def test_layer_groups_are_small_at_both_ends(monkeypatch: pytest.MonkeyPatch) -> None:
    g = KVGeometry(36, 2, 8, 4, torch.float32)
    l1, l2 = DevicePool.allocate(g, 8, "cpu"), HostPool(g, 8)
    groups = TransferEngine(l1, l2, "torch", layer_group=1, max_layer_group=8).layer_groups()
    assert [hi - lo for lo, hi in groups] == [1, 2, 4, 8, 7, 7, 4, 2, 1]
    assert groups[0][0] == 0 and groups[-1][1] == 36 and all(a[1] == b[0] for a, b in itertools.pairwise(groups))
    fours = TransferEngine(l1, l2, "torch", layer_group=4, max_layer_group=4, last_layer_group=4)
    assert fours.layer_groups()[-2:] == [(28, 32), (32, 36)]
    # the default: from 2 layers up to 4 and down to 1, read when the engine is built (the bench's flags)
    assert [hi - lo for lo, hi in TransferEngine(l1, l2, "torch").layer_groups()] == [2] + [4] * 7 + [3, 2, 1]
    monkeypatch.setattr("hicache.backends.transfer.MAX_LAYER_GROUP", 6)
    assert max(hi - lo for lo, hi in TransferEngine(l1, l2, "torch").layer_groups()) == 6
    with pytest.raises(ConfigError, match="layer_group"):
        TransferEngine(l1, l2, "torch", layer_group=4, max_layer_group=2)
    with pytest.raises(ConfigError, match="last_layer_group"):
        TransferEngine(l1, l2, "torch", last_layer_group=5, max_layer_group=4)
    with pytest.raises(ConfigError, match="must be ints"):
        TransferEngine(l1, l2, "torch", last_layer_group=True)
    # a largest group given alone, under the default ends: the ends shrink to it
    assert {hi - lo for lo, hi in TransferEngine(l1, l2, "torch", max_layer_group=1).layer_groups()} == {1}
    twos = TransferEngine(l1, l2, "torch", layer_group=2, max_layer_group=2, last_layer_group=2)
    assert [hi - lo for lo, hi in twos.layer_groups()] == [2] * 18
    # On CPU the H2D cannot order by layer: events are accepted (the count is checked), and
    # the pages land as usual.
    l2.slabs.normal_()
    assert TransferEngine(l1, l2, "torch").h2d([1, 2], [3, 4], layer_events=()).wait()
    assert torch.equal(l1.slabs[:, [3, 4]].transpose(0, 1), l2.slabs[[1, 2]])
    with pytest.raises(ConfigError, match="events for 36 layers"):
        TransferEngine(l1, l2, "torch").h2d([1], [3], layer_events=[object()])


@pytest.mark.parametrize("backend", ["triton", "torch"])
def test_a_layered_engine_warms_its_scatter_before_any_h2d(monkeypatch: pytest.MonkeyPatch, backend: str) -> None:
    """With the layered H2D available and the Triton scatter chosen, the first transfer of
    any direction compiles the layered scatter for every group (inside its setup), once; a
    torch scatter needs nothing."""
    if backend == "triton" and os.environ.get("TRITON_INTERPRET") != "1":
        pytest.skip("CPU pools need TRITON_INTERPRET=1")
    warmed: list[list[tuple[int, int]]] = []
    monkeypatch.setattr(TransferEngine, "layered", property(lambda self: True))

    def warm(dst: torch.Tensor, groups: list[tuple[int, int]], **kw: object) -> int:
        warmed.append(list(groups))
        return 0

    monkeypatch.setattr(kernels, "warm_load_layers", warm)
    eng = stack(2, torch.float32, backend=backend)[2]  # type: ignore[arg-type]
    eng.d2h([0], [1]).wait()
    eng.d2h([2], [3]).wait()
    assert warmed == ([eng.layer_groups()] if backend == "triton" else [])


BAD_GROUPS: list[tuple[object, ...]] = [
    (5, 2, 4, 0),
    (5, 0, 4, 1),
    (5, 2, 4, -1),
    (5, 2, 0, 1),
    (5, 2.0, 4, 1),
    (5, True, 4, 1),
]
BAD_GROUPS += [(0, 1, 1, 1), (5, 3, 2, 1), (5, 1, 2, 3), (5, 1, 4, "1")]


@pytest.mark.parametrize("args", BAD_GROUPS)
def test_layer_groups_refuses_what_is_no_group_size(args: tuple[object, ...]) -> None:
    """The function itself (a probe calls it directly): a ConfigError, not a hang (a size 0
    never shrank what was left) or a MemoryError."""
    with pytest.raises(ConfigError, match="layer groups need ints"):
        layer_groups(*args)  # type: ignore[arg-type]
