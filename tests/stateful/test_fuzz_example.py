"""docs/examples/fuzz_my_loop.py runs as written, and catches a broken backend."""

from __future__ import annotations

import importlib.util
import re
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest
import torch
from hypothesis import Phase, settings
from hypothesis.stateful import run_state_machine_as_test

from hicache import HiCache
from hicache.core.geometry import KVGeometry
from hicache.core.protocols import DeviceMover
from hicache.testing.facade_machine import G, machines_over

EXAMPLE = Path(__file__).resolve().parents[2] / "docs" / "examples" / "fuzz_my_loop.py"


def _example() -> ModuleType:
    spec = importlib.util.spec_from_file_location("fuzz_my_loop", EXAMPLE)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _run(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, str(EXAMPLE), "--examples", "5", "--derandomize", *args],
        capture_output=True,
        text=True,
        timeout=600,
        check=False,
    )


def test_the_example_passes_over_our_backends_and_takes_every_transition() -> None:
    """As a user runs it (our pool and mover on the CPU): it passes, and with the sweep it
    reports every page-run and every request transition taken."""
    done = _run()
    assert done.returncode == 0, done.stderr[-4000:]
    assert "passed: page-run transitions 72/72, request transitions 21/21" in done.stdout, done.stdout
    assert "not every transition was taken" not in done.stdout


def test_a_short_run_says_it_took_fewer_transitions() -> None:
    """Checks that held over a few short runs pass, and the output says what they missed."""
    done = _run("--steps", "2", "--no-sweep")
    assert done.returncode == 0, done.stderr[-4000:]
    assert "never taken: " in done.stdout and "not every transition was taken" in done.stdout


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--examples", "0"], "--examples 0: must be an integer >= 1"),
        (["--steps", "0"], "--steps 0: must be an integer >= 1"),
        (["--steps", "-1e9"], "--steps -1e9: not an integer"),
        (["--broken", "x"], "--broken x: invalid choice (choose from h2d, d2h)"),
        (["--example", "3"], "--example 3: unknown flag (did you mean --examples?)"),
    ],
)
def test_the_example_answers_a_bad_flag_with_one_line(
    argv: list[str], message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    """A count of 0 is an error naming the flag, not a hypothesis traceback; every bad flag
    is one line, as the engine's command line answers."""
    with pytest.raises(SystemExit) as exc:
        _example().main(argv)
    assert exc.value.code == 2
    assert capsys.readouterr().err == f"error: {message}\n"


def test_the_example_fails_on_a_mover_that_corrupts_one_byte_as_testing_md_shows() -> None:
    """``--broken h2d`` (one byte flipped in every H2D's first page), run as TESTING.md's
    "Reading a failure" runs it, exits non-zero with the report the page walks through: each
    line it shows, in order (``...`` stands for lines or text it leaves out)."""
    doc = (EXAMPLE.parents[1] / "TESTING.md").read_text()
    section = doc[doc.index("## Reading a failure") :]
    command = re.search(r"`python docs/examples/fuzz_my_loop.py ([^`]*)`", section)
    block = re.search(r"```\n(.*?)```", section, re.S)
    assert command is not None and block is not None
    done = subprocess.run(
        [sys.executable, str(EXAMPLE), *command.group(1).split()],
        capture_output=True,
        text=True,
        timeout=600,
        check=False,
    )
    assert done.returncode != 0
    assert "fuzz: FacadeMachine: 20 runs of up to 40 steps" in done.stderr.splitlines()  # progress, as it starts
    said = [line for line in done.stderr.splitlines() if line and not line.startswith("  ")]
    at = 0
    for shown in block.group(1).splitlines():
        if shown == "...":
            continue
        pattern = re.compile(".*".join(re.escape(part) for part in shown.split("...")))
        found = next((i for i in range(at, len(said)) if pattern.fullmatch(said[i])), None)
        assert found is not None, f"TESTING.md shows {shown!r}; the run printed, from there: {said[at:]}"
        at = found + 1


@pytest.mark.parametrize(
    ("machine", "direction"), [("scheduled", "h2d"), ("scheduled", "d2h"), ("shared", "d2h"), ("real", "d2h")]
)
def test_each_machine_runs_over_the_mover_it_is_given(machine: str, direction: str) -> None:
    """Random runs alone (no sweep) of each machine from ``machines_over`` find a mover that
    flips one byte per copy: the L1 (H2D) and the L2 (D2H) content checks. A run of 40 steps
    reaches a checked restore in about two examples of three (the scheduled H2D, 20 seeds), so
    up to 200 examples are drawn: the derandomized seed follows the machines' source, and 20
    missed it after an unrelated edit. Generation alone: the first failure is the finding."""
    example = _example()
    cls = getattr(machines_over(l1=example.my_l1, device=example.broken(direction)), machine)
    config = settings(
        max_examples=160, stateful_step_count=40, derandomize=True, database=None, phases=[Phase.generate]
    )
    with pytest.raises(AssertionError, match="holds wrong content"):
        run_state_machine_as_test(cls, settings=config)


def test_the_cache_is_built_over_the_pool_the_machine_is_given() -> None:
    """``machines_over(l1=...)``: the cache's L1 is the very tensor the embedder made."""
    example = _example()
    pools: list[torch.Tensor] = []
    built: list[bool] = []

    def pool(geometry: KVGeometry, pages: int) -> torch.Tensor:
        pools.append(example.my_l1(geometry, pages))
        return pools[-1]

    def mover(cache: HiCache) -> DeviceMover:
        built.append(cache.l1.buffer is pools[-1])
        return cache.device

    config = settings(max_examples=3, stateful_step_count=5, derandomize=True, database=None)
    run_state_machine_as_test(machines_over(l1=pool, device=mover).scheduled, settings=config)
    assert built and all(built)


class _Rearranging:
    """A mover that moves the right pages with their insides rearranged, one way per ``how``:
    layers rolled, K and V swapped, or the tokens of a page reversed (each breaks attention)."""

    def __init__(self, inner: DeviceMover, cache: HiCache, how: str) -> None:
        self.inner, self.cache, self.how = inner, cache, how

    def __getattr__(self, name: str) -> object:
        return getattr(self.inner, name)

    def _rearrange(self, page: torch.Tensor) -> None:  # one page: [2, layer, token, head, dim]
        dims = {"layers": 1, "k and v": 0, "tokens": 2}[self.how]
        page.copy_(page.roll(1, dims=dims) if self.how == "layers" else page.flip(dims))

    def d2h(self, src: list[int], dst: list[int]) -> object:
        ticket = self.inner.d2h(src, dst)
        ticket.wait()
        for p in dst:
            self._rearrange(self.cache.l2.page_buffer[p])
        return ticket

    def h2d(self, src: list[int], dst: list[int], layer_events: object = None) -> object:
        ticket = self.inner.h2d(src, dst, layer_events)  # type: ignore[arg-type]
        ticket.wait()
        for p in dst:
            self._rearrange(self.cache.l1.buffer[:, :, p])
        return ticket


@pytest.mark.parametrize("how", ["layers", "k and v", "tokens"])
def test_a_mover_that_rearranges_a_page_is_caught(how: str) -> None:
    """Each element of a test page holds its tag plus its position: a copy of the right pages
    with the wrong layer, K for V, or tokens out of order fails the content check (with one
    value per page it passed every check)."""
    example = _example()

    def mover(cache: HiCache) -> DeviceMover:
        return _Rearranging(example.my_mover(cache), cache, how)  # type: ignore[return-value]

    cls = machines_over(l1=example.my_l1, device=mover).scheduled
    config = settings(  # as in test_each_machine_runs_over_the_mover_it_is_given
        max_examples=160, stateful_step_count=40, derandomize=True, database=None, phases=[Phase.generate]
    )
    said = {"layers": "layers shifted by one", "k and v": "K and V swapped", "tokens": "tokens of the page reversed"}
    with pytest.raises(AssertionError, match=f"holds wrong content: {said[how]}"):
        run_state_machine_as_test(cls, settings=config)


def test_a_wrong_page_is_described() -> None:
    """The content check says what a wrong page holds instead, so the bug can be told
    from the message: never written, another page, rearranged, or which elements."""
    from hicache.testing.facade_machine import page_content, wrong_content

    want, other = page_content([1, 2]), page_content([3, 4])
    assert wrong_content(torch.full_like(want, float("nan")), want).startswith("never written")
    partly = want.clone()
    partly[1, 0, 0, 0, :2] = float("nan")
    assert wrong_content(partly, want) == f"2 of {want.numel()} elements never written"
    assert wrong_content(other, want).startswith(f"another page's content (tag {other.reshape(-1)[0].item()!r}, want ")
    assert wrong_content(want.flip(0), want) == "K and V swapped"
    assert wrong_content(want.flip(2), want) == "tokens of the page reversed"
    flipped = want.clone()
    flipped[1, 1, 0, 0, 3] += 1
    assert wrong_content(flipped, want) == (
        f"1 of {want.numel()} elements differ, the first at [kv, layer, token, head, dim] [1, 1, 0, 0, 3]: "
        f"{want[1, 1, 0, 0, 3].item() + 1!r}, want {want[1, 1, 0, 0, 3].item()!r}"
    )


class _Refusing:
    """A mover whose every other call raises on issue (a full DMA queue), as a driver may."""

    def __init__(self, inner: DeviceMover) -> None:
        self.inner, self.calls = inner, 0

    def __getattr__(self, name: str) -> object:
        return getattr(self.inner, name)

    def _issue(self) -> None:
        self.calls += 1
        if self.calls % 2 == 0:
            raise OSError("the DMA queue is full")

    def d2h(self, src: list[int], dst: list[int]) -> object:
        self._issue()
        return self.inner.d2h(src, dst)

    def h2d(self, src: list[int], dst: list[int], layer_events: object = None) -> object:
        self._issue()
        return self.inner.h2d(src, dst, layer_events)  # type: ignore[arg-type]


@pytest.mark.parametrize("machine", ["scheduled", "real"])
def test_a_mover_that_raises_on_issue_fails_only_its_transfers(machine: str) -> None:
    """The controller takes a mover's exception on issue as that transfer's failure; the
    scheduled machines, which make the mover's call when the copy completes, agree: no
    failure is reported for a mover the cache serves correctly over, and some refused."""
    refusing: list[_Refusing] = []

    def mover(cache: HiCache) -> DeviceMover:
        refusing.append(_Refusing(cache.device))
        return refusing[-1]  # type: ignore[return-value]

    cls = getattr(machines_over(device=mover), machine)
    config = settings(max_examples=30, stateful_step_count=30, derandomize=True, database=None)
    run_state_machine_as_test(cls, settings=config)
    assert sum(m.calls for m in refusing) >= 2


class _LateTicket:
    """A copy that lands at its ticket's second ``poll`` or at ``wait``: until then it is
    in flight, as a DMA queued behind others is. ``cancel`` withdraws it if it has not
    landed; a lying one says so and lets it land at the next ``wait`` all the same."""

    def __init__(
        self, issue: Callable[[], Any], nbytes: int, lying: str, landed: Callable[[], None] = lambda: None
    ) -> None:
        self.issue, self.nbytes, self.lying, self.landed = issue, nbytes, lying, landed
        self.ok: bool | None = None
        self.error: str | None = None
        self.inner: Any = None
        self.polls = 0
        self.withdrawn = False

    @property
    def extents(self) -> int:
        return 0 if self.inner is None else int(self.inner.extents)

    @property
    def timings(self) -> Any:
        return self.inner.timings

    def _land(self) -> bool:
        if self.inner is None and not self.withdrawn:
            self.inner = self.issue()
            self.inner.wait()
            if self.ok is None:  # a lying cancel already told the cache it failed
                self.ok, self.error = self.inner.ok, self.inner.error
        return self.ok is not None

    def poll(self) -> bool:
        self.polls += 1
        self.landed()  # NOTE: "later": copies said withdrawn land while the cache polls the others
        return self._land() if self.polls >= 2 else self.ok is not None

    def wait(self) -> bool:
        if self.lying != "later" or self.ok is None:  # NOTE: "later": a cancelled ticket waits for nothing
            self._land()
        return bool(self.ok)

    def cancel(self) -> bool:
        self.landed()  # NOTE: "later": and while it withdraws others
        if self.inner is not None:
            return False  # landed: too late
        self.ok, self.error = False, "withdrawn"
        self.withdrawn = self.lying == "no"
        return True


class _LateMover:
    def __init__(self, inner: DeviceMover, lying: str) -> None:
        self.inner, self.lying = inner, lying
        self.withdrawn = 0
        self.tickets: list[_LateTicket] = []

    def __getattr__(self, name: str) -> object:
        return getattr(self.inner, name)

    def _ticket(self, issue: Callable[[], Any], pages: int) -> _LateTicket:
        self.tickets = [*self.tickets[-64:], _LateTicket(issue, pages * G.bytes_per_page, self.lying, self._ghosts)]
        return self.tickets[-1]

    def _ghosts(self) -> None:
        """ "later": copies said withdrawn land when another ticket is polled or cancelled
        (the copy engine ran what it was given after all)."""
        for ticket in self.tickets:
            if ticket.ok is False and ticket.inner is None and not ticket.withdrawn:
                ticket._land()

    def d2h(self, src: list[int], dst: list[int]) -> object:
        return self._ticket(lambda: self.inner.d2h(src, dst), len(src))

    def h2d(self, src: list[int], dst: list[int], layer_events: object = None) -> object:
        return self._ticket(lambda: self.inner.h2d(src, dst, layer_events), len(src))  # type: ignore[arg-type]


@pytest.mark.parametrize("lying", ["no", "at-wait", "later"])
def test_the_real_machine_catches_a_cancel_that_lies(lying: str) -> None:
    """A mover whose copies land late: with an honest ``cancel`` the real machine passes;
    with one that says it withdrew a copy that lands all the same, the machine fails
    naming the copy and its pages: the copy landing at the ticket's ``wait``, or after it
    (a cancelled ticket's ``wait`` returns at once; the copy lands when the mover issues
    its next one, into pages the cache gave back)."""
    movers: list[_LateMover] = []

    def mover(cache: HiCache) -> DeviceMover:
        movers.append(_LateMover(cache.device, lying))
        return movers[-1]  # type: ignore[return-value]

    cls = machines_over(device=mover).real
    config = settings(
        max_examples=100, stateful_step_count=40, derandomize=True, database=None, phases=[Phase.generate]
    )
    if lying == "no":
        run_state_machine_as_test(cls, settings=config)
        return
    landed = "which then landed" if lying == "at-wait" else "which landed after the ticket's wait returned"
    with pytest.raises(AssertionError, match=rf"cancel said it withdrew a (H2D|D2H) copy, {landed}"):
        run_state_machine_as_test(cls, settings=config)


def test_testing_md_s_own_test_suite_snippet_runs_as_written() -> None:
    """The "In your own test suite" block of TESTING.md defines its factories and passes
    (fewer runs per machine here: the sweep alone takes every transition)."""
    doc = (EXAMPLE.parents[1] / "TESTING.md").read_text()
    block = doc.split("In your own test suite:", 1)[1].split("```python\n", 1)[1].split("```", 1)[0]
    assert block.count("max_examples=50") == 1
    scope: dict[str, Any] = {"__name__": "testing_md_snippet"}
    exec(compile(block.replace("max_examples=50", "max_examples=2"), "TESTING.md", "exec"), scope)
    scope["test_my_pool_and_mover_under_the_facade_machines"]()
