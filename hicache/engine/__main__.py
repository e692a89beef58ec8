"""Serve a synthetic workload with the reference engine and report what happened.

    python -m hicache.engine --enable-hicache --requests 200 --prefixes 8 --prefix-tokens 350

Request i is prefix i mod --prefixes plus a random suffix; --concurrency requests are in
flight at once. The workload depends only on the flags and --seed (its digest is printed).
Throughput and TTFT count served requests only; failed ones are listed by reason. Which
tier served a request, and whether it found room, can vary between runs: restores finish
asynchronously. Exit status: 0, 1 when every request failed (or stdout could not be
written), 2 on a bad flag, 130 on Ctrl-C, 141 when the reader of stdout left (``| head``).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
import random
import signal
import sys
import time
from collections import Counter
from typing import Any, TextIO

import xxhash

# NOTE: these imports take seconds (torch, transformers): Ctrl-C during any of them ends as it
# does later, with one line and 130
try:
    try:  # the [engine] extra
        import transformers  # the models: checked here, for one line instead of a traceback
        from tqdm import tqdm

        # NOTE: a checkpoint's "Loading weights" bar on stderr, beside the run's one-line report
        transformers.utils.logging.disable_progress_bar()
    except ImportError as _missing:
        print(
            "error: the reference engine needs the [engine] extra: "
            f"pip install '.[engine]' in the hicache checkout ({_missing})",
            file=sys.stderr,
        )
        raise SystemExit(2) from None

    from hicache.engine.cli import ArgParser, add_engine_args, engine_from_args, ineffective_flags, served_from, warn
    from hicache.engine.engine import Engine, Output, model_context
    from hicache.errors import is_out_of_memory
    from hicache.flags import FlagError, given_flags, int_between, nonneg_int, port
    from hicache.metrics_http import MetricsServer
except KeyboardInterrupt:
    print("interrupted", file=sys.stderr)
    sys.stderr.flush()
    os._exit(130)  # NOTE: not SystemExit (_exit_interrupted says why); nothing is open yet

PUBLISH_EVERY_S = 0.5  # how stale /metrics may be while the workload runs
PROGRESS_EVERY_S = 10.0  # a progress line on stderr this often where no bar is drawn (a log, a pipe)


def parser() -> ArgParser:
    ap = ArgParser(description=__doc__)
    add_engine_args(ap)
    w = ap.add_argument_group("workload")
    w.add_argument("--requests", type=int_between(1, 100_000), default=100, help="requests to serve")
    w.add_argument(
        "--prefixes", type=int_between(1, 10_000), default=8, help="distinct shared prefixes, used in rotation"
    )
    w.add_argument("--prefix-tokens", type=int_between(1, 1_000_000), default=350, help="tokens per shared prefix")
    w.add_argument("--suffix-tokens", type=int_between(0, 1_000_000), default=8, help="random tokens after the prefix")
    w.add_argument("--max-new-tokens", type=int_between(1, 1_000_000), default=4, help="tokens generated per request")
    w.add_argument("--concurrency", type=int_between(1, 100_000), default=4, help="requests in flight at once")
    w.add_argument("--seed", type=nonneg_int, default=0, help="seed of the workload (prompts)")
    w.add_argument(
        "--json",
        action="store_true",
        help="print the engine's full status as JSON at the end, alone on stdout (the summary goes to stderr)",
    )
    m = ap.add_argument_group("metrics")
    m.add_argument("--enable-metrics", action="store_true", help="serve Prometheus metrics while the workload runs")
    m.add_argument(
        "--metrics-port", type=port, default=0, help="port of http://127.0.0.1:PORT/metrics (0: any free port)"
    )
    return ap


def workload(args: argparse.Namespace, vocab: int) -> list[list[int]]:
    rng = random.Random(args.seed)
    prefixes = [[rng.randrange(vocab) for _ in range(args.prefix_tokens)] for _ in range(args.prefixes)]
    return [
        prefixes[i % args.prefixes] + [rng.randrange(vocab) for _ in range(args.suffix_tokens)]
        for i in range(args.requests)
    ]


def digest(prompts: list[list[int]]) -> str:
    h = xxhash.xxh3_64()
    for p in prompts:
        h.update(json.dumps(p).encode())
    return h.hexdigest()


def percentile(sorted_values: list[float], q: float) -> float:
    """Nearest-rank percentile of a non-empty sorted list: the smallest value with at least
    ``q`` of the values at or below it (rank ceil(q * n), counted from 1)."""
    return sorted_values[min(len(sorted_values) - 1, max(0, math.ceil(q * len(sorted_values)) - 1))]


def serve(
    engine: Engine, prompts: list[list[int]], args: argparse.Namespace, server: MetricsServer | None
) -> list[Output]:
    outs: list[Output] = []
    published = start = said = time.perf_counter()
    with tqdm(total=len(prompts), desc="requests", disable=None) as bar:
        submitted = 0
        while len(outs) < len(prompts):
            while submitted < len(prompts) and engine.pending < args.concurrency:
                engine.submit(prompts[submitted], args.max_new_tokens)
                submitted += 1
            done = engine.step()
            outs.extend(done)
            bar.update(len(done))
            if bar.disable and time.perf_counter() - said >= PROGRESS_EVERY_S:  # no bar drawn (a log, a pipe)
                said = time.perf_counter()
                print(f"requests: {len(outs)}/{len(prompts)} done ({said - start:.0f} s)", file=sys.stderr, flush=True)
            if server is not None and time.perf_counter() - published > PUBLISH_EVERY_S:
                server.publish(engine.cache.prometheus())
                published = time.perf_counter()
    return outs


def report(engine: Engine, outs: list[Output], wall: float) -> Counter[str]:
    """Print the summary; returns the failure reasons, counted."""
    ok = [o for o in outs if o.error is None]
    failed = Counter(o.error for o in outs if o.error is not None)
    print(f"\n{len(outs)} requests: {len(ok)} served, {sum(failed.values())} failed")
    for reason, n in failed.most_common():
        print(f"  failed {n}x: {reason}")
    if ok:
        ttft = sorted(o.ttft_s * 1e3 for o in ok)
        print(f"throughput: {len(ok) / wall:.2f} req/s ({len(ok)} served in {wall:.2f} s)")
        print(f"TTFT ms: median {percentile(ttft, 0.5):.2f}, p90 {percentile(ttft, 0.9):.2f}, max {ttft[-1]:.2f}")
        sources = Counter(served_from(o) for o in ok)
        print("prompt KV from:", ", ".join(f"{s} {sources[s]}" for s in ("recompute", "L1", "L2", "L3")))
    m = engine.cache.metrics
    print(
        "cached tokens by tier:",
        ", ".join(f"{t} {n}" for t, n in m.hit_tokens.items()),
        f"| recomputed {m.recomputed_tokens} | restores {m.restores}, fallbacks {m.fallbacks}",
    )
    return failed


def main(argv: list[str] | None = None) -> int:
    ap = parser()
    argv = sys.argv[1:] if argv is None else argv
    args = ap.parse_args(argv)
    for message in ineffective_flags(args, given_flags(ap, argv)):
        warn(message)
    if args.metrics_port and not args.enable_metrics:
        warn("--metrics-port has no effect without --enable-metrics")
    need = -(-(args.prefix_tokens + args.suffix_tokens + args.max_new_tokens) // args.page_size)
    if need > args.num_pages:
        prompt = args.prefix_tokens + args.suffix_tokens
        # NOTE: the flag named is one the user wrote (a default they never typed explains nothing)
        given = given_flags(ap, argv)
        sizes = [d for d in ("prefix_tokens", "suffix_tokens", "max_new_tokens") if d in given]
        culprit = (
            "num_pages"
            if "num_pages" in given
            else max(sizes, key=lambda d: getattr(args, d))  # the largest part of what does not fit
            if sizes
            else "page_size"
            if "page_size" in given
            else "num_pages"
        )
        ap.error(
            f"--{culprit.replace('_', '-')} {getattr(args, culprit)}: no room in L1 for a prompt of {prompt} tokens "
            f"(with {args.max_new_tokens} new tokens it needs {need} pages of {args.page_size}"
            + (")" if culprit == "num_pages" else f"; --num-pages is {args.num_pages})")
        )
    try:
        engine = engine_from_args(args)
    except FlagError as exc:
        ap.error(str(exc))
    except KeyboardInterrupt:  # while the model is built
        print("interrupted", file=sys.stderr)
        return 130
    except (MemoryError, RuntimeError) as exc:  # torch's allocators raise RuntimeError subclasses
        if not is_out_of_memory(exc):
            raise
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        print(
            f"error: out of memory building the model ({args.model}) and the engine on {args.device}: "
            f"{first}; try a smaller --model, --num-pages or --dtype bfloat16",
            file=sys.stderr,
        )
        return 1
    context = model_context(engine.net)
    positions = args.prefix_tokens + args.suffix_tokens + args.max_new_tokens
    if context is not None and context < positions:
        engine.close()
        given = given_flags(ap, argv)
        sizes = [d for d in ("prefix_tokens", "suffix_tokens", "max_new_tokens") if d in given] or ["prefix_tokens"]
        culprit = max(sizes, key=lambda d: getattr(args, d))
        prompt = args.prefix_tokens + args.suffix_tokens
        ap.error(
            f"--{culprit.replace('_', '-')} {getattr(args, culprit)}: a prompt of {prompt} tokens and "
            f"{args.max_new_tokens} new needs {positions} positions, the model ({args.model}) has {context} "
            "(max_position_embeddings)"
        )
    storage = engine.cache.status().storage
    if storage and not storage.get("available", True):
        warn(f"L3 unavailable, running without it: {storage.get('error') or 'no reason given'}")
    config = engine.cache.config
    prompt_pages = (args.prefix_tokens + args.suffix_tokens) // args.page_size
    if config.l3_pages and 0 < config.l2_pages < prompt_pages:  # NOTE: the log's warning is silent here
        warn(
            f"L2 holds {config.l2_pages} pages, fewer than a prompt's {prompt_pages}: backups go to L3 through L2, "
            "so such a prompt stays in L1 only and never reaches L3 (raise --hicache-ratio or --hicache-size)"
        )
    server = MetricsServer(args.metrics_port) if args.enable_metrics else None
    interrupted = False
    try:
        if server is not None:
            try:
                bound = server.start()
            except OSError as exc:
                ap.error(f"--metrics-port {args.metrics_port}: {exc.strerror or exc}")
            print(f"metrics: http://127.0.0.1:{bound}/metrics", file=sys.stderr, flush=True)
            server.publish(engine.cache.prometheus())
        vocab = int(engine.net.config.vocab_size)  # type: ignore[union-attr, arg-type]
        prompts = workload(args, vocab)
        # NOTE: with --json, stdout carries the JSON alone (a pipe into a JSON reader works);
        # the summary goes to stderr.
        with contextlib.redirect_stdout(sys.stderr) if args.json else contextlib.nullcontext():
            print(f"workload: {len(prompts)} requests, seed {args.seed}, digest {digest(prompts)}")
            t0 = time.perf_counter()
            outs = serve(engine, prompts, args, server)
            wall = time.perf_counter() - t0
            engine.cache.drain()
            engine.cache.check_integrity()
            if server is not None:
                server.publish(engine.cache.prometheus())
            failed = report(engine, outs, wall)
        if args.json:
            print(json.dumps(engine.status(), indent=1, default=str))
    except KeyboardInterrupt:
        interrupted = True
    finally:
        try:
            if server is not None:
                server.stop()
            engine.close()
        except KeyboardInterrupt:
            # NOTE: a Ctrl-C while the engine closes (a write_back flush, the store's queued
            # writes): the close stops there; the store stays whole (each page is written
            # whole or not at all) and what it lacks is recomputed next time
            interrupted = True
    if interrupted:
        print("interrupted", file=sys.stderr)
        return 130
    if len(failed) and sum(failed.values()) == len(outs):
        reasons = "; ".join(f"{reason} ({n})" for reason, n in failed.most_common())
        print(f"error: all {len(outs)} requests failed: {reasons}", file=sys.stderr)
        return 1
    if failed:
        warn(f"{sum(failed.values())} of {len(outs)} requests failed (listed above)")
    return 0


class OutputLost(Exception):
    """Writing stdout failed (its reader left, or its disk is full); the cause is the OSError."""


class _Stdout:
    """``sys.stdout`` whose write errors are :class:`OutputLost`: told apart from any other
    OSError (a store's, a port's), which is not the output's."""

    def __init__(self, stream: TextIO) -> None:
        self.stream = stream

    def write(self, text: str) -> int:
        try:
            return self.stream.write(text)
        except OSError as exc:
            raise OutputLost(exc) from exc

    def flush(self) -> None:
        try:
            self.stream.flush()
        except OSError as exc:
            raise OutputLost(exc) from exc

    def __getattr__(self, name: str) -> Any:
        return getattr(self.stream, name)


def run(argv: list[str] | None = None) -> int:
    """:func:`main`, with a failure to write stdout as one line and exit 1, or, where the
    reader of a pipe left (``| head``), a quiet exit 141 (as a SIGPIPE would end it)."""
    stdout = sys.stdout
    if stdout is None:  # NOTE: fd 1 closed (``>&-``): Python drops what is printed, so do we
        return main(argv)
    sys.stdout = _Stdout(stdout)
    try:
        code = main(argv)
        sys.stdout.flush()  # NOTE: here, not at exit, where a failure is only "Exception ignored"
        return code
    except OutputLost as lost:
        error = lost.__cause__
        # NOTE: what is still buffered goes nowhere: the interpreter's flush at exit cannot fail
        with contextlib.suppress(OSError, ValueError):
            devnull = os.open(os.devnull, os.O_WRONLY)
            os.dup2(devnull, stdout.fileno())
            os.close(devnull)
        if isinstance(error, BrokenPipeError):
            return 141
        reason = error.strerror if isinstance(error, OSError) and error.strerror else error
        print(f"error: cannot write the output: {reason}", file=sys.stderr)
        return 1
    finally:
        sys.stdout = stdout


def _exit_interrupted() -> None:
    """Exit 130 after Ctrl-C, everything closed and flushed, without the interpreter's own
    exit: after a Ctrl-C during torch's import or the model's build, that exit ended the
    process by SIGINT (a caller saw "killed by signal 2") in 11 of 100 runs where the status
    asked for was 130, and in none of 40 exiting this way (a Ctrl-C 0.2-4.3 s after start).
    Nothing is left to clean up: the engine closed before ``run`` returned."""
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(Exception):
            if stream is not None:
                stream.flush()
    os._exit(130)


def _late_interrupt(signum: int, frame: object) -> None:
    """A Ctrl-C once :func:`run` has returned (everything closed), while the interpreter
    exits: 130 and one line, as earlier (Python's own handler ended the process by SIGINT,
    silently)."""
    with contextlib.suppress(Exception):
        print("interrupted", file=sys.stderr)
    _exit_interrupted()


if __name__ == "__main__":
    code = run()
    if code == 130:
        _exit_interrupted()
    if signal.getsignal(signal.SIGINT) is signal.default_int_handler:  # NOTE: not where it is ignored
        signal.signal(signal.SIGINT, _late_interrupt)
    sys.exit(code)
