"""Models for the reference engine: transformers decoders over the paged L1 pool.

A model is a stock transformers decoder (Qwen3 or Llama family) built from a local
checkpoint directory or from a config with random weights (a fixed seed; same compute cost
as real weights). Attention goes through ``paged_attention``, registered with transformers'
``AttentionInterface`` as ``"hicache_paged"``: per layer it writes the new tokens' K/V into
their L1 slots and attends over the request's whole context read from its pages. Per-batch
metadata travels as the ``hicache_batch`` keyword, which transformers passes through to
attention functions. Token slots are flat: slot ``s`` is page ``s // page_size``, offset
``s % page_size``.
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import itertools
import operator
import os
import pickle
import warnings
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import numpy as np
import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

from hicache.backends import dma, kernels
from hicache.backends.pools import DevicePool
from hicache.core.geometry import KVGeometry
from hicache.engine import attention as paged
from hicache.engine import fused
from hicache.engine.attention import visible as visible  # re-exported: the mask rule lives with the kernel
from hicache.engine.signals import LayerSignals
from hicache.engine.signals import probe as probe_signals
from hicache.errors import ConfigError, MisuseError, is_out_of_memory

ATTENTION = "hicache_paged"
AttentionImpl = Literal["auto", "paged", "gqa", "fold"]
CudnnUse = Literal["off", "graphs", "on"]
_NO_CUDNN = [SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH]
_ALL_BACKENDS = [SDPBackend.CUDNN_ATTENTION, *_NO_CUDNN]

_TINY: dict[str, Any] = dict(
    vocab_size=512,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    # NOTE: random weights make no context: this only bounds what a workload may submit
    max_position_embeddings=1 << 20,
)
_QWEN3: dict[str, Any] = dict(
    model_type="qwen3",
    vocab_size=151936,
    num_hidden_layers=36,
    num_attention_heads=32,
    num_key_value_heads=8,
    head_dim=128,
    max_position_embeddings=40960,
    rope_theta=1_000_000.0,
)
PRESETS: dict[str, dict[str, Any]] = {
    "tiny": {**_TINY, "model_type": "qwen3"},  # CPU tests and the CPU main job
    "llama-tiny": {**_TINY, "model_type": "llama"},
    "qwen3-4b": {**_QWEN3, "hidden_size": 2560, "intermediate_size": 9728, "tie_word_embeddings": True},
    "qwen3-8b": {**_QWEN3, "hidden_size": 4096, "intermediate_size": 12288, "tie_word_embeddings": False},
}


@dataclass
class PagedBatch:
    """Per-forward attention metadata for a batch of ``B`` sequences with ``q`` new tokens
    each. ``read_slots`` is None when no sequence has cached context (the keys are the new
    tokens themselves, causal); otherwise row ``b`` lists the slots of sequence ``b``'s whole
    context in token order, padded at the end with one of its own slots, and ``mask``
    (``[B, 1, q, T]``, or None for unpadded one-token decode) says which keys each query sees.
    With ``attention="paged"`` the Triton kernel reads the context straight from the pool and
    masks by ``ctx`` (each sequence's context length, its new tokens included) instead."""

    pool: DevicePool
    write_slots: torch.Tensor  # int64 [B, q]
    read_slots: torch.Tensor | None  # int64 [B, T]
    mask: torch.Tensor | None  # bool [B, 1, q, T]
    attention: AttentionImpl = "gqa"  # how to attend over the context (see ModelRunner); never "auto"
    ctx: torch.Tensor | None = None  # int64 [B], for "paged"
    folded_mask: torch.Tensor | None = None  # ``mask`` repeated per query group, made once per forward
    layer_ready: Sequence[Any] | None = None  # CUDA events: layer l reads the pool after layer_ready[l]

    def __post_init__(self) -> None:
        if self.attention not in ("paged", "gqa", "fold"):
            raise ConfigError(f"a batch attends with 'paged', 'gqa' or 'fold', got {self.attention!r}")
        if self.attention == "paged" and self.read_slots is not None and self.ctx is None:
            raise ConfigError("attention 'paged' needs the batch's context lengths (ctx)")


def paged_attention(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    dropout: float = 0.0,
    scaling: float | None = None,
    **kwargs: Any,
) -> tuple[torch.Tensor, None]:
    """transformers attention over the paged pool. ``query`` is ``[B, Hq, q, D]``, ``key``
    and ``value`` ``[B, H, q, D]`` for the new tokens only (RoPE applied). Writes the new
    K/V to their slots, then attends over the context read back from the pool."""
    batch: PagedBatch | None = kwargs.get("hicache_batch")
    if batch is None:
        raise ConfigError("paged_attention needs the hicache_batch keyword (use hicache.engine.ModelRunner)")
    layer_idx: Any = module.layer_idx
    layer = int(layer_idx)
    if batch.layer_ready is not None:  # a restore still landing: this layer's pages first
        batch.layer_ready[layer].wait(torch.cuda.current_stream())
    buf = batch.pool.buffer
    heads, dim = buf.shape[-2], buf.shape[-1]
    k_pool = buf[0, layer].view(-1, heads, dim)
    v_pool = buf[1, layer].view(-1, heads, dim)
    slots = batch.write_slots.reshape(-1)
    k_pool[slots] = key.transpose(1, 2).reshape(-1, heads, dim).to(buf.dtype)
    v_pool[slots] = value.transpose(1, 2).reshape(-1, heads, dim).to(buf.dtype)
    if batch.read_slots is None:  # a fresh prefill: the context is the new tokens
        out = F.scaled_dot_product_attention(
            query, key, value, is_causal=query.shape[2] > 1, scale=scaling, enable_gqa=True
        )
    elif batch.attention == "paged" and query.shape[2] <= paged.MAX_QUERY_TOKENS:
        assert batch.ctx is not None  # PagedBatch checks it
        return paged.paged_attention_triton(query, k_pool, v_pool, batch.read_slots, batch.ctx, scaling), None
    else:
        k = k_pool[batch.read_slots].transpose(1, 2).to(query.dtype)
        v = v_pool[batch.read_slots].transpose(1, 2).to(query.dtype)
        if batch.attention == "fold":
            if batch.mask is not None and batch.folded_mask is None:  # the first layer
                batch.folded_mask = fold_mask(batch.mask, query.shape[1] // k.shape[1])
            out = _folded(query, k, v, batch.folded_mask, scaling)
        else:
            out = F.scaled_dot_product_attention(query, k, v, attn_mask=batch.mask, scale=scaling, enable_gqa=True)
    return out.transpose(1, 2).contiguous(), None


def fold_mask(mask: torch.Tensor, g: int) -> torch.Tensor:
    """``[B, 1, q, T]`` -> ``[B, 1, g*q, T]``: the mask of each of ``g`` folded query groups."""
    b, _, q, t = mask.shape
    return mask.unsqueeze(2).expand(b, 1, g, q, t).reshape(b, 1, g * q, t)


def _folded(
    query: torch.Tensor, k: torch.Tensor, v: torch.Tensor, folded_mask: torch.Tensor | None, scaling: float | None
) -> torch.Tensor:
    """Grouped-query attention as plain attention: the ``g`` query heads that share a K/V
    head become ``g`` times as many queries of that head (``[B, H, g*q, D]``), so no
    backend needs GQA support and K/V are never expanded. ``folded_mask`` comes from
    :func:`fold_mask` (or None: every key visible)."""
    b, hq, q, d = query.shape
    h = k.shape[1]
    g = hq // h
    qf = query.reshape(b, h, g * q, d)  # query head i uses K/V head i // g
    out = F.scaled_dot_product_attention(qf, k, v, attn_mask=folded_mask, scale=scaling)
    return out.view(b, h, g, q, d).reshape(b, hq, q, d)


def _register() -> None:
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface

    AttentionInterface.register(ATTENTION, paged_attention)
    AttentionMaskInterface.register(ATTENTION, lambda *args, **kwargs: None)  # we mask ourselves


def is_checkpoint(model: str) -> bool:
    """``model`` names a local checkpoint directory: one with a ``config.json``."""
    return bool(model) and (Path(model) / "config.json").is_file()


def _check_weights_fit(model: str, config: Any, dtype: torch.dtype, device: torch.device) -> None:
    """Refuse, before building it, a preset whose weights alone outgrow the whole memory they
    would be built in (MemoryError). On the host the kernel would otherwise kill the process
    part-way through, with no message. The shape is built on the meta device: no memory."""
    from transformers import AutoModelForCausalLM

    from hicache.facade import _host_memory

    with torch.device("meta"):
        shape = AutoModelForCausalLM.from_config(config, dtype=dtype, attn_implementation=ATTENTION)
    need = sum(t.numel() * t.element_size() for t in itertools.chain(shape.parameters(), shape.buffers()))
    if device.type == "cuda":
        have: int | None = torch.cuda.get_device_properties(device).total_memory
        where = f"the memory of {device}"
    else:
        have, where = _host_memory(), "this machine's host memory"
    if have is not None and need > have:
        raise MemoryError(
            f"model {model!r} needs {need / 2**30:.1f} GiB of weights in {str(dtype).removeprefix('torch.')}, "
            f"more than {where} ({have / 2**30:.1f} GiB)"
        )


def _safetensors_errors() -> tuple[type[BaseException], ...]:
    """The error safetensors raises for a weights file it cannot parse (none without it)."""
    try:
        from safetensors import SafetensorError
    except ImportError:
        return ()
    return (SafetensorError,)


# transformers' word for a checkpoint it cannot read, and the loaders' for weights files cut
# short or overwritten (safetensors' header, torch.load's pickle or zip)
_UNREADABLE: tuple[type[BaseException], ...] = (
    OSError,
    ValueError,
    KeyError,
    EOFError,
    RuntimeError,
    pickle.UnpicklingError,
    *_safetensors_errors(),
)


def build_model(
    model: str,
    *,
    device: str | torch.device = "cpu",
    dtype: torch.dtype = torch.float32,
    seed: int = 0,
    fused_norms: bool | None = None,
    fused_layers: bool | None = None,
) -> torch.nn.Module:
    """A preset name (random weights, fixed seed) or a local checkpoint directory. Nothing
    is downloaded. ``fused_norms``: RMSNorms in one Triton kernel each
    (:func:`hicache.engine.fused.fuse_norms`); ``fused_layers``: joined projections and
    the attention prologue and MLP activation in one kernel each
    (:func:`hicache.engine.fused.fuse_layers`); None: on CUDA when Triton is installed.
    ConfigError without transformers (the ``[engine]`` extra)."""
    try:
        from transformers import AutoConfig, AutoModelForCausalLM
    except ImportError as exc:
        need = "pip install '.[engine]' in a checkout of hicache"
        raise ConfigError(f"the reference engine's models need the [engine] extra: {need} ({exc})") from None

    for name, flag in (("fused_norms", fused_norms), ("fused_layers", fused_layers)):
        if flag is not None and not isinstance(flag, bool):
            raise ConfigError(f"{name} must be True, False or None (on CUDA), got {flag!r}")
    _register()
    if model in PRESETS:
        spec = dict(PRESETS[model])
        config = AutoConfig.for_model(spec.pop("model_type"), **spec)
        config._attn_implementation = ATTENTION
        _check_weights_fit(model, config, dtype, torch.device(device))
        torch.manual_seed(seed)
        with torch.device(device):
            net = AutoModelForCausalLM.from_config(config, dtype=dtype, attn_implementation=ATTENTION)
    elif is_checkpoint(model):
        try:
            net = AutoModelForCausalLM.from_pretrained(
                model, dtype=dtype, attn_implementation=ATTENTION, local_files_only=True
            ).to(device)
        except torch.OutOfMemoryError:
            raise  # NOTE: a checkpoint too large for the device is not an unreadable one
        except _UNREADABLE as exc:
            if is_out_of_memory(exc):  # NOTE: torch's host allocator fails with a plain RuntimeError
                raise
            raise ConfigError(f"model {model!r}: not a checkpoint transformers can load ({exc})") from exc
    else:
        raise ConfigError(
            f"model must be one of {sorted(PRESETS)} or a local checkpoint directory (a config.json), got {model!r}"
        )
    if fused_norms is None:
        fused_norms = torch.device(device).type == "cuda"
    if fused_norms:
        fused.fuse_norms(net)
    if fused_layers is None:
        fused_layers = torch.device(device).type == "cuda"
    if fused_layers:
        fused.fuse_layers(net)
    result: torch.nn.Module = net.eval()
    return result


def model_geometry(model: str, page_size: int, dtype: torch.dtype) -> KVGeometry:
    """The KV geometry ``build_model(model, dtype=dtype)`` will have, without building it."""
    if model in PRESETS:
        spec = PRESETS[model]
        layers, heads, dim = spec["num_hidden_layers"], spec["num_key_value_heads"], spec["head_dim"]
    elif is_checkpoint(model):
        from transformers import AutoConfig

        try:
            cfg: Any = AutoConfig.from_pretrained(model, local_files_only=True)
        except (OSError, ValueError, KeyError) as exc:
            raise ConfigError(f"model {model!r}: not a checkpoint transformers can load ({exc})") from exc
        dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
        layers, heads = cfg.num_hidden_layers, cfg.num_key_value_heads
    else:
        raise ConfigError(f"model must be one of {sorted(PRESETS)} or a local checkpoint directory, got {model!r}")
    return KVGeometry(int(layers), int(heads), int(dim), page_size, dtype)


def model_identity(model: str, seed: int = 0) -> str:
    """The name part of this model's identity in a shared store: a preset with its weights'
    seed, or a checkpoint's directory name with a digest of its config and weight files'
    names and sizes. The engine adds :func:`weights_digest` of the weights it runs, so other
    weights (a ``net`` given in place of the named model, a checkpoint rewritten in place, a
    preset built differently elsewhere) never match."""
    if model in PRESETS:
        return f"preset:{model}:seed={seed}"
    p = Path(model)
    if not is_checkpoint(model):
        raise ConfigError(f"model must be one of {sorted(PRESETS)} or a local checkpoint directory, got {model!r}")
    h = hashlib.sha256()
    for f in sorted(p.iterdir()):
        if f.is_file() and (f.suffix in (".safetensors", ".bin") or f.name == "config.json"):
            h.update(os.fsencode(f.name))  # a name not in UTF-8 too
            h.update(f.read_bytes() if f.name == "config.json" else str(f.stat().st_size).encode())
    return f"checkpoint:{p.resolve().name}:{h.hexdigest()[:16]}"


# Elements per step of :func:`weights_digest` (its int64 temporaries: 3 x 64 MiB).
DIGEST_CHUNK = 1 << 23
DIGEST_SAMPLES = 4096
# Position weights of the digest's third sum: odd, so two values swapped between positions
# change it unless the positions' weights agree (a 1 in 2**31 chance for a pair).
_DIGEST_MULT = 0x9E3779B1


@torch.inference_mode()
def weights_digest(net: torch.nn.Module) -> str:
    """A fingerprint of ``net``'s weights' content, the same on every device and process for
    the same values: per parameter and buffer (by name, with shape and dtype), over its bits
    (as int16 words, or bytes): their int64 sum, sum of squares and sum weighted by position,
    and ``DIGEST_SAMPLES`` of them evenly spaced. Other weights (another seed, another
    checkpoint, one value changed or two swapped) differ in it but for a chance collision of
    the sums. One pass over the weights on their device, once per engine with a shared L3
    (a read of every weight byte, 16 GB for an 8B model in bf16, in chunks of
    ``DIGEST_CHUNK`` elements). ConfigError for weights without values here (the meta
    device) or not strided (sparse)."""
    h = hashlib.sha256()
    sums: list[torch.Tensor] = []
    samples: list[torch.Tensor] = []
    for name, t in itertools.chain(net.named_parameters(), net.named_buffers()):
        h.update(f"{name}:{tuple(t.shape)}:{t.dtype};".encode())
        if t.is_meta or t.layout is not torch.strided:
            raise ConfigError(
                f"cannot fingerprint the weights: {name} is {'on the meta device' if t.is_meta else t.layout}"
            )
        t = t.detach()
        if t.is_quantized:
            t = t.int_repr()  # NOTE: a view of a quantized tensor stays quantized
        flat = t.contiguous().reshape(-1)
        if flat.numel() == 0:
            continue
        words = flat.view(torch.int16 if flat.element_size() % 2 == 0 else torch.int8)
        acc = torch.zeros(3, dtype=torch.int64, device=words.device)
        start = 0
        for chunk in torch.split(words, DIGEST_CHUNK):
            wide = chunk.to(torch.int64)
            acc[0] += wide.sum()
            acc[1] += (wide * wide).sum()
            pos = torch.arange(start, start + wide.numel(), device=wide.device, dtype=torch.int64)
            acc[2] += (wide * ((pos * _DIGEST_MULT) & 0x7FFFFFFF)).sum()
            start += wide.numel()
        sums.append(acc)
        n, k = words.numel(), min(words.numel(), DIGEST_SAMPLES)
        # NOTE: in int64: float positions past 2**24 elements round beyond the last one
        idx = torch.arange(k, device=words.device, dtype=torch.int64) * (n - 1) // max(k - 1, 1)
        samples.append(words[idx].to(torch.int64))
    if sums:  # NOTE: each to the host first: a model may span devices
        h.update(torch.cat([x.cpu() for x in sums]).numpy().tobytes())
        h.update(torch.cat([x.cpu() for x in samples]).numpy().tobytes())
    return h.hexdigest()[:16]


def kv_geometry(net: torch.nn.Module, page_size: int) -> KVGeometry:
    """The KV geometry of ``net``'s attention (MHA/GQA) at ``page_size`` tokens per page."""
    cfg: Any = net.config
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    dtype = next(net.parameters()).dtype
    return KVGeometry(int(cfg.num_hidden_layers), int(cfg.num_key_value_heads), int(head_dim), page_size, dtype)


def resolve_attention(attention: AttentionImpl, device: str | torch.device) -> AttentionImpl:
    """What ``"auto"`` means on ``device``: the paged Triton kernel on CUDA (when Triton is
    installed), SDPA with ``enable_gqa`` elsewhere; other choices stand."""
    if attention != "auto":
        return attention
    return "paged" if torch.device(device).type == "cuda" and paged.HAVE_TRITON else "gqa"


# Whether runners signal layers by value (LayerSignals) where the driver can, so a layered
# forward is launched while its restore's copies are queued; False: CUDA events, the forward
# launched after them (bench: --layer-waits).
LAYER_SIGNALS = False


class ModelRunner:
    """Forward passes of ``net`` whose KV lives in ``pool``; returns last-token logits.

    On CUDA, batches of a few new tokens (decode, a restored prompt's tail, short fresh
    prefills) replay CUDA graphs captured per ``(batch, new tokens, context bucket)``: for
    so few tokens the launches of an eager forward, not the GPU, set the time. Layered
    forwards serve a request whose prefix is still landing: each layer waits on that
    layer's event, on a stream of their own so decode batches are not queued behind the copy.
    """

    def __init__(
        self,
        net: torch.nn.Module,
        pool: DevicePool,
        *,
        cuda_graphs: bool = True,
        graph_tokens: int = 64,
        graph_bucket: int = 256,
        max_graphs: int = 64,
        graph_short_prefills: bool | None = None,
        attention: AttentionImpl = "auto",
        cudnn: CudnnUse = "off",
        layer_groups: Sequence[tuple[int, int]] | None = None,
        layer_signals: bool | None = None,
    ) -> None:
        """``graph_tokens``: the most new tokens a graph replays; contexts are padded to
        ``graph_bucket``; at most ``max_graphs`` graphs, of which short fresh prefills
        (``graph_short_prefills``, None: whenever graphs are on) take at most a quarter.
        ``attention``: ``"paged"`` (the Triton kernel up to ``MAX_QUERY_TOKENS`` new tokens,
        SDPA beyond), ``"gqa"`` (SDPA with ``enable_gqa``), ``"fold"`` (query groups folded
        into the query length), ``"auto"`` (paged on CUDA with Triton, else gqa). ``cudnn``:
        cuDNN's SDPA backend keeps host memory per distinct shape and an engine's shapes
        keep changing, so ``"off"``; ``"graphs"`` (captures only) and ``"on"`` are for
        measuring. ``layer_groups``: the transfer's; layers landing together share an event.
        ``layer_signals``: where the driver's value waits work (cuda-python), the layer events
        are :class:`~hicache.engine.signals.LayerSignals` (:attr:`signals`), so a layered
        forward can be launched before its restore's copies are queued; else CUDA events
        (None: :data:`LAYER_SIGNALS`)."""
        attention = self.check_settings(attention, cudnn, pool.device)
        self.net = net
        self.pool = pool
        self.page_size = pool.geometry.page_size
        self.graphs_enabled = cuda_graphs and pool.device.type == "cuda"
        self.graph_tokens = graph_tokens
        self.graph_short_prefills = self.graphs_enabled if graph_short_prefills is None else graph_short_prefills
        self._fresh_keys: set[tuple[int, int, int, bool]] = set()  # graphs captured for fresh prefills
        self.graph_bucket = graph_bucket
        self.max_graphs = max_graphs
        self._graphs: dict[tuple[int, int, int, bool], _Graph] = {}
        self._mempool: Any = None
        self._layered_mempool: Any = None
        self.graph_replays = 0
        self.eager_forwards = 0
        self.captured_last = False  # the last forward captured a CUDA graph (one-time cost)
        # Pinned staging for per-forward metadata, two buffers in turn: a forward launched
        # right after another (a layered prefill after a decode batch's launch) does not wait
        # for the other's upload to have run, only for the one two forwards back.
        self._hosts: list[torch.Tensor | None] = [None, None]
        self._copied: list[Any] = (
            [torch.cuda.Event(), torch.cuda.Event()] if pool.device.type == "cuda" else []  # type: ignore[no-untyped-call]
        )
        self._turn = 0
        self._dev: torch.Tensor | None = None
        self._upload_kernel = False  # uploads by kernel (kernels.upload_triton), not by DMA
        # Graph replays write their inputs into the staging buffer (numpy) on CUDA; the CPU
        # tests switch it on with stand-in events to run that path without a GPU.
        self._staged_inputs = self._pinned = pool.device.type == "cuda"
        self.attention: AttentionImpl = attention
        cuda = pool.device.type == "cuda"
        self._backends = _NO_CUDNN if cuda and cudnn != "on" else None  # eager forwards
        self._capture_backends = _ALL_BACKENDS if cuda and cudnn == "graphs" else None
        self.layer_events: tuple[Any, ...] = ()
        self._side: Any = None
        self._capture_stream: Any = None  # where the other graphs are captured
        self._issue: Any = None  # where work queued in after() runs: behind a mark() only
        self._mark: Any = None
        self._caller: Any = None  # the caller's stream, while inside after()
        self._layered_done: Any = None
        layers = pool.geometry.num_layers
        groups = layer_groups or [(x, x + 1) for x in range(layers)]
        if [x for lo, hi in groups for x in range(lo, hi)] != list(range(layers)):
            raise ConfigError(f"layer_groups {list(groups)} do not cover layers 0..{layers - 1} in order")
        self.signals: LayerSignals | None = None  # value waits: the forward can be launched first
        self._fill: Any = None  # where end_round records the signals a producer did not
        if cuda:
            make: Any = torch.cuda.Event
            shared = [make(external=True) for _ in groups]  # a group's layers land together
            self.layer_events = tuple(e for e, (lo, hi) in zip(shared, groups, strict=True) for _ in range(lo, hi))
            for event in shared:
                event.record()  # a wait on a never-recorded event is not allowed in a capture
            # NOTE: a graph uses the cuBLAS workspace of the stream it was captured on; two graphs
            # captured on one stream and replayed at once on two share it, and a layered prefill
            # beside decode batches then hangs or computes wrong values
            # (bench/probes/layered_hang_min.py). So each replay stream captures its own graphs.
            self._side = _own_stream(pool.device, "side", priority=-1)
            self._capture_stream = _own_stream(pool.device, "capture", priority=0)
            self._issue = _own_stream(pool.device, "issue", priority=-1)
            self._mark = make()
            self._layered_done = make()
            self._upload_kernel = self._warm_upload()
            if (LAYER_SIGNALS if layer_signals is None else layer_signals) and dma.values_usable():
                signals = LayerSignals(groups, pool.device)
                if probe_signals(signals, self._side):
                    self.signals, self.layer_events = signals, signals.events
                    self._fill = _own_stream(pool.device, "signals", priority=-1)
        self.closed = False

    @staticmethod
    def check_settings(attention: object, cudnn: object, device: str | torch.device) -> AttentionImpl:
        """``attention`` resolved for ``device``; ConfigError for a choice that does not
        exist or cannot run there (so an engine refuses it before it opens anything)."""
        if attention not in ("auto", "paged", "gqa", "fold"):
            raise ConfigError(f"attention must be 'auto', 'paged', 'gqa' or 'fold', got {attention!r}")
        resolved = resolve_attention(attention, device)
        if resolved == "paged" and not paged.HAVE_TRITON:
            raise ConfigError("attention 'paged' needs triton")
        if resolved == "paged" and torch.device(device).type != "cuda" and os.environ.get("TRITON_INTERPRET") != "1":
            # NOTE: Triton runs kernels on a CPU only interpreted (tests); without it the first
            # forward raised deep inside Triton ("0 active drivers").
            raise ConfigError("attention 'paged' needs a CUDA device (on CPU: 'gqa' or 'fold')")
        if cudnn not in ("off", "graphs", "on"):
            raise ConfigError(f"cudnn must be 'off', 'graphs' or 'on', got {cudnn!r}")
        return resolved

    def _warm_upload(self) -> bool:
        """Compile the upload kernel's variants (n == 1, n % 16 == 0, else) now; False (the
        uploads stay DMAs) without Triton or where it cannot run here."""
        if not kernels.HAVE_TRITON:
            return False
        try:
            for n in (1, 16, 17):
                kernels.upload_triton(
                    torch.empty(n, dtype=torch.int64, device=self.pool.device),
                    torch.zeros(n, dtype=torch.int64, pin_memory=True),
                )
            torch.cuda.synchronize(self.pool.device)  # the pinned sources may be reused once freed
        except Exception as exc:  # any Triton failure here: the DMA still works
            warnings.warn(f"metadata uploads stay DMAs (the upload kernel failed: {exc})", stacklevel=3)
            return False
        return True

    def close(self) -> None:
        """Wait for the runner's work, drop its graphs and hand its streams on to the next
        runner (a forward after this raises)."""
        if self.closed:
            return
        self.closed = True
        if self._side is not None:
            self._side.synchronize()
            self._capture_stream.synchronize()
        self.graphs_enabled = False
        self._graphs.clear()  # NOTE: first: no graph captured on the streams outlives this
        streams = {"side": self._side, "capture": self._capture_stream, "issue": self._issue, "signals": self._fill}
        for role, stream in streams.items():
            if isinstance(stream, torch.cuda.ExternalStream):
                _SPARE_STREAMS.setdefault((stream.device_index, role), []).append(stream)

    @property
    def layered_busy(self) -> bool:
        """A layered forward is still running on the device (the layer events are shared:
        start the next layered restore only when this is False)."""
        return self._layered_done is not None and not self._layered_done.query()

    def wait_layered(self) -> None:
        """Block the host until the layered forwards launched so far have finished."""
        if self._layered_done is not None:
            self._layered_done.synchronize()

    def mark(self) -> Any:
        """Mark the caller's stream now, for :meth:`after` (None on CPU)."""
        if self._mark is None:
            return None
        self._mark.record(torch.cuda.current_stream(self.pool.device))
        return self._mark

    @contextlib.contextmanager
    def after(self, mark: Any) -> Iterator[None]:
        """Inside the block the current stream is one that waits only for ``mark`` (a
        :meth:`mark` of the caller's stream), not for what the caller queued since: work
        that waits for "the caller's stream" there (a transfer at issue, a layered forward)
        waits for the mark only. With ``mark`` None: the caller's stream, unchanged.

        NOTE: the engine marks before launching a decode batch and starts restores after the
        launch inside this block, so their copies and layered forwards run beside the batch
        instead of queuing behind it. Safe because the batch reads and writes only pages of
        the requests it decodes, which are pinned: a restore's pages are never among them."""
        if mark is None or self._issue is None:
            yield
            return
        self._issue.wait_event(mark)
        self._caller = torch.cuda.current_stream(self.pool.device)
        try:
            with torch.cuda.stream(self._issue):
                yield
        finally:
            self._caller = None

    def join_layered(self) -> None:
        """Order the caller's stream after every layered forward launched so far (before it
        reads their outputs or pages, or hands their pages to someone else)."""
        if self._side is not None:
            torch.cuda.current_stream(self.pool.device).wait_stream(self._side)
            if self._caller is not None:  # inside after(): the pages' next users run there too
                self._caller.wait_stream(self._side)

    @property
    def graphs_captured(self) -> int:
        """CUDA graphs captured so far (at most ``max_graphs``)."""
        return sum(g.graph is not None for g in self._graphs.values())

    def slots(self, pages: Sequence[int], start: int, end: int) -> torch.Tensor:
        """Flat slots (CPU, int64) of tokens ``[start, end)`` of a sequence whose pages are
        ``pages``."""
        ps = self.page_size
        first, last = start // ps, -(-end // ps)
        if last > len(pages):
            raise ConfigError(f"tokens [{start}, {end}) need {last} pages, the sequence has {len(pages)}")
        base = torch.as_tensor(pages[first:last], dtype=torch.int64).view(-1, 1) * ps
        flat = (base + torch.arange(ps).view(1, -1)).view(-1)
        return flat[start - first * ps : end - first * ps]

    @torch.inference_mode()
    def forward(
        self,
        seqs: Sequence[tuple[Sequence[int], Sequence[int], int]],
        *,
        layered: bool = False,
        into: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """``seqs``: ``(new_tokens, pages, cached_len)`` each; all in one batch must have the
        same number of new tokens (prefill batches, or decode batches of one token each).
        ``pages`` cover ``[0, cached_len + len(new_tokens))``. Returns ``[B, vocab]``.
        ``layered``: the cached pages are still landing; each layer's attention first waits
        on ``layer_events[l]``, which the transfer records once layer ``l`` has landed (on CPU
        the events are empty: an ordinary forward); the logits are not ready until
        :meth:`join_layered`. ``into`` (from :meth:`replay_target`): where a graph replay puts
        its logits, so the forward allocates nothing. Raises ConfigError, before anything
        runs, for a page it would touch that is not an int in the pool, a new token that is
        not an int in ``[0, vocab)``, or a cached length that is not an int >= 0 (numpy ints
        and 0-d integer tensors are ints)."""
        if self.closed:
            raise MisuseError("forward on a closed model runner")
        with contextlib.nullcontext() if self._backends is None else sdpa_kernel(self._backends):
            if not layered or self._side is None:
                logits = self._forward(seqs, False, into)
                if layered and self.signals is not None:  # the consumer's steps, in order (CPU: tests)
                    self.signals.wait_all(self._side)
                    self.signals.reset(self._side)
                return logits
            self._side.wait_stream(torch.cuda.current_stream(self.pool.device))  # pages' previous users
            with torch.cuda.stream(self._side):
                logits = self._forward(seqs, True, into)
                if self.signals is not None:
                    self.signals.reset(self._side)  # the consumer's last step (signals module)
                self._layered_done.record()
            return logits

    def fill_signals(self) -> None:
        """Record, on a stream of their own, the round's signals its producer did not (it is
        done: its H2D queued or failed). Before a forward that may wait on the host for the
        GPU (a capture, an eager forward) is launched over a failed H2D, and at the round's end."""
        if self.signals is not None:
            self.signals.fill(self._fill)

    def end_round(self, *, consumed: bool) -> None:
        """After a round's producer is done (its H2D queued, or failed): record the signals
        it did not, on a stream of their own (one nothing waits behind, so they land even
        when the caller's stream waits for a forward that waits for them), and unless a
        layered forward was launched to consume the round (``consumed``), consume it here:
        on the side stream, after any forward there, wait for every group, zero the flags
        (:mod:`hicache.engine.signals`)."""
        if self.signals is None:
            return
        self.fill_signals()
        if not consumed:
            self.signals.wait_all(self._side)
            self.signals.reset(self._side)
            if self._layered_done is not None:
                self._layered_done.record(self._side)

    def _key(self, b: int, q: int, ctx: int, layered: bool) -> tuple[int, int, int, bool]:
        """The graph of ``b`` sequences of ``q`` new tokens over contexts of up to ``ctx``."""
        return (b, q, -(-ctx // self.graph_bucket) * self.graph_bucket, layered)

    def _captured(self, seqs: Sequence[tuple[Sequence[int], Sequence[int], int]], layered: bool) -> _Graph | None:
        """The captured graph :meth:`forward` of ``seqs`` would replay, if any."""
        if not seqs or not self.graphs_enabled or not seqs[0][0]:
            return None
        q = len(seqs[0][0])
        if len(seqs) * q > self.graph_tokens or all(cached == 0 for _, _, cached in seqs):
            return None
        graph = self._graphs.get(self._key(len(seqs), q, max(c for _, _, c in seqs) + q, layered))
        return graph if graph is not None and graph.graph is not None else None

    def replays(self, seqs: Sequence[tuple[Sequence[int], Sequence[int], int]], *, layered: bool = False) -> bool:
        """Whether :meth:`forward` of ``seqs`` would replay a graph already captured: no
        capture (which synchronizes the device) and no eager forward (whose allocations may),
        so nothing in it waits on the host for the GPU. A layered forward launched before its
        copies are queued must be such a one: a host wait there would wait for copies not
        yet queued."""
        return self._captured(seqs, layered) is not None

    def replay_target(
        self, seqs: Sequence[tuple[Sequence[int], Sequence[int], int]], *, layered: bool = False
    ) -> torch.Tensor | None:
        """If :meth:`forward` of ``seqs`` would replay a captured graph (:meth:`replays`), a
        new tensor for its logits (``forward(..., into=)``), else None. Allocated before the
        copies it waits for are queued: an allocation may free cached memory, which
        synchronizes the device."""
        graph = self._captured(seqs, layered)
        if graph is None or graph.out is None:
            return None
        return torch.empty_like(graph.out)

    def _forward(
        self, seqs: Sequence[tuple[Sequence[int], Sequence[int], int]], layered: bool, into: torch.Tensor | None = None
    ) -> torch.Tensor:
        if not seqs:
            raise ConfigError("forward needs at least one sequence")
        self.captured_last = False
        q = len(seqs[0][0])
        if q == 0 or any(len(s[0]) != q for s in seqs):
            raise ConfigError("a batch needs the same, non-zero number of new tokens per sequence")
        seqs = self._check_cached(seqs)  # cached lengths as Python ints from here on
        ctx = [cached + q for _, _, cached in seqs]
        b = len(seqs)
        self._check_pages(seqs, ctx)
        tokens = self._token_ids(seqs, b, q)
        used = self._used_pages(seqs, ctx)  # NOTE: before anything runs, on every path
        short = b * q <= self.graph_tokens
        key = self._key(b, q, max(ctx), layered)
        fresh = all(cached == 0 for _, _, cached in seqs)  # a fresh prefill: no context to read
        if not fresh and self.graphs_enabled and short and self._staged_inputs:
            # NOTE: the common case (decode steps, restored tails) builds its inputs straight
            # into the pinned staging buffer: a layered forward's launch is on its restore's
            # critical path, and a dozen small torch ops cost more host time than the replay.
            graph = self._graph(*key)
            if graph is not None:
                fill = functools.partial(_graph_inputs, tokens, used, ctx, graph.t, self.page_size)
                self._upload_flat(graph.flat, fill)
                logits = self._replay(graph, into)
                if logits is not None:
                    return logits
        ids = torch.from_numpy(tokens)
        pos = torch.stack([torch.arange(c - q, c) for c in ctx])
        write = torch.stack([self.slots(p, c - q, c) for (_, p, _), c in zip(seqs, ctx, strict=True)])
        if fresh:
            as_tail = self.graph_short_prefills and short
            if as_tail and self.graphs_enabled and key not in self._graphs:
                as_tail = len(self._fresh_keys) < self.max_graphs // 4  # room for a new length
                if as_tail:
                    self._fresh_keys.add(key)
            if not as_tail:
                self.eager_forwards += 1
                ids_d, pos_d, write_d = self._upload(None, ids, pos, write, fresh=layered)
                return _logits(self.net, ids_d, pos_d, PagedBatch(self.pool, write_d, None, None))
        graph = None
        if self.graphs_enabled and short:
            graph = self._graph(*key)
        t = graph.t if graph is not None else max(ctx)
        read = torch.empty(b, t, dtype=torch.int64)
        for i, ((_, pages, _), c) in enumerate(zip(seqs, ctx, strict=True)):
            read[i, :c] = self.slots(pages, 0, c)
            read[i, c:] = write[i, -1]  # padding reads a slot the sequence just wrote (never NaN)
        ctx_t = torch.tensor(ctx, dtype=torch.int64)
        if graph is not None:
            self._upload(graph.flat, ids, pos, write, read, ctx_t)
            logits = self._replay(graph, into)
            if logits is not None:
                return logits
        self.eager_forwards += 1
        ids_d, pos_d, write_d, read_d, ctx_d = self._upload(None, ids, pos, write, read, ctx_t, fresh=layered)
        batch = self.batch(write_d, read_d, ctx_d, unpadded_decode=q == 1 and min(ctx) == t, layered=layered)
        return _logits(self.net, ids_d, pos_d, batch)

    def _replay(self, graph: _Graph, into: torch.Tensor | None) -> torch.Tensor | None:
        """Replay ``graph`` (capturing it first if needed) on the inputs in its ``flat``; its
        logits, or None where the capture failed (graphs are off from then on: the caller
        runs eagerly)."""
        self.captured_last = graph.graph is None
        try:
            logits = graph.run(into if graph.graph is not None else None)
            self.graph_replays += 1
            return logits
        except RuntimeError as exc:  # a capture transformers' code does not allow
            if graph.graph is not None:
                raise
            warnings.warn(f"CUDA graph capture failed, running eagerly from now on: {exc}", stacklevel=3)
            self.graphs_enabled = False
            self._graphs.clear()
            return None

    def _check_cached(
        self, seqs: Sequence[tuple[Sequence[int], Sequence[int], int]]
    ) -> list[tuple[Sequence[int], Sequence[int], int]]:
        """``seqs`` with each cached length as a Python int (a numpy int or a 0-d integer
        tensor would otherwise key a new graph per call, or wrap); ConfigError where one is
        not an int >= 0."""
        out = []
        for tokens, pages, cached in seqs:
            n = _index(cached)
            if n is None or n < 0:
                raise ConfigError(f"a cached length must be an int >= 0, got {cached!r}")
            out.append((tokens, pages, n))
        return out

    def _token_ids(self, seqs: Sequence[tuple[Sequence[int], Sequence[int], int]], b: int, q: int) -> np.ndarray:
        """The new tokens as an int64 ``[b, q]`` array; ConfigError where one is not an int
        in ``[0, vocab)`` (a float would be truncated, an id past the vocabulary is a
        device-side assert on the GPU)."""
        try:
            arr = np.asarray([list(s[0]) for s in seqs])
        except (TypeError, ValueError, OverflowError) as exc:
            raise ConfigError(f"new tokens must be ints: {exc}") from None
        if arr.shape != (b, q) or arr.dtype.kind not in "iu":
            flat = [t for s in seqs for t in s[0]]
            ints = [_index(t) for t in flat]
            if None in ints:
                bad = flat[ints.index(None)]
                bad = bad.item() if isinstance(bad, np.generic) else bad
                raise ConfigError(f"new tokens must be ints, got {bad!r}")
            arr = np.asarray(ints, dtype=object).reshape(b, q)
        vocab = int(getattr(getattr(self.net, "config", None), "vocab_size", 0) or 0)
        if arr.size and (arr.min() < 0 or (vocab and arr.max() >= vocab)):
            bad = next(int(t) for t in arr.reshape(-1) if t < 0 or (vocab and t >= vocab))
            raise ConfigError(f"token {bad} is not in the vocabulary's [0, {vocab})")
        return arr.astype(np.int64)

    def _used_pages(
        self, seqs: Sequence[tuple[Sequence[int], Sequence[int], int]], ctx: Sequence[int]
    ) -> list[np.ndarray]:
        """Each sequence's pages that hold its context, as int64 arrays; ConfigError, naming
        the page, where one is not an int in the pool: a page out of range would be read and
        written outside the pool on the GPU, a float one truncated (NaN to page 0).
        NOTE: one vectorized range check for the batch: this is every decode step's path."""
        ps, top = self.page_size, self.pool.num_pages
        used = []
        for (_, pages, _), c in zip(seqs, ctx, strict=True):
            part = pages[: -(-c // ps)]
            try:
                arr = np.asarray(part)
            except (TypeError, ValueError, OverflowError):
                arr = np.asarray([], dtype=object)
            if arr.dtype.kind not in "iu" or arr.shape != (len(part),):  # floats, bools, ints past int64
                ints = [_index(p) for p in part]
                bad = next((p for p, i in zip(part, ints, strict=True) if i is None or not 0 <= i < top), None)
                if bad is not None:
                    bad = bad.item() if isinstance(bad, np.generic) else bad
                    raise ConfigError(f"page {bad!r} is not an int in the pool's [0, {top})")
                arr = np.asarray(ints, dtype=np.int64)
            elif arr.dtype.kind == "u":
                if arr.size and arr.max() >= top:
                    raise ConfigError(f"page {int(arr.max())} is not in the pool's [0, {top})")
                arr = arr.astype(np.int64)
            used.append(arr.astype(np.int64, copy=False))
        flat = used[0] if len(used) == 1 else np.concatenate(used)
        if flat.size and (flat.min() < 0 or flat.max() >= top):
            bad = next(int(p) for p in flat if not 0 <= p < top)
            raise ConfigError(f"page {bad} is not in the pool's [0, {top})")
        return used

    def _check_pages(self, seqs: Sequence[tuple[Sequence[int], Sequence[int], int]], ctx: Sequence[int]) -> None:
        """The error :meth:`slots` raises where a sequence has too few pages for its tokens."""
        ps, q = self.page_size, len(seqs[0][0])
        for (_, pages, _), c in zip(seqs, ctx, strict=True):
            if -(-c // ps) > len(pages):
                raise ConfigError(f"tokens [{c - q}, {c}) need {-(-c // ps)} pages, the sequence has {len(pages)}")

    def batch(
        self,
        write: torch.Tensor,
        read: torch.Tensor,
        ctx: torch.Tensor,
        *,
        unpadded_decode: bool = False,
        layered: bool = False,
    ) -> PagedBatch:
        """Metadata of a forward over cached context (device tensors). The mask is made only
        for the SDPA paths, and not for one-token decode without padding (a captured graph
        passes ``unpadded_decode=False``: it makes the mask from ``ctx`` on every replay)."""
        q = write.shape[1]
        if (self.attention == "paged" and q <= paged.MAX_QUERY_TOKENS) or unpadded_decode:
            mask = None
        else:
            mask = visible(ctx, q, read.shape[1])
        ready = self.layer_events if layered and self.layer_events else None
        return PagedBatch(self.pool, write, read, mask, self.attention, ctx, layer_ready=ready)

    def _upload_flat(self, dst: torch.Tensor, fill: Any) -> None:
        """``fill(host)`` writes ``dst.numel()`` int64 values into ``host`` (a numpy view of a
        pinned staging buffer), which then go to ``dst`` as :meth:`_upload` sends its parts."""
        n = dst.numel()
        k, self._turn = self._turn, self._turn ^ 1
        self._copied[k].synchronize()  # this buffer's last upload has read it
        host = self._hosts[k]
        if host is None or host.numel() < n:
            host = self._hosts[k] = torch.empty(max(n, 1 << 16), dtype=torch.int64, pin_memory=self._pinned)
        fill(host.numpy()[:n])
        if self._upload_kernel:  # not a DMA: see kernels.upload_triton (checked in _warm_upload)
            kernels.upload_unchecked(dst, host[:n])
        else:
            dst.copy_(host[:n], non_blocking=True)
        self._copied[k].record()

    def _upload(self, dst: torch.Tensor | None, *parts: torch.Tensor, fresh: bool = False) -> list[torch.Tensor]:
        """Copy ``parts`` (CPU int64) to the device in one transfer through a reused pinned
        buffer (a copy from pageable memory would make the host wait for the GPU's queue);
        returns device views shaped like ``parts``, backed by ``dst`` when given, else by a
        reused device buffer, or with ``fresh`` by a new one.

        NOTE: an eager layered forward passes ``fresh``: it runs on its own stream for as
        long as its restore lands, and a forward on the caller's stream meanwhile would
        overwrite the reused buffer under it."""
        flat = torch.cat([p.reshape(-1) for p in parts])
        n = flat.numel()
        if self.pool.device.type != "cuda":
            dev = flat if dst is None else dst[:n].copy_(flat)
        else:
            k, self._turn = self._turn, self._turn ^ 1
            self._copied[k].synchronize()  # this buffer's last upload has read it
            host = self._hosts[k]
            if host is None or host.numel() < n:
                host = self._hosts[k] = torch.empty(max(n, 1 << 16), dtype=torch.int64, pin_memory=True)
            host[:n].copy_(flat)
            if dst is not None:
                target = dst
            elif fresh:
                target = torch.empty(n, dtype=torch.int64, device=self.pool.device)
            else:
                # NOTE: grown only here, on the caller's stream that reads it: grown under the
                # side stream, its memory would go back to that stream's pool unrecorded.
                if self._dev is None or self._dev.numel() < n:
                    self._dev = torch.empty(host.numel(), dtype=torch.int64, device=self.pool.device)
                target = self._dev
            dev = target[:n]
            if self._upload_kernel:  # not a DMA: see kernels.upload_triton (checked in _warm_upload)
                kernels.upload_unchecked(dev, host[:n])
            else:
                dev.copy_(host[:n], non_blocking=True)
            self._copied[k].record()
        out, at = [], 0
        for p in parts:
            out.append(dev[at : at + p.numel()].view(p.shape))
            at += p.numel()
        return out

    def _graph(self, b: int, q: int, t: int, layered: bool) -> _Graph | None:
        key = (b, q, t, layered)
        graph = self._graphs.get(key)
        if graph is None and len(self._graphs) < self.max_graphs:
            # NOTE: layered graphs replay on their own stream, concurrently with the others:
            # they must not share intermediate buffers (a graph pool assumes one at a time).
            if layered and self._layered_mempool is None:
                self._layered_mempool = torch.cuda.graph_pool_handle()
            elif not layered and self._mempool is None:
                self._mempool = torch.cuda.graph_pool_handle()
            graph = self._graphs[key] = _Graph(self, b, q, t, layered)
        return graph


_SPARE_STREAMS: dict[tuple[int, str], list[Any]] = {}  # by device index and role: streams of closed runners


def _own_stream(device: torch.device, role: str, priority: int) -> Any:
    """A stream no other open runner uses (the cuBLAS workspace: see ModelRunner.__init__):
    a closed runner's in the same ``role``, or a new one (``dma.new_stream``); without
    cuda-python one of torch's pooled streams (``priority`` picks the pool)."""
    index = device.index if device.index is not None else torch.cuda.current_device()
    spare = _SPARE_STREAMS.get((index, role))
    if spare:
        return spare.pop()
    return dma.new_stream(torch.device("cuda", index)) or torch.cuda.Stream(device, priority=priority)  # type: ignore[no-untyped-call]


def _logits(net: torch.nn.Module, ids: torch.Tensor, pos: torch.Tensor, batch: PagedBatch) -> torch.Tensor:
    out = net(input_ids=ids, position_ids=pos, use_cache=False, hicache_batch=batch, logits_to_keep=1)
    logits: torch.Tensor = out.logits[:, -1]
    return logits


def _index(x: object) -> int | None:
    """``x`` as a Python int where it is an integer (int, numpy integer, 0-d integer
    tensor), else None (bools, floats, anything else)."""
    if isinstance(x, (bool, np.bool_)) or (isinstance(x, torch.Tensor) and x.dtype == torch.bool):
        return None
    try:
        return int(operator.index(x))  # type: ignore[arg-type]
    except TypeError:
        return None


def _graph_inputs(
    tokens: np.ndarray[Any, Any],
    pages: Sequence[np.ndarray[Any, Any]],
    ctx: Sequence[int],
    t: int,
    page_size: int,
    out: np.ndarray[Any, Any],
) -> None:
    """A graph's flat inputs into ``out``: ids ``[b, q]`` (``tokens``, integers), positions
    ``[b, q]``, write slots ``[b, q]``, read slots ``[b, t]`` (padded with the slot of the last
    token, which the forward has just written: never NaN) and context lengths ``[b]``
    (:class:`_Graph`); ``pages``: each sequence's pages that hold its context (int64)."""
    b, q = tokens.shape
    ids, pos, write, read, lens = np.split(out, np.cumsum([b * q, b * q, b * q, b * t]))
    ids, pos, write, read = ids.reshape(b, q), pos.reshape(b, q), write.reshape(b, q), read.reshape(b, t)
    offsets = np.arange(page_size, dtype=np.int64)
    ids[:] = tokens
    for i, (used, c) in enumerate(zip(pages, ctx, strict=True)):
        slots = (used[:, None] * page_size + offsets).reshape(-1)
        pos[i] = np.arange(c - q, c, dtype=np.int64)
        write[i] = slots[c - q : c]
        read[i, :c] = slots[:c]
        read[i, c:] = slots[c - 1]
    lens[:] = ctx


class _Graph:
    """One captured forward for ``b`` sequences of ``q`` new tokens over contexts padded to
    ``t``, its inputs in one flat device tensor (ids, positions, write slots, read slots,
    context lengths). Captured on first use with that call's real inputs: the warm-up writes
    the same K/V the replay writes, so no page is disturbed."""

    def __init__(self, runner: ModelRunner, b: int, q: int, t: int, layered: bool = False) -> None:
        self.net, self.q, self.t, self.layered = runner.net, q, t, layered
        self.mempool = runner._layered_mempool if layered else runner._mempool
        self.runner, self.pool, self.backends = runner, runner.pool, runner._capture_backends
        self.flat = torch.zeros(3 * b * q + b * t + b, dtype=torch.int64, device=self.pool.device)
        sizes = [b * q, b * q, b * q, b * t, b]
        ids, pos, write, read, ctx = torch.split(self.flat, sizes)
        self.ids, self.pos, self.write = ids.view(b, q), pos.view(b, q), write.view(b, q)
        self.read, self.ctx = read.view(b, t), ctx
        self.graph: torch.cuda.CUDAGraph | None = None
        self.out: torch.Tensor | None = None

    def _body(self) -> torch.Tensor:
        batch = self.runner.batch(self.write, self.read, self.ctx, layered=self.layered)
        return _logits(self.net, self.ids, self.pos, batch)

    def run(self, into: torch.Tensor | None = None) -> torch.Tensor:
        """Replay (capturing first if needed) on the inputs already in ``flat``; the logits
        copied out of the graph's buffer into ``into`` if given, else into a new tensor."""
        if self.graph is None:
            with contextlib.nullcontext() if self.backends is None else sdpa_kernel(self.backends):
                self._capture()
        assert self.graph is not None and self.out is not None
        self.graph.replay()
        return self.out.clone() if into is None else into.copy_(self.out)

    def _capture(self) -> None:
        # NOTE: on the runner's own streams, never torch's default capture stream (the
        # cuBLAS workspace: see ModelRunner.__init__); the warm-up runs there too, so no other
        # stream touches that workspace.
        on = self.runner._side if self.layered else self.runner._capture_stream
        caller = torch.cuda.current_stream()
        on.wait_stream(caller)
        with torch.cuda.stream(on):
            self._body()  # warm-up: lazy initialisation stays out of the graph
        caller.wait_stream(on)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self.mempool, stream=on):
            self.out = self._body()
        self.graph = graph
