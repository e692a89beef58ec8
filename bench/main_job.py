"""The main job (``scripts/run.sh``): the latency benchmark, then the stress benchmark, each
given the options it has. An option both have (``--out``, ``--model``, ``--device``, ...) goes
to both; one only the stress benchmark has (``--repeats``, ``--no-rotation``, ...) goes to it
alone; one neither has is an error, before anything runs.

    python bench/main_job.py [OPTIONS]      (bench/bench_hicache.py --help and
                                             bench/bench_hicache_stress.py --help list them)
"""

from __future__ import annotations

import argparse
import subprocess
import sys
from collections.abc import Mapping
from pathlib import Path

import bench_hicache
import bench_hicache_stress

HERE = Path(__file__).resolve().parent
BENCHES = {"bench_hicache.py": bench_hicache.parser, "bench_hicache_stress.py": bench_hicache_stress.parser}


def route(argv: list[str], parsers: Mapping[str, argparse.ArgumentParser]) -> dict[str, list[str]]:
    """``argv`` split per benchmark: each option, with its values, to every parser that has
    it. ValueError (naming the option) for one no parser has or a bare value."""
    out: dict[str, list[str]] = {name: [] for name in parsers}
    i = 0
    while i < len(argv):
        token = argv[i]
        flag = token.split("=", 1)[0]
        if not flag.startswith("--"):
            raise ValueError(f"{token}: not an option (options start with --)")
        owners = [n for n, p in parsers.items() if flag in p._option_string_actions]
        if not owners:
            raise ValueError(f"{flag}: no benchmark has this option")
        nargs = parsers[owners[0]]._option_string_actions[flag].nargs
        j = i + 1
        if "=" not in token:
            if nargs in (None, 1):
                j += 1
            elif nargs in ("+", "*"):
                while j < len(argv) and not argv[j].startswith("--"):
                    j += 1
            elif isinstance(nargs, int):
                j += nargs
        for name in owners:
            out[name].extend(argv[i:j])
        i = j
    return out


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv in (["-h"], ["--help"]):
        print(__doc__.strip())
        return 0
    try:
        split = route(argv, {name: make() for name, make in BENCHES.items()})
    except ValueError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    for name, args in split.items():
        code = subprocess.call([sys.executable, str(HERE / name), *args])
        if code:
            return code
    return 0


if __name__ == "__main__":
    sys.exit(main())
