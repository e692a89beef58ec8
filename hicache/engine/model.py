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

from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

from hicache.backends.pools import DevicePool
from hicache.core.geometry import KVGeometry
from hicache.errors import ConfigError

ATTENTION = "hicache_paged"

_TINY: dict[str, Any] = dict(
    vocab_size=512,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    max_position_embeddings=8192,
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
class SeqBatch:
    """One sequence's part of a forward: the slots its new tokens go to, and the slots of
    its whole context (cached prefix + new tokens), in token order."""

    write_slots: torch.Tensor  # int64 [q]
    read_slots: torch.Tensor  # int64 [T], T >= q; the last q are write_slots


@dataclass
class PagedBatch:
    pool: DevicePool
    seqs: list[SeqBatch]


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
    and ``value`` ``[B, H, q, D]`` for the new tokens only (RoPE applied)."""
    batch: PagedBatch | None = kwargs.get("hicache_batch")
    if batch is None:
        raise ConfigError("paged_attention needs the hicache_batch keyword (use hicache.engine.ModelRunner)")
    layer_idx: Any = module.layer_idx
    layer = int(layer_idx)
    buf = batch.pool.buffer
    heads, dim = buf.shape[-2], buf.shape[-1]
    k_pool = buf[0, layer].view(-1, heads, dim)
    v_pool = buf[1, layer].view(-1, heads, dim)
    outs = []
    for b, seq in enumerate(batch.seqs):
        q = seq.write_slots.numel()
        k_pool[seq.write_slots] = key[b, :, :q].transpose(0, 1).to(buf.dtype)
        v_pool[seq.write_slots] = value[b, :, :q].transpose(0, 1).to(buf.dtype)
        k = k_pool[seq.read_slots].transpose(0, 1).unsqueeze(0).to(query.dtype)
        v = v_pool[seq.read_slots].transpose(0, 1).unsqueeze(0).to(query.dtype)
        t = seq.read_slots.numel()
        mask = None
        if q > 1:  # query i sits at position t - q + i and sees keys 0 .. t - q + i
            rows = torch.arange(q, device=query.device).unsqueeze(1) + (t - q)
            mask = torch.arange(t, device=query.device).unsqueeze(0) <= rows
        outs.append(
            F.scaled_dot_product_attention(
                query[b : b + 1, :, :q], k, v, attn_mask=mask, scale=scaling, enable_gqa=True
            )
        )
    return torch.cat(outs, 0).transpose(1, 2).contiguous(), None


def _register() -> None:
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface

    AttentionInterface.register(ATTENTION, paged_attention)
    AttentionMaskInterface.register(ATTENTION, lambda *args, **kwargs: None)  # we mask ourselves


def build_model(
    model: str, *, device: str | torch.device = "cpu", dtype: torch.dtype = torch.float32, seed: int = 0
) -> torch.nn.Module:
    """A preset name (random weights, fixed seed) or a local checkpoint directory. Nothing
    is downloaded."""
    from transformers import AutoConfig, AutoModelForCausalLM

    _register()
    if model in PRESETS:
        spec = dict(PRESETS[model])
        config = AutoConfig.for_model(spec.pop("model_type"), **spec)
        config._attn_implementation = ATTENTION
        torch.manual_seed(seed)
        with torch.device(device):
            net = AutoModelForCausalLM.from_config(config, dtype=dtype, attn_implementation=ATTENTION)
    elif Path(model).is_dir():
        net = AutoModelForCausalLM.from_pretrained(
            model, dtype=dtype, attn_implementation=ATTENTION, local_files_only=True
        ).to(device)
    else:
        raise ConfigError(f"model must be one of {sorted(PRESETS)} or a local checkpoint directory, got {model!r}")
    result: torch.nn.Module = net.eval()
    return result


def kv_geometry(net: torch.nn.Module, page_size: int) -> KVGeometry:
    """The KV geometry of ``net``'s attention (MHA/GQA) at ``page_size`` tokens per page."""
    cfg: Any = net.config
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    dtype = next(net.parameters()).dtype
    return KVGeometry(int(cfg.num_hidden_layers), int(cfg.num_key_value_heads), int(head_dim), page_size, dtype)


class ModelRunner:
    """Forward passes of ``net`` whose KV lives in ``pool``; returns last-token logits."""

    def __init__(self, net: torch.nn.Module, pool: DevicePool) -> None:
        self.net = net
        self.pool = pool
        self.page_size = pool.geometry.page_size

    def slots(self, pages: Sequence[int], start: int, end: int) -> torch.Tensor:
        """Flat slots of tokens ``[start, end)`` of a sequence whose pages are ``pages``."""
        ps = self.page_size
        tok = torch.arange(start, end)
        page_ids = torch.tensor(pages, dtype=torch.int64)[tok // ps]
        return (page_ids * ps + tok % ps).to(self.pool.device)

    @torch.inference_mode()
    def forward(self, seqs: Sequence[tuple[list[int], Sequence[int], int]]) -> torch.Tensor:
        """``seqs``: ``(new_tokens, pages, cached_len)`` each; all in one batch must have the
        same number of new tokens (prefill batches of one, or decode batches of 1 token).
        ``pages`` cover ``[0, cached_len + len(new_tokens))``."""
        q = len(seqs[0][0])
        if any(len(s[0]) != q for s in seqs):
            raise ConfigError("a batch needs the same number of new tokens per sequence")
        dev = self.pool.device
        batch = PagedBatch(self.pool, [])
        ids, pos = [], []
        for tokens, pages, cached in seqs:
            end = cached + len(tokens)
            batch.seqs.append(SeqBatch(self.slots(pages, cached, end), self.slots(pages, 0, end)))
            ids.append(tokens)
            pos.append(list(range(cached, end)))
        out = self.net(
            input_ids=torch.tensor(ids, device=dev),
            position_ids=torch.tensor(pos, device=dev),
            use_cache=False,
            hicache_batch=batch,
            logits_to_keep=1,
        )
        logits: torch.Tensor = out.logits[:, -1]
        return logits
