"""The reference engine on CUDA: CUDA-graph replays against eager forwards, and restored
requests against L1 hits (bit-identical: same pages, same kernels)."""

from __future__ import annotations

import random
from collections.abc import Callable
from typing import Any, cast

import pytest
import torch

from hicache.backends.pools import DevicePool
from hicache.engine import Engine, ModelRunner, build_model, kv_geometry
from hicache.engine.attention import paged_attention_torch, paged_attention_triton
from hicache.engine.model import PRESETS, CudnnUse
from hicache.spec.model import Tier

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]


def make(cuda_graphs: bool, dtype: torch.dtype = torch.float32) -> Engine:
    return Engine(
        "tiny",
        device="cuda",
        dtype=dtype,
        page_size=16,
        num_pages=256,
        enable_hicache=True,
        l2_pages=256,
        l3_pages=512,
        policy="always",
        cuda_graphs=cuda_graphs,
    )


def serve(e: Engine, prompt: list[int], drop: tuple[Tier, ...]) -> tuple[list[int], torch.Tensor, str]:
    e.cache.drain()
    for t in drop:
        e.cache.core.evict(t, 10**6)
    out = e.generate(prompt, max_new_tokens=6)
    assert out.first_logits is not None
    return out.tokens, out.first_logits, out.restored_from


def test_graph_replays_match_eager_and_restores_match_l1_hits() -> None:
    rng = random.Random(0)
    prompt = [rng.randrange(512) for _ in range(300)]
    results = {}
    for graphs in (False, True):
        e = make(graphs)
        serve(e, prompt, ())
        runs = {
            tier: serve(e, [*prompt, 5, 6], drop)
            for tier, drop in (("L1", ()), ("L2", (Tier.L1,)), ("L3", (Tier.L1, Tier.L2)))
        }
        for tier, (_, _, source) in runs.items():
            assert source == tier
        for tier in ("L2", "L3"):  # the same pages and the same kernels: exactly equal
            assert runs[tier][0] == runs["L1"][0] and torch.equal(runs[tier][1], runs["L1"][1])
        assert (e.runner.graph_replays > 0) == graphs
        e.cache.check_integrity()
        e.close()
        results[graphs] = runs["L1"]
    torch.testing.assert_close(results[True][1], results[False][1], rtol=1e-4, atol=1e-4)
    assert results[True][0] == results[False][0]


def test_a_padded_graph_batch_serves_concurrent_requests() -> None:
    """Continuous batching on CUDA with graphs: 12 requests of different lengths decoded
    together give the tokens each gets when served alone."""
    rng = random.Random(1)
    prompts = [[rng.randrange(512) for _ in range(rng.randrange(20, 200))] for _ in range(12)]
    alone = make(True)
    want = [alone.generate(p, max_new_tokens=8).tokens for p in prompts]
    alone.close()
    e = make(True)
    ids = [e.submit(p, 8) for p in prompts]
    got = {o.id: o.tokens for o in e.run()}
    assert [got[i] for i in ids] == want
    assert e.stats.decode_tokens > e.stats.decode_batches and e.runner.graph_replays > 0
    e.cache.check_integrity()
    e.close()


def test_short_fresh_prefills_replay_graphs_and_match_the_eager_ones() -> None:
    """``graph_short_prefills`` (on by default with CUDA graphs): prompts of at most 64
    tokens with nothing cached replay a graph captured once per length, with the eager
    path's tokens and (float32) logits."""
    rng = random.Random(3)
    prompts = [[rng.randrange(512) for _ in range(32)] for _ in range(4)] + [[rng.randrange(512) for _ in range(48)]]
    runs = {}
    for flag in (False, None):
        e = Engine("tiny", device="cuda", page_size=16, num_pages=256, graph_short_prefills=flag)
        runs[flag] = [e.generate(p, max_new_tokens=4) for p in prompts]
        fresh_graphs = sorted(q for (_, q, _, _) in e.runner._graphs if q > 1)  # decode graphs have q == 1
        assert fresh_graphs == ([32, 48] if flag is None else []), fresh_graphs
        e.cache.check_integrity()
        e.close()
    for eager, graphed in zip(runs[False], runs[None], strict=True):
        assert graphed.tokens == eager.tokens
        assert graphed.first_logits is not None and eager.first_logits is not None
        torch.testing.assert_close(graphed.first_logits, eager.first_logits, rtol=1e-4, atol=1e-4)


def test_short_fresh_prefill_graphs_hold_at_most_a_quarter_of_the_graphs() -> None:
    """Graphs of fresh short prefills (one per length) stop at ``max_graphs // 4``: later
    lengths run eagerly, and decode batches still get graphs."""
    net = build_model("tiny", device="cuda")
    pool = DevicePool.allocate(kv_geometry(net, 16), 64, "cuda")
    run = ModelRunner(net, pool, max_graphs=8)
    assert run.graph_short_prefills
    for n in (10, 20, 30, 40):  # four lengths, room for two
        run.forward([(list(range(n)), [0, 1, 2], 0)])
    assert sorted(q for (_, q, _, _) in run._graphs) == [10, 20] and run.eager_forwards == 2
    run.forward([(list(range(20)), [3, 4], 0)])  # a length that has its graph replays it
    assert run.eager_forwards == 2 and run.graph_replays == 3
    run.forward([([5], [0, 1, 2], 40)])  # a decode step still gets a graph
    assert run.graphs_captured == 3 and run.graph_replays == 4


@pytest.mark.parametrize("cudnn", ["off", "graphs", "on"])
def test_attention_runs_without_cudnn_sdpa_unless_asked(cudnn: CudnnUse, monkeypatch: pytest.MonkeyPatch) -> None:
    """cuDNN's SDPA holds native memory per shape (the GPU soak's RSS growth): off by
    default around every forward, allowed in graph captures only with "graphs", everywhere
    with "on"; the process setting is restored."""
    enabled = cast(Callable[[], bool], torch.backends.cuda.cudnn_sdp_enabled)
    seen: list[bool] = []
    sdpa = torch.nn.functional.scaled_dot_product_attention

    def spy(*args: Any, **kwargs: Any) -> torch.Tensor:
        seen.append(enabled())
        return sdpa(*args, **kwargs)

    monkeypatch.setattr(torch.nn.functional, "scaled_dot_product_attention", spy)
    layers = int(PRESETS["tiny"]["num_hidden_layers"])
    net = build_model("tiny", device="cuda")
    pool = DevicePool.allocate(kv_geometry(net, 16), 16, "cuda")
    run = ModelRunner(net, pool, attention="gqa", cudnn=cudnn, graph_tokens=1)
    before = enabled()
    run.forward([(list(range(40)), [0, 1, 2], 0)])  # a fresh prefill: eager
    run.forward([([7, 8], [0, 1, 2], 40)])  # two tokens over the pages: eager (> graph_tokens)
    assert seen == [cudnn == "on" and before] * 2 * layers
    run.forward([([9], [0, 1, 2], 42)])  # one token: captured (warm-up and capture)
    in_capture = {"off": False, "graphs": True, "on": before}[cudnn]
    assert seen[2 * layers :] == [in_capture] * 2 * layers
    assert run.graphs_captured == 1 and enabled() == before


@pytest.mark.parametrize("graphs", [True, False])
def test_each_attention_serves_the_engine_like_gqa(graphs: bool) -> None:
    """float32 on CUDA: over cached prefixes (the second request of each prompt) and in
    decode, the folded path and the paged kernel (captured in graphs, or eager) give the
    logits and tokens of the enable_gqa path."""
    rng = random.Random(1)
    prompts = [[rng.randrange(512) for _ in range(n)] for n in (40, 300, 700)]
    logits: dict[str, list[torch.Tensor]] = {}
    tokens: dict[str, list[list[int]]] = {}
    for attention in ("gqa", "fold", "paged"):
        e = Engine("tiny", device="cuda", page_size=16, num_pages=256, attention=attention, cuda_graphs=graphs)
        assert e.runner.attention == attention
        outs = [e.generate([*p, i], max_new_tokens=4) for p in prompts for i in range(2)]
        assert all(o.first_logits is not None for o in outs)
        logits[attention] = [cast(torch.Tensor, o.first_logits) for o in outs]
        tokens[attention] = [o.tokens for o in outs]
        assert (e.runner.graph_replays > 0) == graphs
        e.close()
    for attention in ("fold", "paged"):
        for a, b in zip(logits[attention], logits["gqa"], strict=True):
            torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-4)
        assert tokens[attention] == tokens["gqa"]


def test_paged_kernel_on_qwen3_8b_shapes_in_bfloat16() -> None:
    """A restored tail (22 tokens over 3,584, padded to a graph bucket) and a decode batch
    with Qwen3-8B's heads, against gather + SDPA."""
    g = torch.Generator(device="cuda").manual_seed(0)
    for b, q, t, ctx in ((1, 22, 3840, [3584]), (8, 1, 2048, [2048, 1900, 35, 700, 1, 2047, 1024, 512])):
        k_pool = torch.randn(8192, 8, 128, generator=g, device="cuda", dtype=torch.bfloat16)
        v_pool = torch.randn(8192, 8, 128, generator=g, device="cuda", dtype=torch.bfloat16)
        read = torch.randint(0, 8192, (b, t), generator=g, device="cuda")
        query = torch.randn(b, q, 32, 128, generator=g, device="cuda", dtype=torch.bfloat16).transpose(1, 2)
        c = torch.tensor(ctx, device="cuda")
        got = paged_attention_triton(query, k_pool, v_pool, read, c, 128**-0.5)
        want = paged_attention_torch(query, k_pool, v_pool, read, c, 128**-0.5)
        torch.testing.assert_close(got, want, rtol=2e-2, atol=2e-2)


@pytest.mark.parametrize("kernel", [True, False], ids=["upload-kernel", "upload-dma"])
def test_forwards_upload_their_inputs_by_kernel_or_fall_back_to_the_dma(
    kernel: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The runner uploads a forward's inputs with ``kernels.upload_triton``; where that
    kernel cannot run it warns once and uploads by DMA. Either way graph replays and eager
    forwards give the same tokens and logits, and restores equal L1 hits."""
    from hicache.backends import kernels

    if not kernel:

        def broken(dst: torch.Tensor, src: torch.Tensor) -> None:
            raise RuntimeError("no upload kernel here")

        monkeypatch.setattr(kernels, "upload_triton", broken)
    rng = random.Random(3)
    prompt = [rng.randrange(512) for _ in range(120)]
    runs = {}
    for graphs in (False, True):
        if kernel:
            e = make(graphs)
        else:
            with pytest.warns(UserWarning, match="metadata uploads stay DMAs"):
                e = make(graphs)
        assert e.runner._upload_kernel is kernel
        serve(e, prompt, ())
        l1 = serve(e, [*prompt, 7], ())
        l2 = serve(e, [*prompt, 7], (Tier.L1,))
        assert l2[2] == "L2" and l2[0] == l1[0] and torch.equal(l2[1], l1[1])
        e.cache.check_integrity()
        e.close()
        runs[graphs] = l1
    assert runs[True][0] == runs[False][0]
    torch.testing.assert_close(runs[True][1], runs[False][1], rtol=1e-4, atol=1e-4)
