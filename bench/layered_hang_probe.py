"""Where the layered restore stalls beside concurrent decoding (H200, session 7).

``bench_hicache_stress.py --no-rotation --hicache-layered-restore on`` on Qwen3-8B stopped
after 3 of 80 overlap requests: the host sat in a decode batch's ``argmax`` for good (a GPU
wait that never ends). This runs that benchmark with every non-layered forward waited for
by polling instead of blocking: past ``--deadline-s`` it prints which streams and events are
still pending (the caller's stream, the layered forward's side stream and its done event,
each layer group's event, the transfer stream) and the host's last steps, and exits with
status 3, so a hang costs seconds of device time, not the call's limit. A forward that
ends more than 0.5 s after its launch prints the host's last steps too.

    python bench/layered_hang_probe.py --model qwen3-8b [--disable-cuda-graph] [stress args]
"""

from __future__ import annotations

import os
import sys
import time
from collections import deque
from typing import Any

import bench_hicache_stress
import torch

from hicache.backends.transfer import TransferEngine
from hicache.engine import Engine
from hicache.engine.model import ModelRunner, _Graph

DEADLINE_S = 20.0
SLOW_S = 0.5
_transfers: list[TransferEngine] = []
_log: deque[str] = deque(maxlen=80)  # the host's last steps before a stall, oldest first
_t0 = time.perf_counter()


def _note(what: str) -> None:
    _log.append(f"{(time.perf_counter() - _t0) * 1e3:10.1f} ms  {what}")


def _trace(cls: Any, name: str, describe: Any) -> None:
    """Log every call of ``cls.name`` (before it runs) with ``describe(self, *args)``."""
    fn = getattr(cls, name)

    def traced(self: Any, *args: Any, **kwargs: Any) -> Any:
        _note(f"{name} {describe(self, *args, **kwargs)}")
        return fn(self, *args, **kwargs)

    setattr(cls, name, traced)


def _state(runner: ModelRunner) -> str:
    def q(x: Any) -> str:
        return "-" if x is None else ("done" if x.query() else "PENDING")

    groups = {id(e): e for e in runner.layer_events}
    lines = [
        f"caller stream {q(torch.cuda.current_stream())}",
        f"layered side stream {q(runner._side)}, its done event {q(runner._layered_done)}",
        "layer group events " + " ".join(q(e) for e in groups.values()),
    ]
    lines += [f"transfer stream {q(t.stream)}" for t in _transfers]
    lines.append(f"graphs (batch, new tokens, context bucket, layered): {sorted(runner._graphs)}")
    lines.append("last host steps:")
    lines += list(_log)
    return "\n".join(lines)


def main() -> None:
    global DEADLINE_S
    argv = sys.argv[1:]
    if "--deadline-s" in argv:
        i = argv.index("--deadline-s")
        DEADLINE_S = float(argv[i + 1])
        del argv[i : i + 2]
    init, forward = TransferEngine.__init__, ModelRunner.forward

    def register(self: TransferEngine, *a: Any, **kw: Any) -> None:
        init(self, *a, **kw)
        _transfers.append(self)

    def watched(self: ModelRunner, seqs: Any, *, layered: bool = False) -> torch.Tensor:
        out = forward(self, seqs, layered=layered)
        if layered or not out.is_cuda:
            return out
        t0 = time.perf_counter()
        while not torch.cuda.current_stream().query():
            if time.perf_counter() - t0 > DEADLINE_S:
                kind = "decode" if len(seqs[0][0]) == 1 else "prefill"
                print(f"\nSTALL: a {kind} of {len(seqs)} sequences pending {DEADLINE_S:.0f} s", file=sys.stderr)
                print(_state(self), file=sys.stderr, flush=True)
                os._exit(3)
            time.sleep(1e-4)
        if (waited := time.perf_counter() - t0) > SLOW_S and not self.captured_last:  # a stall that ended
            print(f"\nSLOW: a forward of {len(seqs)} sequences finished {waited:.2f} s after launch", file=sys.stderr)
            print("\n".join(list(_log)[-30:]), file=sys.stderr, flush=True)
        return out

    TransferEngine.__init__ = register  # type: ignore[method-assign]
    ModelRunner.forward = watched  # type: ignore[method-assign]
    _trace(Engine, "_admit", lambda e, seq: f"#{seq.id} ({len(seq.prompt)} tokens)")
    _trace(Engine, "_launch_layered", lambda e, seq: f"#{seq.id}")
    _trace(Engine, "_restored", lambda e, r: f"stage={r.stage} layered={r.layered}")
    _trace(Engine, "_prefill", lambda e, seq: f"#{seq.id}")
    _trace(Engine, "_decode", lambda e, seqs: f"{len(seqs)} sequences")
    _trace(ModelRunner, "join_layered", lambda r: "")
    _trace(ModelRunner, "wait_layered", lambda r: "")
    _trace(_Graph, "_capture", lambda g: f"q={g.q} t={g.t} layered={g.layered}")
    _trace(TransferEngine, "h2d", lambda t, src, dst, layer_events=None: f"{len(src)} pages {bool(layer_events)}")
    _trace(TransferEngine, "d2h", lambda t, src, dst: f"{len(src)} pages")
    bench_hicache_stress.main(["--no-rotation", "--hicache-layered-restore", "on", *argv])


if __name__ == "__main__":
    main()
