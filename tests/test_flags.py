"""``hicache.flags``: the one parser of every hicache command (one error line, exit 2) and
its number types, without the engine behind it."""

from __future__ import annotations

import subprocess
import sys

import pytest

from hicache.flags import ArgParser, nonneg_float, positive_int


def parser() -> ArgParser:
    ap = ArgParser("prog")
    ap.add_argument("--ratio", type=nonneg_float, default=1.0)
    ap.add_argument("--count", type=positive_int, default=1)
    ap.add_argument("--on", action="store_true")
    return ap


@pytest.mark.parametrize(
    ("word", "reason"),
    [
        ("-inf", "not a finite number"),
        ("-Infinity", "not a finite number"),
        ("-nan", "not a finite number"),
        ("-1e9", "must be >= 0"),
        ("-1E-3", "must be >= 0"),
        ("-.5", "must be >= 0"),
        ("-2.", "must be >= 0"),
        ("-7", "must be >= 0"),
    ],
)
def test_a_negative_number_is_a_value_not_a_flag(word: str, reason: str, capsys: pytest.CaptureFixture[str]) -> None:
    """argparse alone reads ``-inf`` or ``-1e9`` as a flag ("expected one argument"): the
    value reaches its type, which says why it is refused."""
    with pytest.raises(SystemExit) as exc:
        parser().parse_args(["--ratio", word])
    assert exc.value.code == 2
    assert capsys.readouterr().err == f"error: --ratio {word}: {reason}\n"


@pytest.mark.parametrize("word", ["-x", "--count", "-e5", "-inf1", "-1e"])
def test_a_word_that_is_not_a_number_stays_a_flag(word: str, capsys: pytest.CaptureFixture[str]) -> None:
    """Only whole numbers are taken as values: the flag still misses its argument."""
    with pytest.raises(SystemExit) as exc:
        parser().parse_args(["--ratio", word])
    assert exc.value.code == 2
    assert capsys.readouterr().err == "error: --ratio: expected one argument\n"


def test_good_values_parse_and_keep_their_text() -> None:
    args = parser().parse_args(["--ratio", "1e3", "--count", "3", "--on"])
    assert (args.ratio, args.count, args.on) == (1000.0, 3, True)
    assert args.ratio.text == "1e3"
    args = parser().parse_args(["--ratio", " .5 ", "--count", "+7"])  # a shell's quoted spaces, a sign
    assert (args.ratio, args.count) == (0.5, 7)


@pytest.mark.parametrize(
    ("argv", "line"),
    [
        (["--on=1"], "error: --on 1: the flag takes no value"),
        (["--cont", "2"], "error: --cont 2: unknown flag (did you mean --count?)"),
        (["stray"], "error: stray: not a flag (every setting is a --flag; see --help)"),
        (["--count", "3", "4"], "error: 4: not a flag (--count takes one value; see --help)"),
        (["--count=3", "4"], "error: 4: not a flag (--count takes one value; see --help)"),
        (["--on", "4"], "error: 4: not a flag (every setting is a --flag; see --help)"),
        (["--count", "a\nb"], "error: --count 'a\\nb': not an integer"),
        # NOTE: what Python's int() and float() take but no one types as a number on purpose
        (["--count", "1_6"], "error: --count 1_6: not an integer"),
        (["--count", "\u0661\u0666"], "error: --count \u0661\u0666: not an integer"),
        (["--count", "1e3"], "error: --count 1e3: not an integer"),
        (["--count", "0x10"], "error: --count 0x10: not an integer"),
        (["--count", ""], "error: --count '': not an integer"),
        (["--ratio", "1_0.5"], "error: --ratio 1_0.5: not a number"),
        (["--ratio", "\uff11"], "error: --ratio \uff11: not a number"),
    ],
)
def test_every_error_is_one_line(argv: list[str], line: str, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exc:
        parser().parse_args(argv)
    assert exc.value.code == 2
    assert capsys.readouterr().err == line + "\n"


def test_the_light_commands_load_neither_the_engine_nor_transformers() -> None:
    """The demo, the explorers and the bad-input catalogue take the parser without the
    engine: they run where transformers is not installed."""
    code = (
        "import sys, hicache.flags, hicache.demo, hicache.spec.explorer, hicache.testing.explore_core, "
        "hicache.testing.bad_inputs; "
        "print(sorted(m for m in sys.modules if m.startswith(('transformers', 'hicache.engine'))))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True)
    assert out.stdout.strip() == "[]"


def test_a_flag_given_again_overrides_as_argparse_does() -> None:
    """A command line built as defaults then overrides (``$BASE --requests 3``) keeps the
    last value of a one-value flag; flags that collect keep them all."""
    ap = parser()
    ap.add_argument("--config", action="append")
    args = ap.parse_args(["--count", "2", "--config", "a", "--count", "3", "--config", "b"])
    assert (args.count, args.config) == (3, ["a", "b"])
