"""Engine flags in the seed's spirit, shared by ``python -m hicache.engine`` and the
benchmarks. hicache is opt-in (``--enable-hicache``); tier sizes are given as a ratio of L1
(``--hicache-ratio``, ``--hicache-storage-ratio``) or in GiB (``--hicache-size``,
``--hicache-storage-size``, which win)."""

from __future__ import annotations

import argparse
from typing import Any

import torch

from hicache.core.cost import CostPriors
from hicache.engine.engine import Engine
from hicache.engine.model import PRESETS, build_model, kv_geometry
from hicache.errors import ConfigError

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def add_engine_args(ap: argparse.ArgumentParser) -> None:
    cuda = torch.cuda.is_available()
    g = ap.add_argument_group("engine")
    g.add_argument(
        "--model", default="qwen3-8b" if cuda else "tiny", help=f"{sorted(PRESETS)} or a local checkpoint dir"
    )
    g.add_argument("--device", default="cuda" if cuda else "cpu")
    g.add_argument("--dtype", choices=["auto", *DTYPES], default="auto", help="auto: bfloat16 on CUDA, else float32")
    g.add_argument("--page-size", type=int, default=16)
    g.add_argument("--num-pages", type=int, default=4096, help="L1 pages (the GPU page pool)")
    g.add_argument("--max-batch", type=int, default=32, help="requests running at once")
    g.add_argument("--disable-cuda-graph", action="store_true", help="run small batches eagerly too")
    g.add_argument(
        "--cuda-graph-short-prefills",
        choices=["auto", "on", "off"],
        nargs="?",
        const="on",
        default="auto",
        help="prefills without cached context of at most 64 tokens replay CUDA graphs too; "
        "auto (default): whenever CUDA graphs are on; off: they run eagerly",
    )
    g.add_argument(
        "--attention",
        choices=["auto", "paged", "gqa", "fold"],
        default="auto",
        help="attention over cached context: paged (Triton split-K kernel reading the pool, for <= 64 new "
        "tokens), gqa (SDPA with enable_gqa), fold (query groups folded into plain SDPA); auto: paged on CUDA",
    )
    g.add_argument(
        "--attention-cudnn",
        choices=["off", "graphs", "on"],
        default="off",
        help="cuDNN's SDPA backend: off (it holds memory per shape), only in CUDA-graph captures, or on",
    )
    h = ap.add_argument_group("hicache")
    h.add_argument("--enable-hicache", action="store_true", help="L2/L3 behind the L1 prefix cache")
    h.add_argument("--hicache-ratio", type=float, default=2.0, help="L2 pages per L1 page")
    h.add_argument("--hicache-size", type=float, default=None, help="L2 size in GiB (overrides the ratio)")
    h.add_argument("--hicache-storage-ratio", type=float, default=0.0, help="L3 pages per L1 page (0: no L3)")
    h.add_argument("--hicache-storage-size", type=float, default=None, help="L3 size in GiB (overrides the ratio)")
    h.add_argument("--hicache-storage-path", default=None, help="L3 file (default: an unnamed temporary file)")
    h.add_argument("--hicache-storage-direct", action="store_true", help="O_DIRECT L3 I/O (bypass the page cache)")
    h.add_argument("--hicache-transfer-backend", choices=["auto", "triton", "torch"], default="auto")
    h.add_argument("--hicache-policy", choices=["cost", "always", "never"], default="cost")
    h.add_argument(
        "--hicache-write-policy",
        choices=["write_through", "write_through_selective", "write_back"],
        default="write_through",
    )
    h.add_argument("--hicache-verify-pages", action="store_true", help="digest-check every moved page (slow)")
    h.add_argument("--disable-hicache-prefetch", action="store_true", help="blocking restores (no overlap loop)")
    h.add_argument(
        "--hicache-layered-restore",
        choices=["auto", "on", "off"],
        default="auto",
        help="start an L2 restore's prefill at once, each layer waiting only for its own pages to land; "
        "auto (default): on with CUDA and cuda-python, off elsewhere and with --disable-hicache-prefetch",
    )
    d = CostPriors()
    h.add_argument("--hicache-prior-recompute-us", type=float, default=d.recompute_s_per_token * 1e6)
    h.add_argument("--hicache-prior-host-gib-s", type=float, default=d.host_gib_s)
    h.add_argument("--hicache-prior-storage-gib-s", type=float, default=d.storage_read_gib_s)
    h.add_argument(
        "--hicache-explore",
        type=int,
        default=d.explore,
        help="restores tried per source before the cost priors alone may rule it out (0: never)",
    )


def dtype_of(args: argparse.Namespace) -> torch.dtype:
    if args.dtype == "auto":
        return torch.bfloat16 if str(args.device).startswith("cuda") else torch.float32
    return DTYPES[args.dtype]


def pages_of(ratio: float, gib: float | None, l1_pages: int, bytes_per_page: int) -> int:
    if gib is not None:
        if gib < 0:
            raise ConfigError(f"a tier size must be >= 0 GiB, got {gib}")
        return int(gib * 2**30 // bytes_per_page)
    if ratio < 0:
        raise ConfigError(f"a tier ratio must be >= 0, got {ratio}")
    return int(ratio * l1_pages)


def engine_from_args(args: argparse.Namespace, net: torch.nn.Module | None = None, **overrides: Any) -> Engine:
    """An :class:`Engine` per the flags (``overrides`` win over them)."""
    dtype = dtype_of(args)
    if net is None:
        net = build_model(args.model, device=args.device, dtype=dtype)
    kw: dict[str, Any] = dict(
        device=args.device,
        dtype=dtype,
        page_size=args.page_size,
        num_pages=args.num_pages,
        max_batch=args.max_batch,
        cuda_graphs=not args.disable_cuda_graph,
        graph_short_prefills={"auto": None, "on": True, "off": False}[args.cuda_graph_short_prefills],
        attention=args.attention,
        cudnn=args.attention_cudnn,
        enable_hicache=args.enable_hicache,
        storage_path=args.hicache_storage_path,
        storage_direct=args.hicache_storage_direct,
        policy=args.hicache_policy,
        write_policy=args.hicache_write_policy,
        transfer_backend=args.hicache_transfer_backend,
        prefetch=not args.disable_hicache_prefetch,
        layered_restore={"auto": None, "on": True, "off": False}[args.hicache_layered_restore],
        verify_pages=args.hicache_verify_pages,
        priors=CostPriors(
            recompute_s_per_token=args.hicache_prior_recompute_us * 1e-6,
            host_gib_s=args.hicache_prior_host_gib_s,
            storage_read_gib_s=args.hicache_prior_storage_gib_s,
            explore=args.hicache_explore,
        ),
    )
    kw.update(overrides)
    if "l2_pages" not in kw or "l3_pages" not in kw:
        bpp = kv_geometry(net, kw["page_size"]).bytes_per_page
        kw.setdefault("l2_pages", pages_of(args.hicache_ratio, args.hicache_size, kw["num_pages"], bpp))
        kw.setdefault("l3_pages", pages_of(args.hicache_storage_ratio, args.hicache_storage_size, kw["num_pages"], bpp))
    return Engine(args.model, net=net, **kw)
