"""Fuzz your own KV pool and L1 <-> L2 mover with hicache's facade machines.

    python docs/examples/fuzz_my_loop.py --examples 50          # ours, on the CPU: passes
    python docs/examples/fuzz_my_loop.py --broken h2d           # a mover that flips one byte: fails

Put your engine's pieces in :func:`my_l1` and :func:`my_mover` (or pass your own to
:func:`fuzz`). The machines drive ``HiCache`` through every request and transfer
interleaving they can reach, with your pool holding the pages and your mover copying them,
and check after every step that the cache is consistent and that every page a request may
read holds exactly its prefix's bytes. Needs ``pip install '.[dev]'`` in the checkout (hypothesis,
pytest). docs/TESTING.md explains what is checked and how to read a failure.
"""

from __future__ import annotations

import sys
from collections.abc import Callable, Sequence
from typing import Any

import torch
from hypothesis import HealthCheck, Phase, settings
from hypothesis.stateful import run_state_machine_as_test

from hicache import HiCache
from hicache.backends.pools import l1_shape
from hicache.backends.transfer import TransferEngine
from hicache.core.geometry import KVGeometry
from hicache.core.protocols import DeviceMover, TicketLike, TimingsLike
from hicache.flags import ArgParser, positive_int
from hicache.spec.model import TABLE
from hicache.spec.request import REQUEST_TABLE
from hicache.testing.facade_machine import machines_over, missing_transitions, sweep_recipes

MakeL1 = Callable[[KVGeometry, int], torch.Tensor]
MakeMover = Callable[[HiCache], DeviceMover]


def my_l1(geometry: KVGeometry, pages: int) -> torch.Tensor:
    """Your engine's KV pool, ``[2, layer, page, token, kv_head, head_dim]`` of
    ``geometry.dtype`` on the CPU (the machines read and write it directly)."""
    return torch.zeros(l1_shape(geometry, pages), dtype=geometry.dtype)


def my_mover(cache: HiCache) -> DeviceMover:
    """Your L1 <-> L2 mover over ``cache.l1`` (your pool) and ``cache.l2`` (hicache's host
    pool). Here: hicache's own, with the plain torch copy path."""
    return TransferEngine(cache.l1, cache.l2, "torch")


class _FlipOnLanding:
    """A ticket that, once its copy has landed, flips one byte of a destination page."""

    def __init__(self, inner: TicketLike, flip: Callable[[], None]) -> None:
        self.inner, self.flip = inner, flip
        self.nbytes, self.extents = inner.nbytes, inner.extents
        self.ok: bool | None = None
        self.error: str | None = None

    @property
    def timings(self) -> TimingsLike:
        return self.inner.timings

    def _landed(self) -> None:
        if self.ok is None and self.inner.ok is not None:
            if self.inner.ok:
                self.flip()
            self.ok, self.error = self.inner.ok, self.inner.error

    def poll(self) -> bool:
        self.inner.poll()
        self._landed()
        return self.ok is not None

    def wait(self) -> bool:
        self.inner.wait()
        self._landed()
        return bool(self.ok)

    def cancel(self) -> bool:
        withdrawn = self.inner.cancel()
        self._landed()
        return withdrawn


class CorruptingMover:
    """A deliberately broken mover: every copy in ``direction`` ("h2d" or "d2h") lands with
    one byte of its first destination page flipped. The machines must catch it."""

    def __init__(self, inner: DeviceMover, cache: HiCache, direction: str) -> None:
        self.inner, self.cache, self.direction = inner, cache, direction

    @property
    def layered(self) -> bool:
        return self.inner.layered

    def layer_groups(self) -> list[tuple[int, int]]:
        return self.inner.layer_groups()

    def _flip_l1(self, page: int) -> None:
        self.cache.l1.buffer[0, 0, page].view(torch.uint8).view(-1)[0] ^= 1

    def _flip_l2(self, page: int) -> None:
        self.cache.l2.bytes[page, 0] ^= 1

    def d2h(self, src: Sequence[int], dst: Sequence[int]) -> TicketLike:
        ticket = self.inner.d2h(src, dst)
        if self.direction != "d2h" or not dst:
            return ticket
        return _FlipOnLanding(ticket, lambda: self._flip_l2(dst[0]))

    def h2d(self, src: Sequence[int], dst: Sequence[int], layer_events: Sequence[Any] | None = None) -> TicketLike:
        ticket = self.inner.h2d(src, dst, layer_events)
        if self.direction != "h2d" or not dst:
            return ticket
        return _FlipOnLanding(ticket, lambda: self._flip_l1(dst[0]))

    def status(self) -> dict[str, Any]:
        return self.inner.status()


def broken(direction: str, make_mover: MakeMover = my_mover) -> MakeMover:
    """``make_mover`` with every ``direction`` copy corrupting one byte."""
    return lambda cache: CorruptingMover(make_mover(cache), cache, direction)


def fuzz(
    make_l1: MakeL1 = my_l1,
    make_mover: MakeMover = my_mover,
    *,
    examples: int = 50,
    steps: int = 40,
    derandomize: bool = False,
    sweep: bool = True,
) -> tuple[list[str], list[str]]:
    """Run the three facade machines (scheduled transfers, a shared store, real threads
    with injected faults) over your pool and mover, ``examples`` runs of up to ``steps``
    steps each, after a deterministic sweep of every page-run state (``sweep``). Raises on
    the first broken check; returns the page-run and request transitions never taken."""
    machines = machines_over(l1=make_l1, device=make_mover)
    if sweep:
        progress("the sweep: every page-run state, built by the cache's own calls")
        sweep_recipes(machines.scheduled, machines.shared)
    config = settings(
        max_examples=examples,
        stateful_step_count=steps,
        deadline=None,
        derandomize=derandomize,
        database=None if derandomize else settings().database,
        suppress_health_check=[HealthCheck.too_slow],
        phases=[p for p in Phase if p is not Phase.explain],  # NOTE: explaining a failure traces every line: minutes
    )
    for machine in machines:
        progress(f"{machine.__name__}: {examples} runs of up to {steps} steps")
        run_state_machine_as_test(machine, settings=config)
    return missing_transitions(machines)


def progress(what: str) -> None:
    """A line on stderr as each part starts (a run of many examples takes minutes)."""
    print(f"fuzz: {what}", file=sys.stderr, flush=True)


def main(argv: list[str] | None = None) -> int:
    ap = ArgParser("fuzz_my_loop.py", __doc__.splitlines()[0])
    ap.add_argument("--examples", type=positive_int, default=50, help="runs per machine")
    ap.add_argument("--steps", type=positive_int, default=40, help="most steps per run")
    ap.add_argument("--derandomize", action="store_true", help="the same runs every time (CI)")
    ap.add_argument("--no-sweep", action="store_true", help="random runs only")
    ap.add_argument("--broken", choices=["h2d", "d2h"], help="fuzz a mover that corrupts one byte per copy")
    args = ap.parse_args(argv)
    mover = broken(args.broken) if args.broken else my_mover
    runs, reqs = fuzz(
        my_l1, mover, examples=args.examples, steps=args.steps, derandomize=args.derandomize, sweep=not args.no_sweep
    )
    print(
        f"passed: page-run transitions {len(TABLE) - len(runs)}/{len(TABLE)}, "
        f"request transitions {len(REQUEST_TABLE) - len(reqs)}/{len(REQUEST_TABLE)}"
    )
    for name in runs + reqs:
        print(f"  never taken: {name}")
    if runs or reqs:  # NOTE: every check held, over fewer transitions than the cache has
        print("  (not every transition was taken: more --examples or --steps, or the sweep, reach them)")
    return 0


if __name__ == "__main__":
    try:
        sys.exit(main())
    except KeyboardInterrupt:  # NOTE: Ctrl-C: one line and 130, not hypothesis's traceback
        print("interrupted", file=sys.stderr)
        sys.exit(130)
