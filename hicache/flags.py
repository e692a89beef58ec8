"""Command-line flags for every hicache command: one parser whose errors are one line,
``error: --flag VALUE: reason`` (exit status 2), and the number types it reads values with.

Light on purpose (argparse and the standard library only): ``python -m hicache.demo``, the
explorers in ``hicache.testing`` and ``docs/examples/fuzz_my_loop.py`` use it without loading
torch's engine or transformers; ``hicache.engine.cli`` adds the engine's flags on top.
"""

from __future__ import annotations

import argparse
import copy
import difflib
import json
import math
import re
import sys
from collections.abc import Callable, Sequence
from typing import Any, NoReturn

from hicache.errors import ConfigError

# A negative number as a value, not a flag: integers, decimals, exponents, inf and nan.
_NEGATIVE = re.compile(r"^-(?:(?:\d+\.?\d*|\.\d+)(?:e[-+]?\d+)?|inf(?:inity)?|nan)$", re.IGNORECASE)


class FlagError(ConfigError):
    """A flag's value is unusable; the message reads ``--flag VALUE: reason``."""

    def __init__(self, flag: str | None, value: object, reason: str) -> None:
        # NOTE: a flag that was not given (value None) is named alone: "--flag: reason"
        shown = f"{flag}: {reason}" if value is None else f"{flag} {_show(value)}: {reason}"
        super().__init__(shown if flag else reason)
        self.flag, self.value, self.reason = flag, value, reason


class Written(float):
    """A number flag's value that keeps the text it was written as: a message names
    ``--hicache-size 1e9`` as typed, not as ``1e+09``."""

    text: str

    def __new__(cls, value: float, text: str = "") -> Written:
        out = super().__new__(cls, value)
        out.text = text
        return out

    def __reduce__(self) -> tuple[type[Written], tuple[float, str]]:  # pickle and deepcopy keep the text
        return Written, (float(self), self.text)


def _show(value: object) -> str:
    """``value`` as written on a command line (quoted when it holds spaces)."""
    if isinstance(value, float):
        return getattr(value, "text", None) or f"{value:g}"
    text = value if isinstance(value, str) else json.dumps(value) if isinstance(value, dict) else str(value)
    return text if text and text.isprintable() and " " not in text else repr(text)


# -- argument types: each failure reads "VALUE: reason" (ArgParser.error adds the flag) -----


# What a number flag takes: ASCII digits, a sign, a decimal point and an exponent (floats),
# inf and nan (refused as not finite); Python's int() and float() also take "1_000" and
# other scripts' digits, which no one writes on a command line on purpose.
_INT_TEXT = re.compile(r"\s*[-+]?\d+\s*", re.ASCII)
_FLOAT_TEXT = re.compile(
    r"\s*[-+]?(?:(?:\d+\.?\d*|\.\d+)(?:e[-+]?\d+)?|inf(?:inity)?|nan)\s*", re.ASCII | re.IGNORECASE
)


def strict_int(text: str) -> int:
    """``int(text)`` for what a person writes as an integer (``_INT_TEXT``), else ValueError."""
    if not _INT_TEXT.fullmatch(text):
        raise ValueError(f"not an integer: {text!r}")
    return int(text)


def strict_float(text: str) -> float:
    """``float(text)`` for what a person writes as a number (``_FLOAT_TEXT``), else ValueError."""
    if not _FLOAT_TEXT.fullmatch(text):
        raise ValueError(f"not a number: {text!r}")
    return float(text)


def _number(kind: Callable[[str], float], text: str, what: str) -> float:
    try:
        value = (strict_int if kind is int else strict_float)(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{_show(text)}: not {what}") from None
    if not math.isfinite(value):
        raise argparse.ArgumentTypeError(f"{_show(text)}: not a finite number")
    return value


def integer(text: str) -> int:
    return int(_number(int, text, "an integer"))


def positive_int(text: str) -> int:
    value = int(_number(int, text, "an integer"))
    if value < 1:
        raise argparse.ArgumentTypeError(f"{_show(text)}: must be an integer >= 1")
    return value


def int_between(low: int, high: int) -> Callable[[str], int]:
    """An argparse type: an int in ``[low, high]`` (a workload far past ``high`` would only
    fill memory before anything runs)."""

    def parse(text: str) -> int:
        value = int(_number(int, text, "an integer"))
        if not low <= value <= high:
            raise argparse.ArgumentTypeError(f"{_show(text)}: must be an integer in [{low:,}, {high:,}]")
        return value

    return parse


def nonneg_int(text: str) -> int:
    value = int(_number(int, text, "an integer"))
    if value < 0:
        raise argparse.ArgumentTypeError(f"{_show(text)}: must be an integer >= 0")
    return value


def nonneg_float(text: str) -> float:
    """A ratio or a size in GiB: >= 0, and at most 1e9 (past that it only names a pool no
    machine has, in a message hundreds of digits long)."""
    value = _number(float, text, "a number")
    if value < 0:
        raise argparse.ArgumentTypeError(f"{_show(text)}: must be >= 0")
    if value > 1e9:
        raise argparse.ArgumentTypeError(f"{_show(text)}: must be at most 1e9")
    return Written(value, text.strip())


def positive_float(text: str) -> float:
    value = _number(float, text, "a number")
    if value <= 0:
        raise argparse.ArgumentTypeError(f"{_show(text)}: must be > 0")
    return Written(value, text.strip())


def port(text: str) -> int:
    value = int(_number(int, text, "an integer"))
    if not 0 <= value <= 65535:
        raise argparse.ArgumentTypeError(f"{_show(text)}: must be a port in [0, 65535] (0: any free port)")
    return value


class _Formatter(argparse.RawDescriptionHelpFormatter, argparse.ArgumentDefaultsHelpFormatter):
    """The module docstring as written, every flag's default (unless None or False), and
    short metavars (N, X, PORT, PATH)."""

    def _get_help_string(self, action: argparse.Action) -> str | None:
        if action.default is None or action.default is False:
            return action.help
        return super()._get_help_string(action)

    def _expand_help(self, action: argparse.Action) -> str:
        if isinstance(action.default, float):  # 2, as ENGINE.md's table and the error lines write it: not 2.0
            action = copy.copy(action)
            action.default = _show(action.default)
        return super()._expand_help(action)

    def _get_default_metavar_for_optional(self, action: argparse.Action) -> str:
        kinds = {
            positive_int: "N",
            nonneg_int: "N",
            integer: "N",
            int: "N",
            nonneg_float: "X",
            positive_float: "X",
            port: "PORT",
        }
        return kinds.get(action.type, action.dest.rsplit("_", 1)[-1].upper())


_CHOICE = re.compile(r"argument (\S+?)(?:/\S+)?: invalid choice: '?(.*?)'? \(choose from (.*)\)$")
_ARGUMENT = re.compile(r"argument (\S+?)(?:/\S+)?: (.*)$")
_EXPLICIT = re.compile(r"argument (\S+): ignored explicit argument (['\"])(.*)\2$", re.S)


def _long(names: str) -> str:
    """The long name of an argument argparse names ``-h/--help``."""
    return next((n for n in names.split("/") if n.startswith("--")), names.split("/")[0])


class ArgParser(argparse.ArgumentParser):
    """Errors as one line, ``error: --flag VALUE: reason``, exit status 2."""

    def __init__(self, prog: str, description: str | None = None) -> None:
        super().__init__(prog=prog, description=description, formatter_class=_Formatter, allow_abbrev=False)
        # NOTE: argparse reads a word as a flag unless it looks like a negative number, and
        # its pattern knows neither exponents nor inf/nan: "--hicache-ratio -inf" would say
        # "expected one argument" instead of why -inf is refused
        self._negative_number_matcher = _NEGATIVE

    def parse_args(self, args: Sequence[str] | None = None, namespace: Any = None) -> Any:  # type: ignore[override]
        parsed, extra = self.parse_known_args(args, namespace)
        if extra:  # NOTE: the words as given (argparse's own error joins them with spaces)
            self.error(self._unknown(extra, list(sys.argv[1:] if args is None else args)))
        return parsed

    def error(self, message: str) -> NoReturn:
        if m := _CHOICE.match(message):
            choices = m[3].replace("'", "")
            message = f"{m[1]} {_show(m[2])}: invalid choice (choose from {choices})"
        elif m := _EXPLICIT.match(message):
            message = f"{_long(m[1])} {_show(m[3])}: the flag takes no value"
        elif m := _ARGUMENT.match(message):
            flag, reason = m[1], m[2]
            reason = re.sub(r"^invalid \w+ value: '(.*)'$", r"\1: invalid value", reason, flags=re.S)
            message = f"{flag}: {reason}" if reason.startswith("expected") else f"{flag} {reason}"
        line = message.replace("\n", "\\n").replace("\r", "\\r")  # NOTE: one line, whatever a value held
        self.exit(2, f"error: {line}\n")

    def _unknown(self, words: list[str], argv: list[str]) -> str:
        """The first unknown flag and its value, or the first stray word, with a reason."""
        flag = next((i for i, w in enumerate(words) if w.startswith("-") and w != "-"), None)
        if flag is None:
            return f"{_show(words[0])}: not a flag ({self._takes_one(words[0], argv)}see --help)"
        name, eq, inline = words[flag].partition("=")
        value = [inline] if eq else words[flag + 1 :][:1]
        near = difflib.get_close_matches(name, [o for o in self._option_string_actions if o.startswith("--")], 1, 0.75)
        hint = f" (did you mean {near[0]}?)" if near else " (see --help)"
        shown = f"{_show(name)} {_show(value[0])}" if value and (eq or not value[0].startswith("-")) else _show(name)
        return f"{shown}: unknown flag{hint}"

    def _takes_one(self, word: str, argv: list[str]) -> str:
        """Why a stray word is there: after ``--flag VALUE`` (or ``--flag=VALUE``) of a flag
        that takes one value, it is a second value (``--prefix-tokens 350 3500``)."""
        at = argv.index(word) if word in argv else -1
        for before, inline in ((at - 1, True), (at - 2, False)):
            if before < 0:
                continue
            name, eq, _ = argv[before].partition("=")
            action = self._option_string_actions.get(name)
            if action is not None and action.nargs is None and bool(eq) == inline and name.startswith("--"):
                return f"{_long('/'.join(action.option_strings))} takes one value; "
        return "every setting is a --flag; "


def given_flags(ap: argparse.ArgumentParser, argv: Sequence[str]) -> set[str]:
    """The ``dest`` of every flag written in ``argv`` (``--flag value`` or ``--flag=value``)."""
    actions = ap._option_string_actions
    return {actions[t.split("=", 1)[0]].dest for t in argv if t.split("=", 1)[0] in actions}
