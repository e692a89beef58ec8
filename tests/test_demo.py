"""``python -m hicache.demo``: runs, and answers bad flags with one error line (no usage block, no traceback)."""

from __future__ import annotations

import re

import pytest

from hicache import demo


def test_the_demo_runs_and_brings_a_prompt_back_from_every_tier(capsys: pytest.CaptureFixture[str]) -> None:
    """A small run prints the hit lengths and the final status."""
    demo.main(["--page-size", "4", "--prompt-tokens", "32"])
    out = capsys.readouterr().out
    assert out.startswith("hicache core demo: page size 4, prompts of 32 tokens sharing 16")
    assert '"leases": 0' in out


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--page-size", "0"], "--page-size 0: must be an integer in [1, 65,536]"),
        (["--page-size", "-1"], "--page-size -1: must be an integer in [1, 65,536]"),
        (["--page-size", "x"], "--page-size x: not an integer"),
        (["--seed", "1.5"], "--seed 1.5: not an integer"),
        (["--page-sise", "4"], "--page-sise 4: unknown flag (did you mean --page-size?)"),
        (["4"], "4: not a flag (every setting is a --flag; see --help)"),
        (["--prompt-tokens", "5"], "--prompt-tokens 5: must be at least two pages (32 tokens)"),
        (["--page-size", "2000"], "--page-size 2000: must be at most 500 (the 1000-token prompt must hold two pages)"),
        (
            ["--page-size", "2000", "--prompt-tokens", "1000"],
            "--prompt-tokens 1000: must be at least two pages (4000 tokens)",
        ),
        (["--page-size", "70000"], "--page-size 70000: must be an integer in [1, 65,536]"),
        (["--seed", "-1"], "--seed -1: must be an integer >= 0"),
        (
            ["--prompt-tokens", str(10**12)],
            f"--prompt-tokens {10**12}: at most 1000000 (the demo holds every token in memory)",
        ),
    ],
)
def test_bad_sizes_are_a_usage_error(argv: list[str], message: str, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exc:
        demo.main(argv)
    err = capsys.readouterr().err
    assert exc.value.code == 2
    assert err == f"error: {message}\n"  # one line, as the engine's command line answers


@pytest.mark.parametrize(("page_size", "tokens"), [(16, 48), (16, 80), (16, 1008), (1, 3), (1, 5), (2, 7)])
def test_the_demo_runs_for_any_prompt_of_at_least_two_pages(
    page_size: int, tokens: int, capsys: pytest.CaptureFixture[str]
) -> None:
    """An odd number of pages, a partial last page: the demo still brings A back from L3."""
    demo.main(["--page-size", str(page_size), "--prompt-tokens", str(tokens)])
    out = capsys.readouterr().out
    whole = tokens - tokens % page_size
    (line,) = [x for x in out.splitlines() if x.strip().startswith("A after H2D")]
    assert re.search(r"hit L1=\s*(\d+)", line) is not None
    assert int(re.search(r"hit L1=\s*(\d+)", line).group(1)) == whole  # type: ignore[union-attr]
    assert "check_integrity(): passed" in out
