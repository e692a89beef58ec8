"""The fused kernels (RMSNorm, the attention prologue, the MLP activation) against
transformers' own code, and their installation in a model.

On CPU the kernel runs under TRITON_INTERPRET=1 (tests/conftest.py) in float32 and float16;
bfloat16 is checked on CUDA only (the interpreter rounds bfloat16 differently from the GPU).
"""

from __future__ import annotations

import os
import random
import subprocess
import sys
from typing import Any

import pytest
import torch
import torch.nn.functional as F

from hicache.backends.pools import DevicePool
from hicache.engine import ModelRunner, build_model, fused, kv_geometry
from hicache.errors import ConfigError

CUDA = torch.cuda.is_available()
DEVICE = "cuda" if CUDA else "cpu"
RUNS = fused.HAVE_TRITON and (CUDA or os.environ.get("TRITON_INTERPRET") == "1")
needs_kernel = pytest.mark.skipif(not RUNS, reason="needs triton on CUDA or TRITON_INTERPRET=1")
DTYPES = [torch.float32, torch.float16] + ([torch.bfloat16] if CUDA else [])


def reference(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """transformers' Qwen3RMSNorm.forward, spelled out (not the module's own helper)."""
    h = x.to(torch.float32)
    variance = h.pow(2).mean(-1, keepdim=True)
    h = h * torch.rsqrt(variance + eps)
    return weight * h.to(x.dtype)


@needs_kernel
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("shape", [(3, 4096), (2, 5, 4, 128), (1, 100), (7, 1)], ids=str)
def test_kernel_matches_the_formula(dtype: torch.dtype, shape: tuple[int, ...]) -> None:
    """Every element within one rounding of transformers' result, for rows of any width
    (powers of two and not) and leading shapes (the per-head query/key norms are 4-D)."""
    g = torch.Generator().manual_seed(len(shape) * 31 + shape[-1])
    x = (3 * torch.randn(shape, generator=g)).to(DEVICE, dtype)
    w = torch.randn(shape[-1], generator=g).to(DEVICE, dtype)
    got = fused.rms_norm_triton(x, w, 1e-6)
    want = reference(x, w, 1e-6)
    assert got.shape == x.shape and got.dtype == dtype
    ulp = {torch.float32: 1e-6, torch.float16: 1e-3, torch.bfloat16: 8e-3}[dtype]
    torch.testing.assert_close(got.float(), want.float(), rtol=ulp, atol=ulp)


@needs_kernel
def test_kernel_normalises_each_row_on_its_own() -> None:
    """Rows of very different scales each come out at unit RMS (times the weight): a
    kernel that mixed rows, or read past a row's end, would not."""
    x = torch.stack([torch.full((64,), 1e-3), torch.full((64,), 50.0), torch.arange(64.0)]).to(DEVICE)
    w = torch.ones(64, device=DEVICE)
    out = fused.rms_norm_triton(x, w, 0.0)
    rms = out.pow(2).mean(-1).sqrt()
    torch.testing.assert_close(rms, torch.ones(3, device=DEVICE), rtol=1e-5, atol=1e-5)
    assert torch.all(out[2, 1:] > out[2, :-1])  # order within a row kept


@needs_kernel
def test_kernel_reads_strided_rows() -> None:
    """A view whose rows are not contiguous (a transposed tensor) gives the same result as
    its contiguous copy; the input is not modified."""
    base = torch.randn(128, 6, device=DEVICE)
    view = base.t()  # rows of 128, stride 1 apart: not contiguous
    before = base.clone()
    w = torch.randn(128, device=DEVICE)
    torch.testing.assert_close(fused.rms_norm_triton(view, w, 1e-6), reference(view.contiguous(), w, 1e-6))
    assert torch.equal(base, before)


@needs_kernel
def test_kernel_accepts_no_rows() -> None:
    """Zero rows in, zero rows out (no launch)."""
    out = fused.rms_norm_triton(torch.empty(0, 32, device=DEVICE), torch.ones(32, device=DEVICE), 1e-6)
    assert out.shape == (0, 32)


@pytest.mark.skipif(not fused.HAVE_TRITON, reason="needs triton")
@pytest.mark.parametrize(
    ("x", "w", "match"),
    [
        (torch.ones(2, 8), torch.ones(4), r"weight \(4,\)"),
        (torch.ones(2, 8), torch.ones(8, dtype=torch.float16), "float16"),
        (torch.ones(1, fused.MAX_WIDTH + 1), torch.ones(fused.MAX_WIDTH + 1), "exceed"),
    ],
    ids=["width", "dtype", "too-wide"],
)
def test_kernel_refuses_mismatched_weights(x: torch.Tensor, w: torch.Tensor, match: str) -> None:
    """A weight of another length or dtype, or a row too wide for one program, is a
    ConfigError naming it, before any launch."""
    with pytest.raises(ConfigError, match=match):
        fused.rms_norm_triton(x, w, 1e-6)


@pytest.mark.skipif(not fused.HAVE_TRITON, reason="needs triton")
def test_fuse_norms_patches_every_norm_and_keeps_the_output() -> None:
    """Every RMSNorm of a Qwen3 model (four per layer and the final one) is patched, and
    the model's logits are unchanged on CPU (where the patched forward is the formula)."""
    net = build_model("tiny", fused_norms=False)
    layers = int(net.config.num_hidden_layers)  # type: ignore[union-attr, arg-type]
    pool = DevicePool.allocate(kv_geometry(net, 4), 4, "cpu")
    seq = [([5, 17, 3, 99, 42, 7], [0, 1], 0)]
    before = ModelRunner(net, pool, attention="gqa").forward(seq)
    assert fused.fuse_norms(net) == 4 * layers + 1
    patched = [m for m in net.modules() if type(m).__name__ == "Qwen3RMSNorm"]
    assert len(patched) == 4 * layers + 1
    assert all(m.forward.__func__ is fused._fused_forward for m in patched)  # type: ignore[attr-defined]
    assert torch.equal(ModelRunner(net, pool, attention="gqa").forward(seq), before)


def test_build_model_fuses_only_where_asked() -> None:
    """``fused_norms=None`` fuses on CUDA only; False never; True patches on any device."""
    plain = build_model("tiny")
    assert not any("forward" in vars(m) for m in plain.modules())
    if fused.HAVE_TRITON:
        forced = build_model("tiny", fused_norms=True)
        assert sum("forward" in vars(m) for m in forced.modules()) == 4 * int(forced.config.num_hidden_layers) + 1  # type: ignore[union-attr, arg-type]


# --- the attention prologue (norms, rotary, K/V writes) and the MLP activation --------------


@torch.no_grad()
def _transformers_prologue(
    qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, norms: torch.Tensor | None, hq: int, h: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Queries, keys and values per transformers' own code (its RMSNorm module and
    ``apply_rotary_pos_emb``), not the module under test's reference."""
    from transformers.models.qwen3.modeling_qwen3 import Qwen3RMSNorm, apply_rotary_pos_emb

    n, d = cos.shape
    q, k, v = torch.split(qkv.view(1, n, hq + 2 * h, d), [hq, h, h], dim=2)
    if norms is not None:
        qn, kn = Qwen3RMSNorm(d, eps=1e-6).to(qkv), Qwen3RMSNorm(d, eps=1e-6).to(qkv)
        qn.weight.data.copy_(norms[0])
        kn.weight.data.copy_(norms[1])
        q, k = qn(q), kn(k)
    q, k = apply_rotary_pos_emb(q.transpose(1, 2), k.transpose(1, 2), cos[None], sin[None])
    return q.transpose(1, 2)[0], k.transpose(1, 2)[0], v[0]


@needs_kernel
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("norm", [True, False], ids=["qwen3-norms", "llama-no-norms"])
@pytest.mark.parametrize(("hq", "h", "d"), [(4, 2, 16), (8, 8, 32), (32, 8, 128)], ids=str)
def test_qkv_write_matches_transformers(dtype: torch.dtype, norm: bool, hq: int, h: int, d: int) -> None:
    """The queries it returns, and the keys and values it writes into the pools, match
    transformers' norm and rotary embedding within one rounding, the values exactly; slots
    it was not given keep their bytes."""
    g = torch.Generator().manual_seed(hq * 7 + d + norm)
    n = 5
    qkv = (2 * torch.randn(n, (hq + 2 * h) * d, generator=g)).to(DEVICE, dtype)
    angles = torch.rand(n, d // 2, generator=g) * 100
    cos = torch.cat([angles.cos(), angles.cos()], -1).to(DEVICE, dtype)
    sin = torch.cat([angles.sin(), angles.sin()], -1).to(DEVICE, dtype)
    norms = torch.randn(2, d, generator=g).to(DEVICE, dtype) if norm else None
    k_pool = torch.randn(40, h, d, generator=g).to(DEVICE, dtype)
    v_pool = torch.randn(40, h, d, generator=g).to(DEVICE, dtype)
    before_k, before_v = k_pool.clone(), v_pool.clone()
    slots = torch.tensor([3, 39, 0, 17, 4], device=DEVICE)
    out = fused.qkv_write_triton(qkv, cos, sin, norms, 1e-6, hq, h, k_pool, v_pool, slots)
    want_q, want_k, want_v = _transformers_prologue(qkv, cos, sin, norms, hq, h)
    assert out.shape == (n, hq, d) and out.dtype == dtype
    # a rounding or two of the largest value: the kernel rounds where torch does, but its
    # rsqrt may differ from torch's in the last bit, which can flip a rounding downstream
    for got, want in ((out, want_q), (k_pool[slots], want_k)):
        tol = 4 * torch.finfo(dtype).eps * float(want.abs().max())
        torch.testing.assert_close(got.float(), want.float(), rtol=0, atol=tol)
    assert torch.equal(v_pool[slots], want_v)
    untouched = torch.ones(40, dtype=torch.bool, device=DEVICE)
    untouched[slots] = False
    assert torch.equal(k_pool[untouched], before_k[untouched]) and torch.equal(v_pool[untouched], before_v[untouched])


@needs_kernel
def test_qkv_write_casts_into_the_pools_dtype() -> None:
    """A pool of another dtype than the model gets the keys and values cast to its own."""
    n, hq, h, d = 3, 2, 1, 16
    qkv = torch.randn(n, (hq + 2 * h) * d, device=DEVICE)
    cos, sin = torch.ones(n, d, device=DEVICE), torch.zeros(n, d, device=DEVICE)  # rotation by 0
    k_pool = torch.zeros(8, h, d, dtype=torch.float16, device=DEVICE)
    v_pool = torch.zeros(8, h, d, dtype=torch.float16, device=DEVICE)
    slots = torch.tensor([1, 2, 5], device=DEVICE)
    q = fused.qkv_write_triton(qkv, cos, sin, None, 0.0, hq, h, k_pool, v_pool, slots)
    rows = qkv.view(n, hq + 2 * h, d)
    assert torch.equal(q, rows[:, :hq])
    assert torch.equal(k_pool[slots, 0], rows[:, hq].half()) and torch.equal(v_pool[slots, 0], rows[:, hq + 1].half())


@pytest.mark.skipif(not fused.HAVE_TRITON, reason="needs triton")
@pytest.mark.parametrize(
    ("change", "match"),
    [
        ({"qkv": torch.ones(3, 7)}, "qkv"),
        ({"cos": torch.ones(2, 16)}, "cos/sin"),
        ({"slots": torch.tensor([0, 1, 2], dtype=torch.int32)}, "slots"),
        ({"norms": torch.ones(16)}, "norm weights"),
        ({"v_pool": torch.zeros(8, 2, 16)}, "pools"),
    ],
    ids=["qkv-width", "cos-rows", "slots-int32", "norms-1d", "pools-differ"],
)
def test_qkv_write_refuses_bad_shapes(change: dict[str, torch.Tensor], match: str) -> None:
    """A mismatched input is a ConfigError naming it; the pools keep their bytes."""
    n, hq, h, d = 3, 2, 1, 16
    args = {
        "qkv": torch.ones(n, (hq + 2 * h) * d),
        "cos": torch.ones(n, d),
        "sin": torch.ones(n, d),
        "norms": torch.ones(2, d),
        "k_pool": torch.zeros(8, h, d),
        "v_pool": torch.zeros(8, h, d),
        "slots": torch.tensor([0, 1, 2]),
    }
    args.update(change)
    with pytest.raises(ConfigError, match=match):
        fused.qkv_write_triton(
            args["qkv"], args["cos"], args["sin"], args["norms"], 1e-6, hq, h, args["k_pool"], args["v_pool"],
            args["slots"],
        )  # fmt: skip
    assert not args["k_pool"].any() and not args["v_pool"].any()


@needs_kernel
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("shape", [(3, 2 * 4096), (2, 5, 2 * 100), (1, 2)], ids=str)
def test_silu_mul_matches_transformers(dtype: torch.dtype, shape: tuple[int, ...]) -> None:
    """``silu(gate) * up`` as transformers' MLP computes it, within one rounding, for any
    width (blocks that do not divide it) and leading shape."""
    g = torch.Generator().manual_seed(shape[-1])
    gate_up = (4 * torch.randn(shape, generator=g)).to(DEVICE, dtype)
    gate, up = gate_up.chunk(2, dim=-1)
    want = F.silu(gate) * up
    got = fused.silu_mul_triton(gate_up)
    assert got.shape == want.shape and got.dtype == dtype
    tol = 4 * torch.finfo(dtype).eps * float(want.abs().max())  # a rounding or two of the largest value
    torch.testing.assert_close(got.float(), want.float(), rtol=0, atol=tol)


@pytest.mark.skipif(not fused.HAVE_TRITON, reason="needs triton")
def test_silu_mul_refuses_an_odd_width() -> None:
    with pytest.raises(ConfigError, match="gate"):
        fused.silu_mul_triton(torch.ones(2, 7))


@needs_kernel
@pytest.mark.parametrize("model", ["tiny", "llama-tiny"])
def test_fuse_layers_keeps_the_model_output(model: str) -> None:
    """A fused model (every attention and MLP patched, the projections' weights views of
    the joined ones) gives the plain model's logits and writes the same K/V, for a fresh
    prefill (transformers' path) and for new tokens over a cached context (the fused
    path), batched."""
    plain = build_model(model, device=DEVICE, fused_layers=False)
    net = build_model(model, device=DEVICE, fused_layers=False)
    layers = int(net.config.num_hidden_layers)  # type: ignore[union-attr, arg-type]
    assert fused.fuse_layers(net) == 2 * layers
    assert fused.fuse_layers(net) == 0  # patched once
    attns: list[Any] = [m for m in net.modules() if type(m).__name__ in fused.ATTENTION_CLASSES]
    assert len(attns) == layers
    for attn in attns:
        joined = attn._hicache_qkv
        assert attn.q_proj.weight.data_ptr() == joined.data_ptr()
        assert attn.v_proj.weight.untyped_storage().data_ptr() == joined.untyped_storage().data_ptr()
    for a, b in zip(plain.parameters(), net.parameters(), strict=True):
        assert torch.equal(a, b)
    pools = []
    outs = []
    for m in (plain, net):
        pool = DevicePool.allocate(kv_geometry(m, 4), 12, DEVICE)
        pool.buffer.zero_()
        run = ModelRunner(m, pool, attention="paged")
        first = run.forward([([5, 17, 3, 99, 42, 7, 8], [0, 1], 0), ([9, 1, 2, 3, 4, 6, 10], [2, 3], 0)])
        second = run.forward([([11, 12, 13], [0, 1, 4], 7), ([13, 14, 15], [2, 3, 5], 7)])
        outs.append((first, second))
        pools.append(pool.buffer.clone())
    tol = 1e-4 if CUDA else 1e-5  # float32; on CUDA the joined GEMMs may pick other kernels
    for x, y in zip(outs[0], outs[1], strict=True):
        torch.testing.assert_close(x, y, rtol=tol, atol=tol)
    torch.testing.assert_close(pools[0], pools[1], rtol=tol, atol=tol)


def test_build_model_fuses_layers_only_where_asked() -> None:
    """``fused_layers=None`` fuses on CUDA only; True patches on any device."""
    plain = build_model("tiny")
    assert not any(hasattr(m, "_hicache_plain") for m in plain.modules())
    if fused.HAVE_TRITON:
        forced = build_model("tiny", fused_layers=True)
        assert sum(hasattr(m, "_hicache_plain") for m in forced.modules()) == 2 * int(forced.config.num_hidden_layers)  # type: ignore[union-attr, arg-type]


_COMPILE = """
import sys
import torch
from triton import compile as triton_compile
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from hicache.engine import fused

TYPES = {torch.float32: "*fp32", torch.float16: "*fp16", torch.bfloat16: "*bf16"}
PAIRS = [(torch.float32, torch.float32), (torch.float32, torch.float16), (torch.bfloat16, torch.bfloat16)]
hopper = GPUTarget("cuda", 90, 32)
for model, pool in PAIRS:
    m, p = TYPES[model], TYPES[pool]
    for norm in (True, False):
        signature = {
            **dict.fromkeys(["qkv_ptr", "cos_ptr", "sin_ptr", "nw_ptr", "q_out_ptr"], m),
            **dict.fromkeys(["k_ptr", "v_ptr"], p),
            "slots_ptr": "*i64",
            **dict.fromkeys(["stride_qkv", "sk_slot", "sk_h", "sv_slot", "sv_h"], "i32"),
            "eps": "fp32",
            **dict.fromkeys(["HQ", "H", "HEAD_DIM", "NORM"], "constexpr"),
        }
        consts = {"HQ": 32, "H": 8, "HEAD_DIM": 128, "NORM": norm}
        triton_compile(ASTSource(fn=fused._qkv_write_kernel, signature=signature, constexprs=consts), target=hopper)
    signature = {"gu_ptr": m, "out_ptr": m, "stride_gu": "i32", "stride_out": "i32", "N": "i32", "BLOCK": "constexpr"}
    triton_compile(ASTSource(fn=fused._silu_mul_kernel, signature=signature, constexprs={"BLOCK": 1024}), target=hopper)
print("compiled")
"""


@pytest.mark.skipif(not fused.HAVE_TRITON, reason="needs triton")
def test_kernels_compile_for_the_gpu() -> None:
    """The kernels compile for an H100/H200 (sm_90), in float32, bfloat16 and a float16
    pool under a float32 model, with and without norms, on a machine without a GPU: the
    CPU interpreter runs code the GPU compiler refuses (a name bound to pointers of two
    types in the branches of a runtime ``if``, for one). In a process of its own, without
    ``TRITON_INTERPRET`` (under it a kernel cannot be compiled)."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["TRITON_DEFAULT_FP_FUSION"] = "1"
    done = subprocess.run([sys.executable, "-c", _COMPILE], env=env, capture_output=True, text=True, timeout=300)
    if "No module named 'triton.backends.compiler'" in done.stderr or "cannot import name" in done.stderr:
        pytest.skip(f"this Triton has no ahead-of-time compile API: {done.stderr.strip().splitlines()[-1]}")
    assert done.returncode == 0 and "compiled" in done.stdout, done.stderr[-3000:]


def _custom(**spec: Any) -> Any:
    """A tiny Qwen3 of another shape, random weights (fixed seed), over the paged attention."""
    from transformers import AutoConfig, AutoModelForCausalLM

    from hicache.engine import model as engine_model

    engine_model._register()
    shape = {k: v for k, v in engine_model.PRESETS["tiny"].items() if k != "model_type"}
    config = AutoConfig.for_model("qwen3", **{**shape, **spec})
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(config, attn_implementation=engine_model.ATTENTION).eval()


_STEPS = [
    [([5, 17, 3, 99, 42, 7, 8], [0, 1], 0), ([9, 1, 2, 3, 4, 6, 10], [2, 3], 0)],
    [([11, 12, 13], [0, 1, 4], 7), ([13, 14, 15], [2, 3, 5], 7)],
]


def _served(net: Any) -> tuple[list[torch.Tensor], torch.Tensor]:
    """Logits of a fresh prefill then of tokens over the cached context, and the pool after."""
    pool = DevicePool.allocate(kv_geometry(net, 4), 12, "cpu")
    pool.buffer.zero_()
    run = ModelRunner(net, pool, attention="paged")
    return [run.forward(step) for step in _STEPS], pool.buffer.clone()


def _assert_same(a: tuple[list[torch.Tensor], torch.Tensor], b: tuple[list[torch.Tensor], torch.Tensor]) -> None:
    for x, y in zip(a[0], b[0], strict=True):
        torch.testing.assert_close(x, y, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(a[1], b[1], rtol=1e-5, atol=1e-5)


@needs_kernel
@pytest.mark.skipif(CUDA, reason="CPU models under the Triton interpreter")
def test_an_attention_the_kernel_cannot_take_stays_as_transformers_wrote_it() -> None:
    """A head dim that is not a power of two (Llama-family checkpoints of head dim 80, 96 or
    100) leaves the attention unpatched, the MLP fused, the output the plain model's; so
    does a projection with a bias where the others have none."""
    plain = _custom(hidden_size=96, head_dim=24)
    net = _custom(hidden_size=96, head_dim=24)
    assert fused.fuse_layers(net) == 2  # the two MLPs
    assert not any(hasattr(m, "_hicache_qkv") for m in net.modules())
    _assert_same(_served(plain), _served(net))
    partial: Any = _custom()
    attn = partial.model.layers[0].self_attn
    attn.k_proj.bias = torch.nn.Parameter(torch.zeros(attn.k_proj.weight.shape[0]))
    before = attn.q_proj.weight
    assert fused.fuse_layers(partial) == 3  # the other attention and both MLPs
    assert "forward" not in vars(attn) and attn.q_proj.weight is before


@needs_kernel
@pytest.mark.skipif(CUDA, reason="CPU models under the Triton interpreter")
@pytest.mark.parametrize("how", ["assign", "in-place", "cast"])
def test_weights_changed_after_fusing_are_the_weights_served(how: str) -> None:
    """Weights loaded into a fused model in place keep it fused; weights rebound
    (``load_state_dict(assign=True)``) or cast make each module go back to transformers'
    code, the joined copies dropped. Either way the logits and the K/V are those of a plain
    model with the same weights: never the joined copies' stale ones."""
    net = _custom()
    fused.fuse_layers(net)
    torch.manual_seed(1)
    new = {k: torch.randn_like(v) for k, v in _custom().state_dict().items()}
    plain = _custom()
    if how == "cast":
        net, plain = net.half(), plain.half()
    else:
        net.load_state_dict(new, assign=how == "assign")
        plain.load_state_dict(new)
    _assert_same(_served(plain), _served(net))
    still_fused = sum(hasattr(m, "_hicache_plain") for m in net.modules())
    assert still_fused == (4 if how == "in-place" else 0)
    assert all(p.requires_grad for p in net.parameters())  # fusing leaves it as it was


@pytest.mark.parametrize("flag", ["fused_norms", "fused_layers"])
@pytest.mark.parametrize("value", ["yes", 1, 0.0], ids=repr)
def test_build_model_refuses_a_fusion_flag_that_is_not_a_bool(flag: str, value: object) -> None:
    """A fusion flag other than True, False or None is a ConfigError naming it (1 and "yes"
    would have read as True)."""
    with pytest.raises(ConfigError, match=flag):
        build_model("tiny", **{flag: value})  # type: ignore[arg-type]


@needs_kernel
@pytest.mark.skipif(CUDA, reason="CPU models under the Triton interpreter")
@pytest.mark.parametrize("write_policy", ["write_through", "write_through_selective", "write_back"])
def test_an_engine_over_fused_layers_serves_restores_like_its_l1_hits(
    monkeypatch: pytest.MonkeyPatch, write_policy: str
) -> None:
    """The engine as it runs on a GPU (fused layers, the paged kernel), prompts around a page
    boundary (1, 3, 4, 5 and 9 tokens, pages of 4), under every write policy: a request
    restored from L2 gives exactly the logits and tokens of its L1 hit, and within float32
    those of an engine over transformers' layers; nothing leaks."""
    from hicache.engine import Engine
    from hicache.engine import engine as engine_module
    from hicache.spec.model import Tier
    from tests.engine.test_request_edges import drop  # L1 through the cache: write_back backs up first

    build = build_model  # what the engine calls, by that name

    def served(fuse: bool) -> list[tuple[Any, ...]]:
        monkeypatch.setattr(engine_module, "build_model", lambda *a, **k: build(*a, **{**k, "fused_layers": fuse}))
        e = Engine(
            "tiny", device="cpu", page_size=4, num_pages=64, enable_hicache=True, l2_pages=64,
            policy="always", transfer_backend="torch", attention="paged", write_policy=write_policy,
        )  # fmt: skip
        assert sum(hasattr(m, "_hicache_plain") for m in e.runner.net.modules()) == (4 if fuse else 0)
        rows = []
        for n in (1, 3, 4, 5, 9):
            prompt = random.Random(n).choices(range(512), k=n)
            e.generate(prompt, max_new_tokens=2)
            e.cache.drain()
            l1 = e.generate(prompt, max_new_tokens=3)
            e.generate(prompt, max_new_tokens=3)  # a second hit: write_through_selective backs it up
            drop(e, Tier.L1)
            l2 = e.generate(prompt, max_new_tokens=3)
            assert l2.cached_tokens == l1.cached_tokens == (n - 1) // 4 * 4, (n, l1, l2)
            if l1.cached_tokens:  # a whole page cached: restored
                assert (l1.restored_from, l2.restored_from) == ("L1", "L2"), (n, l1, l2)
            assert l1.first_logits is not None and l2.first_logits is not None
            assert torch.equal(l2.first_logits, l1.first_logits) and l2.tokens == l1.tokens
            rows.append((l2.first_logits, l2.tokens))
        e.cache.drain()  # backups still in flight hold leases until they finish
        st = e.cache.status()
        assert st.requests == 0 and st.core.leases == 0
        e.cache.check_integrity()
        e.close()
        return rows

    for (a, ta), (b, tb) in zip(served(True), served(False), strict=True):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)
        assert ta == tb
