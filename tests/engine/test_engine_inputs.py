"""The engine's settings and calls refuse bad values with typed errors, a closed engine
refuses work, and generate() loses no other request's output."""

from __future__ import annotations

import warnings
from typing import Any

import pytest

from hicache.engine import Engine
from hicache.errors import ConfigError, MisuseError
from tests.engine.test_engine import engine

pytest.importorskip("transformers")


@pytest.mark.parametrize("seed", ["x", 1.5, True, -1, 2**63, None])
def test_a_bad_seed_is_a_config_error(seed: Any) -> None:
    """The seed must be an int in [0, 2**63): anything else is a ConfigError naming it."""
    with pytest.raises(ConfigError, match=r"^seed must be an int in \[0, 2\*\*63\), got "):
        Engine("tiny", device="cpu", page_size=4, num_pages=16, seed=seed)


@pytest.mark.parametrize(
    ("name", "value"),
    [
        ("prefetch", "no"),
        ("cuda_graphs", None),
        ("layered_restore", "yes"),
        ("graph_short_prefills", 3),
        ("enable_hicache", "yes"),
    ],
)
def test_a_switch_that_is_not_a_bool_is_a_config_error(name: str, value: Any) -> None:
    """On/off settings take bools (None where it means "decide for me"): "no" is not off."""
    with pytest.raises(ConfigError, match=rf"^{name} must be a bool"):
        Engine("tiny", device="cpu", page_size=4, num_pages=16, **{name: value})


def test_a_closed_engine_refuses_every_call() -> None:
    """After close(), submit, abort, state_of's neighbours step/run/generate raise MisuseError
    and nothing is queued."""
    e = engine()
    e.close()
    for call in (lambda: e.submit([1, 2, 3], 1), lambda: e.abort(1), e.step, e.run, lambda: e.generate([1, 2], 1)):
        with pytest.raises(MisuseError, match="this Engine is closed"):
            call()
    assert e.pending == 0
    e.close()  # twice is fine


def test_an_engine_is_a_context_manager_that_closes() -> None:
    """``with Engine(...) as e``: the requests still in flight are aborted and the cache
    closed at the end of the block; a closed engine cannot be entered again."""
    with engine() as e:
        e.submit([1, 2, 3, 4, 5], 4)
        e.step()
    assert e.cache.closed and e.pending == 0
    with pytest.raises(MisuseError, match="this Engine is closed"), e:
        pass


@pytest.mark.parametrize("rid", [True, 1.0, [1], "1", None])
def test_a_request_id_must_be_an_int(rid: Any) -> None:
    """abort and state_of take the int submit() returned; a bool, float or list is refused
    (True would otherwise abort request 1) and nothing is aborted."""
    e = engine()
    first = e.submit([1, 2, 3], 1)
    assert first == 1
    with pytest.raises(MisuseError, match=r"^abort: a request id is the int submit\(\) returned"):
        e.abort(rid)
    with pytest.raises(MisuseError, match=r"^state_of: a request id is the int submit\(\) returned"):
        e.state_of(rid)
    assert e.pending == 1 and e.stats.aborted == 0
    e.run()
    e.close()


def test_a_numpy_request_id_is_the_int_it_holds() -> None:
    """An id read back from an array (a numpy integer) names its request, as submit() takes
    a numpy max_new_tokens; a numpy bool is no id."""
    import numpy as np

    e = engine()
    try:
        rid = e.submit([1, 2, 3], 1)
        as_int64: Any = np.int64(rid)
        as_int32: Any = np.int32(rid)
        true: Any = np.bool_(True)
        assert e.state_of(as_int64) is not None
        with pytest.raises(MisuseError, match=r"^abort: a request id is the int submit\(\) returned"):
            e.abort(true)
        assert e.abort(as_int32) and e.pending == 0
        assert [o.error for o in e.run()] == ["aborted"]
    finally:
        e.close()


def test_generate_keeps_the_other_requests_outputs_for_the_next_run() -> None:
    """generate() serves its request; another request finished alongside is not lost: the
    next run() (or step()) returns it."""
    e = engine()
    a = e.submit([1, 2, 3, 4, 5], 2)
    mine = e.generate([9, 8, 7], 1)
    rest = e.run()
    assert mine.id != a
    assert [o.id for o in rest] == [a]
    assert e.run() == []
    e.close()


def test_tier_sizes_without_enable_hicache_warn_that_they_do_nothing() -> None:
    """``l2_pages``/``l3_pages`` without ``enable_hicache``: the engine runs with L1 only and
    says so; with it, or with no tier sizes, nothing is said."""
    with pytest.warns(UserWarning, match="no effect without enable_hicache"):
        e = Engine("tiny", device="cpu", num_pages=16, l2_pages=8)
    assert e.config.cache.l2_pages == 0 and e.config.cache.l3_pages == 0 and not e.enabled
    e.close()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        for kw in ({}, {"enable_hicache": True, "l2_pages": 8}, {"enable_hicache": True, "l2_pages": 8,
                                                                 "layered_restore": True}):  # fmt: skip
            Engine("tiny", device="cpu", num_pages=16, **kw).close()  # type: ignore[arg-type]
    with pytest.warns(UserWarning, match="layered_restore=True has no effect without hicache") as seen:
        e = Engine("tiny", device="cpu", num_pages=16, layered_restore=True)
    assert seen[0].filename == __file__ and not e.layered  # the caller's line, not the engine's
    e.close()


@pytest.mark.parametrize("cudnn", ["on", "graphs"])
def test_cudnn_attention_on_cpu_is_warned_about(cudnn: str) -> None:
    """cuDNN attention runs on CUDA only: asked for on CPU it is said to change nothing (it
    was taken silently), at the caller's line; the engine serves as without it."""
    with pytest.warns(UserWarning, match=f"cudnn='{cudnn}' has no effect on cpu") as seen:
        e = Engine("tiny", device="cpu", num_pages=16, cudnn=cudnn)
    assert seen[0].filename == __file__
    try:
        assert len(e.generate([1, 2, 3], max_new_tokens=2).tokens) == 2
    finally:
        e.close()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        Engine("tiny", device="cpu", num_pages=16, cudnn="off").close()
