"""The main job (``scripts/run.sh``): the latency benchmark, then the stress benchmark, each
given the options it has. An option both have (``--out``, ``--model``, ``--device``, ...) goes
to both; one only the stress benchmark has (``--repeats``, ``--no-rotation``, ...) goes to it
alone; one neither has, or a value either would refuse, is an error before anything runs.

    python bench/main_job.py [OPTIONS]      (bench/bench_hicache.py --help and
                                             bench/bench_hicache_stress.py --help list them)
"""

from __future__ import annotations

import argparse
import subprocess
import sys
from collections.abc import Mapping
from pathlib import Path

try:  # NOTE: these import torch (seconds): Ctrl-C there ends as it does later, one line and 130
    import bench_hicache
    import bench_hicache_stress
except KeyboardInterrupt:
    print("interrupted", file=sys.stderr)
    raise SystemExit(130) from None

HERE = Path(__file__).resolve().parent
BENCHES = {"bench_hicache.py": bench_hicache.parser, "bench_hicache_stress.py": bench_hicache_stress.parser}


def _takes(nargs: int | str | None, count: int) -> bool:
    """An option of argparse ``nargs`` accepts ``count`` values."""
    if nargs is None:
        return count == 1
    if nargs == "?":
        return count <= 1
    if nargs == "+":
        return count >= 1
    if nargs == "*":
        return True
    return isinstance(nargs, int) and count == nargs


def _values(count: int) -> str:
    return "no value" if count == 0 else "one value" if count == 1 else f"{count} values"


def route(argv: list[str], parsers: Mapping[str, argparse.ArgumentParser]) -> dict[str, list[str]]:
    """``argv`` split per benchmark: each option, with its values (the tokens up to the next
    ``--``), to every parser that has it. ValueError, naming the option, for one no parser
    has, a bare value, or values some parser that has the option would refuse (``--prefix-tokens
    350 3500``: the stress benchmark takes one), so nothing runs only to fail half-way."""
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
        j = i + 1
        if "=" in token:
            count = 1
        else:
            while j < len(argv) and not argv[j].startswith("--"):
                j += 1
            count = j - i - 1
        takers = [n for n in owners if _takes(parsers[n]._option_string_actions[flag].nargs, count)]
        for name in owners:
            if name in takers:
                continue
            nargs = parsers[name]._option_string_actions[flag].nargs
            wants = (
                "one or more values"
                if nargs == "+"
                else "any number of values"
                if nargs == "*"
                else _values(1 if nargs in (None, "?") else int(nargs or 0))
            )
            alone = f" ({', '.join(takers)} does: run it alone for that)" if takers else ""
            raise ValueError(f"{' '.join(argv[i:j])}: {name} takes {wants} after {flag}{alone}")
        for name in owners:
            out[name].extend(argv[i:j])
        i = j
    return out


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv in (["-h"], ["--help"]):
        print(__doc__.strip())
        return 0
    parsers = {name: make() for name, make in BENCHES.items()}
    try:
        split = route(argv, parsers)
    except ValueError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    for name, args in split.items():  # every value checked by its benchmark before either runs
        try:
            parsers[name].parse_args(args)
        except SystemExit as exc:  # the parser printed "error: --flag VALUE: reason"
            return exc.code if isinstance(exc.code, int) else 2
    for name, args in split.items():
        try:
            code = subprocess.call([sys.executable, str(HERE / name), *args])
        except KeyboardInterrupt:  # the benchmark got the Ctrl-C too and said "interrupted"
            return 130
        if code:
            return code
    return 0


if __name__ == "__main__":
    sys.exit(main())
