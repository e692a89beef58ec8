"""Engine flags, shared by ``python -m hicache.engine`` and the benchmarks.

hicache is opt-in (``--enable-hicache``); tier sizes are a ratio of L1 (``--hicache-ratio``,
``--hicache-storage-ratio``) or GiB (``--hicache-size``, ``--hicache-storage-size``, which
win). Flag names follow SGLang's where SGLang has the setting. :func:`engine_kwargs` is the
one place flags become Engine settings; a bad value raises :class:`FlagError`, whose
message is ``--flag VALUE: reason``.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from pathlib import Path
from typing import Any

import torch

from hicache.core.cost import CostPriors
from hicache.engine.engine import Engine, Output
from hicache.engine.model import PRESETS, build_model, is_checkpoint, kv_geometry
from hicache.errors import ConfigError, MisuseError
from hicache.flags import ArgParser as _ArgParser
from hicache.flags import FlagError, _show, int_between, nonneg_float, nonneg_int, positive_float, positive_int

PROG = "python -m hicache.engine"
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
STORAGE_BACKENDS = ("file", "dir", "mooncake")
# What --hicache-storage-backend-extra-config may hold for each backend, and their types:
# SGLang's Mooncake keys; the dir store's fsync (off: faster, a crash may lose recent pages).
EXTRA_CONFIG_KEYS: dict[str, tuple[type, ...]] = {
    "master_server_address": (str,),
    "metadata_server": (str,),
    "protocol": (str,),
    "local_hostname": (str,),
    "device_name": (str,),
    "global_segment_size": (int, str),
    "local_buffer_size": (int, str),
    "connect_timeout_s": (int, float),
}
DIR_EXTRA_CONFIG_KEYS: dict[str, tuple[type, ...]] = {"fsync": (bool,)}


def json_object(text: str) -> dict[str, Any]:
    try:
        value = json.loads(text)
    except json.JSONDecodeError as exc:
        raise argparse.ArgumentTypeError(f"{_show(text)}: not valid JSON ({exc.msg} at column {exc.colno})") from None
    if not isinstance(value, dict):
        raise argparse.ArgumentTypeError(f"{_show(text)}: must be a JSON object ({{...}})")
    keys = EXTRA_CONFIG_KEYS | DIR_EXTRA_CONFIG_KEYS
    for key, v in value.items():
        if key not in keys:
            known = f"mooncake: {', '.join(EXTRA_CONFIG_KEYS)}; dir: {', '.join(DIR_EXTRA_CONFIG_KEYS)}"
            raise argparse.ArgumentTypeError(f"{_show(text)}: unknown key {key!r} (known: {known})")
        kinds = keys[key]
        if not isinstance(v, kinds) or (isinstance(v, bool) and bool not in kinds):
            names = {str: "a string", int: "an integer", bool: "true or false"}
            want = "a number" if float in kinds else " or ".join(names[t] for t in kinds)
            raise argparse.ArgumentTypeError(f"{_show(text)}: {key} must be {want}, got {v!r}")
    return value


# -- the parser ----------------------------------------------------------------------------


class ArgParser(_ArgParser):
    """:class:`hicache.flags.ArgParser` named as the engine's command by default."""

    def __init__(self, prog: str = PROG, description: str | None = None) -> None:
        super().__init__(prog, description)


def add_engine_args(ap: argparse.ArgumentParser) -> None:
    cuda = torch.cuda.is_available()
    g = ap.add_argument_group("engine")
    presets = ", ".join(sorted(PRESETS))
    g.add_argument(
        "--model",
        default="qwen3-8b" if cuda else "tiny",
        help=f"a preset ({presets}; random weights, nothing is downloaded) or a local checkpoint directory",
    )
    g.add_argument("--device", default="cuda" if cuda else "cpu", help="torch device: cpu, cuda or cuda:N")
    g.add_argument("--dtype", choices=["auto", *DTYPES], default="auto", help="auto: bfloat16 on CUDA, else float32")
    g.add_argument("--page-size", type=int_between(1, 1 << 16), default=16, metavar="N", help="tokens per KV page")
    g.add_argument("--num-pages", type=positive_int, default=4096, help="L1 pages (the GPU page pool)")
    g.add_argument("--max-batch", type=positive_int, default=32, help="requests running at once")
    g.add_argument("--disable-cuda-graph", action="store_true", help="run small batches eagerly too (CUDA only)")
    g.add_argument(
        "--cuda-graph-short-prefills",
        choices=["auto", "on", "off"],
        nargs="?",
        const="on",
        default="auto",
        help="prefills without cached context of at most 64 tokens replay CUDA graphs too; "
        "auto: whenever CUDA graphs are on; off: they run eagerly (CUDA only)",
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
        help="cuDNN's SDPA backend: off (it holds host memory per shape), only inside CUDA-graph captures, "
        "or on (CUDA only)",
    )
    h = ap.add_argument_group("hicache")
    h.add_argument("--enable-hicache", action="store_true", help="L2 (host memory) and L3 (storage) behind L1")
    h.add_argument("--hicache-ratio", type=nonneg_float, default=2.0, help="L2 pages per L1 page")
    h.add_argument(
        "--hicache-size", type=nonneg_float, default=None, metavar="GIB", help="L2 size in GiB (overrides the ratio)"
    )
    h.add_argument("--hicache-storage-ratio", type=nonneg_float, default=0.0, help="L3 pages per L1 page (0: no L3)")
    h.add_argument(
        "--hicache-storage-size",
        type=nonneg_float,
        default=None,
        metavar="GIB",
        help="L3 size in GiB (overrides the ratio)",
    )
    h.add_argument(
        "--hicache-storage-backend",
        choices=STORAGE_BACKENDS,
        default="file",
        help="L3 store: file (one preallocated file), dir (a file per page under a directory), "
        "mooncake (a Mooncake store; see the extra config)",
    )
    h.add_argument(
        "--hicache-storage-backend-extra-config",
        type=json_object,
        default=None,
        metavar="JSON",
        help=f"a JSON object for the storage backend; mooncake keys: {', '.join(EXTRA_CONFIG_KEYS)}; "
        f"dir keys: {', '.join(DIR_EXTRA_CONFIG_KEYS)}",
    )
    h.add_argument(
        "--hicache-storage-path",
        default=None,
        help="L3 file (backend file; default: an unnamed temporary file) or directory (backend dir: required)",
    )
    h.add_argument(
        "--hicache-storage-direct", action="store_true", help="O_DIRECT L3 I/O, bypassing the page cache (file)"
    )
    h.add_argument(
        "--hicache-transfer-backend",
        choices=["auto", "triton", "torch"],
        default="auto",
        help="L1 <-> L2 copy kernels; auto: Triton where it runs",
    )
    h.add_argument(
        "--hicache-policy",
        choices=["cost", "always", "never"],
        default="cost",
        help="restore a longer L2/L3 hit: when the cost model says it beats recompute, always, or never",
    )
    h.add_argument(
        "--hicache-write-policy",
        choices=["write_through", "write_through_selective", "write_back"],
        default="write_through",
        help="when L1 pages are backed up to L2: at once, once matched in L1 twice (selective), or on eviction",
    )
    h.add_argument(
        "--hicache-verify-pages", action="store_true", help="digest-check every moved page (slow; for debugging)"
    )
    h.add_argument(
        "--disable-hicache-prefetch", action="store_true", help="blocking restores (no overlap with other work)"
    )
    h.add_argument(
        "--hicache-layered-restore",
        choices=["auto", "on", "off"],
        default="auto",
        help="start an L2 restore's prefill at once, each layer waiting only for its own pages (CUDA only); "
        "auto: on with CUDA and cuda-python",
    )
    d = CostPriors()
    h.add_argument(
        "--hicache-prior-recompute-us",
        type=positive_float,
        default=d.recompute_s_per_token * 1e6,
        help="cost policy: prior microseconds to recompute one token (learned as requests run)",
    )
    h.add_argument(
        "--hicache-prior-host-gib-s",
        type=positive_float,
        default=d.host_gib_s,
        help="cost policy: prior L2 -> L1 GiB/s",
    )
    h.add_argument(
        "--hicache-prior-storage-gib-s",
        type=positive_float,
        default=d.storage_read_gib_s,
        help="cost policy: prior L3 read GiB/s",
    )
    h.add_argument(
        "--hicache-explore",
        type=nonneg_int,
        default=d.explore,
        help="cost policy: restores tried per source before the priors alone may rule it out (0: never)",
    )


def dtype_of(args: argparse.Namespace) -> torch.dtype:
    if args.dtype == "auto":
        return torch.bfloat16 if str(args.device).startswith("cuda") else torch.float32
    return DTYPES[args.dtype]


def _tier_pages(args: argparse.Namespace, tier: str, l1_pages: int, bytes_per_page: int) -> tuple[int, str]:
    """Pages of L2 or L3 per the flags, and the flag that set it."""
    size_flag, ratio_flag = (
        ("hicache_size", "hicache_ratio") if tier == "L2" else ("hicache_storage_size", "hicache_storage_ratio")
    )
    gib = getattr(args, size_flag)
    if gib is not None:
        pages = int(gib * 2**30 // bytes_per_page)
        if gib > 0 and pages == 0:
            flag = "--" + size_flag.replace("_", "-")
            size = f"{bytes_per_page / 2**10:g} KiB" if bytes_per_page < 2**20 else f"{bytes_per_page / 2**20:g} MiB"
            raise FlagError(flag, gib, f"less than one {tier} page ({size})")
        return pages, size_flag
    ratio = getattr(args, ratio_flag)
    pages = int(ratio * l1_pages)
    if ratio > 0 and pages == 0:
        flag = "--" + ratio_flag.replace("_", "-")
        off = "; 0 turns L3 off" if tier == "L3" else ""
        raise FlagError(flag, ratio, f"less than one {tier} page ({l1_pages} L1 pages x {ratio:g}{off})")
    return pages, ratio_flag


def ineffective_flags(args: argparse.Namespace, given: set[str]) -> list[str]:
    """Warnings for flags written in ``given`` that change nothing with the other flags."""
    out: list[str] = []
    cpu = not str(args.device).startswith("cuda")
    flag = {d: "--" + d.replace("_", "-") for d in given}
    hicache = sorted(d for d in given if d.startswith("hicache_") or d == "disable_hicache_prefetch")
    if not args.enable_hicache:
        out += [f"{flag[d]} has no effect without --enable-hicache" for d in hicache]
    else:
        no_l3 = not l3_on(args)
        l3_flags = (
            "hicache_storage_path",
            "hicache_storage_direct",
            "hicache_storage_backend",
            "hicache_storage_backend_extra_config",
        )
        if no_l3:
            out += [
                f"{flag[d]} has no effect without --hicache-storage-size or --hicache-storage-ratio > 0"
                for d in l3_flags
                if d in given
            ]
        for size, ratio in (("hicache_size", "hicache_ratio"), ("hicache_storage_size", "hicache_storage_ratio")):
            if size in given and ratio in given:
                off = " (the size wins; 0: no L3)" if size == "hicache_storage_size" else " (the size wins)"
                out.append(f"{flag[ratio]} has no effect with {flag[size]}{off}")
        if not no_l3 and args.hicache_storage_backend == "file" and "hicache_storage_backend_extra_config" in given:
            out.append("--hicache-storage-backend-extra-config has no effect with --hicache-storage-backend file")
        if not no_l3 and args.hicache_storage_backend != "file" and "hicache_storage_direct" in given:
            out.append("--hicache-storage-direct has no effect without --hicache-storage-backend file")
        if not no_l3 and args.hicache_storage_backend == "mooncake" and "hicache_storage_path" in given:
            out.append("--hicache-storage-path has no effect with --hicache-storage-backend mooncake")
        if args.hicache_policy != "cost":
            out += [
                f"{flag[d]} has no effect without --hicache-policy cost"
                for d in hicache
                if d.startswith("hicache_prior_") or d == "hicache_explore"
            ]
        if cpu and args.hicache_layered_restore == "on" and not args.disable_hicache_prefetch:  # else refused
            out.append("--hicache-layered-restore on has no effect on CPU (it needs CUDA)")
    if cpu:
        out += [
            f"{flag[d]} has no effect on CPU"
            for d in ("disable_cuda_graph", "cuda_graph_short_prefills", "attention_cudnn")
            if d in given
        ]
    return out


def check_device(args: argparse.Namespace) -> None:
    """Raise :class:`FlagError` unless ``--device`` names a device this torch can use."""
    try:
        dev = torch.device(args.device)
    except (RuntimeError, ValueError):
        raise FlagError("--device", args.device, "not a torch device (cpu, cuda or cuda:N)") from None
    if dev.type not in ("cpu", "cuda"):
        raise FlagError("--device", args.device, "the engine runs on cpu or cuda")
    if dev.type == "cpu" and dev.index not in (None, 0):
        raise FlagError("--device", args.device, "the host is one device, cpu (or cpu:0)")
    if dev.type == "cuda":
        if not torch.cuda.is_available():
            why = "this torch has no CUDA support" if torch.version.cuda is None else "no CUDA device is visible"
            raise FlagError("--device", args.device, f"{why} (torch {torch.__version__}); use --device cpu")
        if dev.index is not None and dev.index >= torch.cuda.device_count():
            raise FlagError("--device", args.device, f"only {torch.cuda.device_count()} CUDA device(s) visible")


def l3_on(args: argparse.Namespace) -> bool:
    """Whether the flags give the engine an L3: hicache on, and a storage size above 0 or,
    without a size, a storage ratio above 0 (a size given wins, 0 included)."""
    size, ratio = args.hicache_storage_size, args.hicache_storage_ratio
    return bool(args.enable_hicache) and (size > 0 if size is not None else ratio > 0)


def check_flags(args: argparse.Namespace) -> None:
    """What can be judged from the flags alone, before a model is built."""
    check_device(args)
    if args.model not in PRESETS and not is_checkpoint(args.model):
        presets = ", ".join(sorted(PRESETS))
        raise FlagError("--model", args.model, f"not a preset ({presets}) nor a checkpoint directory (config.json)")
    path = args.hicache_storage_path
    if path == "":
        raise FlagError(
            "--hicache-storage-path", path, "an empty path (a directory for dir, a file for file; leave out: unnamed)"
        )
    l3 = l3_on(args)
    if l3 and path is None and args.hicache_storage_backend == "dir":
        raise FlagError("--hicache-storage-backend", "dir", "needs --hicache-storage-path (a directory)")
    extra, backend = args.hicache_storage_backend_extra_config, args.hicache_storage_backend
    own = {"mooncake": EXTRA_CONFIG_KEYS, "dir": DIR_EXTRA_CONFIG_KEYS}.get(backend)
    if l3 and extra and own is not None and (foreign := [k for k in extra if k not in own]):
        other = "dir" if backend == "mooncake" else "mooncake"
        raise FlagError(
            "--hicache-storage-backend-extra-config",
            json.dumps(extra),
            f"{', '.join(map(repr, foreign))}: for the {other} backend, not {backend} (its keys: {', '.join(own)})",
        )
    if path is not None and l3 and args.hicache_storage_backend != "mooncake":  # NOTE: else it only warns
        try:
            _check_storage_path(Path(path), args.hicache_storage_backend)
        except OSError as exc:  # NOTE: a name longer than the system takes, an I/O error
            raise FlagError("--hicache-storage-path", path, exc.strerror or str(exc)) from None


def _check_storage_path(p: Path, backend: str) -> None:
    path = str(p)
    if backend == "dir":
        if p.exists() and not p.is_dir():
            raise FlagError("--hicache-storage-path", path, "not a directory (backend dir)")
    elif p.is_dir():
        raise FlagError("--hicache-storage-path", path, "is a directory; give a file path (backend file)")
    if not p.parent.is_dir():
        what = "is not a directory" if p.parent.exists() else "does not exist"  # NOTE: a file there: not "missing"
        raise FlagError("--hicache-storage-path", path, f"directory {p.parent} {what}")


def engine_kwargs(args: argparse.Namespace, net: torch.nn.Module, **overrides: Any) -> dict[str, Any]:
    """The :class:`Engine` keyword arguments the flags mean (``overrides`` win; L2/L3 sizes
    follow an overridden ``num_pages`` / ``page_size``). Raises :class:`FlagError`."""
    kw: dict[str, Any] = dict(
        device=args.device,
        dtype=dtype_of(args),
        page_size=args.page_size,
        num_pages=args.num_pages,
        max_batch=args.max_batch,
        cuda_graphs=not args.disable_cuda_graph,
        graph_short_prefills={"auto": None, "on": True, "off": False}[args.cuda_graph_short_prefills],
        attention=args.attention,
        cudnn=args.attention_cudnn if str(args.device).startswith("cuda") else "off",  # else warned about
        enable_hicache=args.enable_hicache,
        # NOTE: a flag ineffective_flags warns about is not passed on (it would be refused).
        storage_path=None if args.hicache_storage_backend == "mooncake" else args.hicache_storage_path,
        storage_direct=args.hicache_storage_direct and args.hicache_storage_backend == "file",
        policy=args.hicache_policy,
        write_policy=args.hicache_write_policy,
        transfer_backend=args.hicache_transfer_backend,
        prefetch=not args.disable_hicache_prefetch,
        # NOTE: without hicache the flag was warned about as ineffective; not twice
        layered_restore={"auto": None, "on": True, "off": False}[args.hicache_layered_restore]
        if args.enable_hicache
        else None,
        verify_pages=args.hicache_verify_pages,
        priors=CostPriors(
            recompute_s_per_token=float(args.hicache_prior_recompute_us) * 1e-6,
            host_gib_s=float(args.hicache_prior_host_gib_s),
            storage_read_gib_s=float(args.hicache_prior_storage_gib_s),
            explore=args.hicache_explore,
        ),
    )
    # Only when not the default: an Engine without these keywords still runs the default.
    if args.hicache_storage_backend != "file":
        kw["storage_backend"] = args.hicache_storage_backend
    if args.hicache_storage_backend_extra_config is not None and args.hicache_storage_backend != "file":
        kw["storage_extra"] = args.hicache_storage_backend_extra_config
    kw.update(overrides)
    if not kw["enable_hicache"]:  # no L2/L3 without it (ineffective_flags says so for flags given)
        kw.setdefault("l2_pages", 0)
        kw.setdefault("l3_pages", 0)
    if "l2_pages" not in kw or "l3_pages" not in kw:
        bpp = kv_geometry(net, kw["page_size"]).bytes_per_page
        if "l2_pages" not in kw:
            kw["l2_pages"], source = _tier_pages(args, "L2", kw["num_pages"], bpp)
            if kw["enable_hicache"] and kw["l2_pages"] == 0:
                flag = "--" + source.replace("_", "-")
                raise FlagError(flag, getattr(args, source), "L2 would have no pages; --enable-hicache needs L2")
        if "l3_pages" not in kw:
            kw["l3_pages"] = _tier_pages(args, "L3", kw["num_pages"], bpp)[0]
    return kw


# Engine keywords passed only when not default, and their flags.
_OPTIONAL_SETTINGS = (
    ("storage_backend", "hicache_storage_backend"),
    ("storage_extra", "hicache_storage_backend_extra_config"),
)
# Engine keyword / config field -> the flag that sets it, for errors raised inside Engine.
_SETTING_FLAGS: tuple[tuple[str, str], ...] = (
    ("L3 path", "hicache_storage_path"),
    ("L3 directory", "hicache_storage_path"),
    ("L3 needs L2", "hicache_ratio"),
    ("L3", "hicache_storage_ratio"),
    ("storage_extra", "hicache_storage_backend_extra_config"),
    ("extra config", "hicache_storage_backend_extra_config"),
    ("storage_backend", "hicache_storage_backend"),
    ("storage backend", "hicache_storage_backend"),
    ("mooncake ", "hicache_storage_backend_extra_config"),
    ("storage_path", "hicache_storage_path"),
    ("direct I/O", "hicache_storage_direct"),
    ("recompute_s_per_token", "hicache_prior_recompute_us"),
    ("storage_read_gib_s", "hicache_prior_storage_gib_s"),
    ("host_gib_s", "hicache_prior_host_gib_s"),
    ("l1_pages", "num_pages"),
    ("num_pages", "num_pages"),
    ("l2_pages", "hicache_ratio"),
    ("l3_pages", "hicache_storage_ratio"),
    ("page_size", "page_size"),
    ("max_batch", "max_batch"),
    ("write_policy", "hicache_write_policy"),
    ("transfer_backend", "hicache_transfer_backend"),
    ("transfer backend", "hicache_transfer_backend"),
    ("layered_restore", "hicache_layered_restore"),
    ("policy", "hicache_policy"),
    ("cudnn", "attention_cudnn"),
    ("attention", "attention"),
    ("explore", "hicache_explore"),
    ("model", "model"),
)
_READABLE = {  # longest first
    "layered_restore needs prefetch": "a layered restore needs prefetch, which --disable-hicache-prefetch turns off",
    "l1_pages": "L1 pages (--num-pages)",
    "num_pages": "L1 pages (--num-pages)",
    "l2_pages": "L2 pages",
    "l3_pages": "L3 pages",
    "page_size": "--page-size",
    "max_batch": "--max-batch",
    "enable_hicache": "--enable-hicache",
    "layered_restore": "--hicache-layered-restore",
}


def flag_error(exc: ConfigError | MisuseError, args: argparse.Namespace) -> FlagError:
    """``exc`` (raised while building an engine) as the flag it came from."""
    if isinstance(exc, FlagError):
        return exc
    message = str(exc)
    dest = next((d for key, d in _SETTING_FLAGS if key in message), None)
    # a ratio-or-size pair: name the one that was used
    sized = {"hicache_ratio": "hicache_size", "hicache_storage_ratio": "hicache_storage_size"}
    if dest in sized and getattr(args, sized[dest]) is not None:
        dest = sized[dest]
    for name, readable in _READABLE.items():
        message = re.sub(rf"\b{re.escape(name)}\b", readable, message)
    if dest is None:
        return FlagError(None, None, message)
    return FlagError("--" + dest.replace("_", "-"), getattr(args, dest), message)


def engine_from_args(args: argparse.Namespace, net: torch.nn.Module | None = None, **overrides: Any) -> Engine:
    """An :class:`Engine` per the flags (``overrides`` win over them). Raises
    :class:`FlagError` naming the flag behind any configuration error."""
    try:
        check_flags(args)
        if net is None:
            net = build_model(args.model, device=args.device, dtype=dtype_of(args))
        kw = engine_kwargs(args, net, **overrides)
        return Engine(args.model, net=net, **kw)
    except (ConfigError, MisuseError) as exc:
        raise flag_error(exc, args) from exc


def served_from(out: Output) -> str:
    """Where a request's prompt KV came from: ``L2``/``L3`` (restored), ``L1`` (a prefix
    hit, the rest prefilled), or ``recompute`` (nothing cached)."""
    if out.restored_from in ("L2", "L3") and not out.restore_failed:
        return out.restored_from
    return "L1" if out.cached_tokens else "recompute"


def warn(message: str) -> None:
    print(f"warning: {message}", file=sys.stderr)


if __name__ == "__main__":  # NOTE: a module of flags, nothing to run: say where the program is
    print("error: hicache.engine.cli holds the engine's flags; run python -m hicache.engine", file=sys.stderr)
    raise SystemExit(2)
