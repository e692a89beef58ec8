"""Probe: show the stream race the transfer engine's ``wait_stream`` prevents.

The caller writes L1 pages on its own stream behind a long kernel, then asks for a D2H at
once. With the wait the D2H sees the new pages; without it, it may read stale pages or
garbage ids (each trial in a fresh process: a racing kernel can kill the CUDA context).
Prints the outcome of each trial. Needs CUDA.

    python bench/probes/race_demo.py [--trials 5]
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys

TRIAL = """
import sys, torch
from tests.gpu.test_transfer_gpu import SLEEP_CYCLES, make
dev, host, engine = make(16, "triton")
engine.d2h([20, 21, 22, 23], [30, 31, 32, 33]).wait()  # warm-up: kernel JIT, same-size buffers
if sys.argv[1] == "no-wait":
    engine.stream.wait_stream = lambda other: None
fresh = torch.randn(dev.buffer[:, :, 5:9].shape, device="cuda").to(dev.geometry.dtype)
torch.cuda.synchronize()
with torch.cuda.stream(torch.cuda.Stream()):  # an engine's own (non-default) stream
    torch.cuda._sleep(SLEEP_CYCLES)
    dev.buffer[:, :, 5:9].copy_(fresh)
    ticket = engine.d2h([5, 6, 7, 8], [0, 1, 2, 3])
ticket.wait()
torch.cuda.synchronize()
print("FRESH" if torch.equal(host.buffer[:, :, 0:4], fresh.cpu()) else "STALE")
"""


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--trials", type=int, default=5)
    args = ap.parse_args()
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # the repository
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([root, os.environ.get("PYTHONPATH", "")]))
    for mode in ("wait", "no-wait"):
        outcomes = []
        for _ in range(args.trials):
            proc = subprocess.run(
                [sys.executable, "-c", TRIAL, mode], capture_output=True, text=True, env=env, cwd=root
            )
            outcomes.append(proc.stdout.strip() or f"crash (rc {proc.returncode})")
        print(f"{mode:>8}: {outcomes}")


if __name__ == "__main__":
    main()
