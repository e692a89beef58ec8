"""A shared store keys pages by the model's identity, and the engine names the weights it
actually runs there (``weights_digest``): an engine over other weights of the same shapes (a
``net`` given in place of the named model, another checkpoint of the same name and sizes)
never reads the first one's pages; the same weights do, after a restart."""

from __future__ import annotations

import copy
import os
import random
from pathlib import Path

import pytest
import torch

from hicache.engine import Engine, build_model
from hicache.engine.model import model_identity, weights_digest
from hicache.errors import ConfigError

pytest.importorskip("transformers")

PROMPT = random.Random(5).choices(range(512), k=70)


def _engine(path: Path, net: torch.nn.Module | None = None, model: str = "tiny") -> Engine:
    return Engine(model, net=net, device="cpu", page_size=16, num_pages=32, enable_hicache=True, l2_pages=32,
                  l3_pages=64, policy="always", transfer_backend="torch", storage_backend="dir",
                  storage_path=str(path))  # fmt: skip


def _second_run(path: Path, net: torch.nn.Module | None, model: str = "tiny") -> tuple[int, list[int]]:
    """(cached tokens, tokens) of the prompt in a fresh engine over ``path``."""
    e = _engine(path, net, model)
    try:
        out = e.generate(PROMPT, max_new_tokens=4)
        return out.cached_tokens, out.tokens
    finally:
        e.close()


def _fill(path: Path, net: torch.nn.Module | None = None, model: str = "tiny") -> list[int]:
    e = _engine(path, net, model)
    try:
        tokens = e.generate(PROMPT, max_new_tokens=4).tokens
        e.cache.drain()
        return tokens
    finally:
        e.close()


def _cold(net: torch.nn.Module) -> list[int]:
    e = Engine("tiny", net=net, device="cpu", page_size=16, num_pages=32)
    try:
        return e.generate(PROMPT, max_new_tokens=4).tokens
    finally:
        e.close()


def test_the_same_weights_read_the_store_after_a_restart(tmp_path: Path) -> None:
    first = _fill(tmp_path / "kv")
    cached, tokens = _second_run(tmp_path / "kv", None)
    assert cached == 64 and tokens == first


@pytest.mark.parametrize("other", ["seed", "one weight"])
def test_a_net_of_other_weights_never_reads_the_store(tmp_path: Path, other: str) -> None:
    """The store filled by the preset's weights; a ``net`` of the same shapes with other
    weights (another seed, one weight changed by one step) finds nothing and serves its own
    tokens."""
    _fill(tmp_path / "kv")
    if other == "seed":
        net = build_model("tiny", device="cpu", seed=1)
    else:
        net = build_model("tiny", device="cpu", seed=0)
        with torch.no_grad():
            w = next(net.parameters()).view(-1)
            w[7] = torch.nextafter(w[7], torch.tensor(float("inf"), dtype=w.dtype))
    cached, tokens = _second_run(tmp_path / "kv", net)
    assert cached == 0 and tokens == _cold(net)


def test_two_checkpoints_of_one_name_and_size_do_not_share(tmp_path: Path) -> None:
    """Two checkpoint directories both called ``model``, of the same config and file sizes
    but other weights: their names agree, their engines' identities do not."""
    dirs = []
    for seed in (0, 1):
        d = tmp_path / f"c{seed}" / "model"
        build_model("tiny", device="cpu", seed=seed).save_pretrained(d)  # type: ignore[operator]
        dirs.append(d)
    assert model_identity(str(dirs[0])) == model_identity(str(dirs[1]))  # the name part alone
    first = _fill(tmp_path / "kv", model=str(dirs[0]))
    assert _second_run(tmp_path / "kv", None, model=str(dirs[0])) == (64, first)
    cached, tokens = _second_run(tmp_path / "kv", None, model=str(dirs[1]))
    assert cached == 0 and tokens == _cold(build_model(str(dirs[1]), device="cpu"))


def test_the_digest_follows_the_values_only() -> None:
    a = build_model("tiny", device="cpu", seed=0)
    assert weights_digest(a) == weights_digest(copy.deepcopy(a)) == weights_digest(build_model("tiny", device="cpu"))
    b = copy.deepcopy(a)
    with torch.no_grad():
        p = list(b.parameters())[-1].view(-1)
        p[-1] = -p[-1] if p[-1] != 0 else 1.0
    assert weights_digest(b) != weights_digest(a)
    assert weights_digest(build_model("tiny", device="cpu", seed=1)) != weights_digest(a)


def test_a_net_that_is_not_a_model_is_a_config_error() -> None:
    from hicache.errors import ConfigError

    for net in (5, torch.nn.Linear(2, 2)):
        with pytest.raises(ConfigError, match="net must be a transformers causal LM"):
            Engine("tiny", net=net, device="cpu")  # type: ignore[arg-type]


def test_the_digest_samples_stay_inside_a_tensor_past_two_to_the_24() -> None:
    """2**24 + 4 elements: float positions would round past the last one (an index error;
    on a GPU a device-side assert); the last element is sampled."""
    big = torch.zeros(2**24 + 4, dtype=torch.int8)
    net = torch.nn.Module()
    net.register_buffer("big", big)
    before = weights_digest(net)
    big[-1] = 1
    assert weights_digest(net) != before


def test_a_checkpoint_with_a_file_name_not_in_utf8_has_an_identity_and_shares(tmp_path: Path) -> None:
    """A checkpoint beside a weight file whose name is not UTF-8: its identity is computed
    (it raised UnicodeEncodeError) and its pages are read back after a restart."""
    import os

    d = tmp_path / "model"
    build_model("tiny", device="cpu", seed=0).save_pretrained(d)  # type: ignore[operator]
    plain = model_identity(str(d))
    (d / os.fsdecode(b"extra-\xfe.bin")).write_bytes(b"x")
    assert model_identity(str(d)) != plain  # the file counts
    first = _fill(tmp_path / "kv", model=str(d))
    assert _second_run(tmp_path / "kv", None, model=str(d)) == (64, first)


@pytest.mark.parametrize("damage", ["truncated", "garbage", "garbage-bin"])
def test_a_checkpoint_whose_weights_file_is_damaged_is_a_config_error(tmp_path: Path, damage: str) -> None:
    """A weights file cut short or overwritten is a checkpoint transformers cannot load: a
    ConfigError naming it (the CLI's one-line error), not the loader's own exception."""
    d = tmp_path / "ck"
    build_model("tiny", device="cpu", seed=0).save_pretrained(d)  # type: ignore[operator]
    weights = d / "model.safetensors"
    if damage == "truncated":
        os.truncate(weights, weights.stat().st_size // 2)
    else:
        garbage = bytes(range(256)) * 64
        if damage == "garbage-bin":  # the pickle format transformers falls back to
            weights.unlink()
            weights = d / "pytorch_model.bin"
        weights.write_bytes(garbage)
    with pytest.raises(ConfigError, match=r"not a checkpoint transformers can load"):
        build_model(str(d), device="cpu")


@pytest.mark.parametrize(
    "exc",
    [
        RuntimeError("[enforce fail at alloc_cpu.cpp:127] DefaultCPUAllocator: can't allocate memory: 4 GB"),
        MemoryError(),
    ],
)
def test_a_checkpoint_that_runs_the_host_out_of_memory_is_not_called_unreadable(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, exc: BaseException
) -> None:
    """torch's host allocator fails with a plain RuntimeError, one of the loaders' words for
    a damaged file: out of memory, it goes on as itself (the CLI's out-of-memory line, exit
    1), not as a ConfigError about ``--model`` (exit 2)."""
    from transformers import AutoModelForCausalLM

    d = tmp_path / "ck"
    build_model("tiny", device="cpu", seed=0).save_pretrained(d)  # type: ignore[operator]

    def load(*args: object, **kwargs: object) -> object:
        raise exc

    monkeypatch.setattr(AutoModelForCausalLM, "from_pretrained", load)
    with pytest.raises(type(exc)) as raised:
        build_model(str(d), device="cpu")
    assert raised.value is exc
