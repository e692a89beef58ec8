"""README.md's code blocks run as written.

Every fenced block is claimed here, or the test fails:

- ``python``: run in a fresh process in a temporary directory; exit 0, and its stdout is the
  ``text`` block that follows it, if one does;
- ``bash``: one command per line (comments dropped). ``python ...`` commands run like the
  python blocks (a ``text`` block after the block shows its last command's output); any
  other command needs an entry in ``CHECKED`` (checked without running it) or ``NOT_RUN``
  (with the reason);
- ``text`` right after a code block is that block's output; anywhere else it must be
  listed in ``PICTURES``.

In shown output a decimal number (``5.53``) is a measurement and may differ; so may every
number on the lines in ``VARYING`` (which tier served a request depends on how fast the
backups ran).
"""

from __future__ import annotations

import re
import shlex
import subprocess
import sys
import tomllib
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import pytest
from markdown_it import MarkdownIt

ROOT = Path(__file__).resolve().parent.parent
README = ROOT / "README.md"
TIMEOUT_S = 900  # the engine blocks build a model; a loaded CI machine is slow

VARYING = ("prompt KV from:", "cached tokens by tier:")
PICTURES = {"L1  GPU page pool": "the tiers and a page run's transfers"}
NOT_RUN = {
    "pip install torch --index-url https://download.pytorch.org/whl/cpu": "needs the network; "
    "scripts/setup.sh installs torch",
    "bash scripts/test.sh": "the test command: it runs this test (CI's .ci/run runs exactly it)",
    "bash scripts/run.sh": "the main job (~30 s, more on a busy machine); tests/test_bench.py runs both of its "
    "benchmarks small",
}


def _extras() -> set[str]:
    pyproject = tomllib.loads((ROOT / "pyproject.toml").read_text())
    return set(pyproject["project"]["optional-dependencies"])


def _check_pip_install(command: str) -> None:
    """Installs ``.`` with extras that pyproject.toml declares (tests/test_packaging.py
    installs ``.[engine]`` into a clean venv and runs the CLI)."""
    (target,) = shlex.split(command)[2:]
    m = re.fullmatch(r"\.(?:\[([\w,-]+)\])?", target)
    assert m, f"{command!r}: installs {target!r}, not the checkout"
    missing = set((m[1] or "").split(",")) - {""} - _extras()
    assert not missing, f"{command!r}: pyproject.toml has no extra {sorted(missing)}"


def _check_ci_runs_the_test_command(command: str) -> None:
    """CI's script runs exactly this command."""
    lines = [ln for ln in (ROOT / ".ci" / "run").read_text().splitlines() if ln and not ln.startswith(("#", "set "))]
    assert lines[-1] == command, f".ci/run ends with {lines[-1]!r}, the README says CI runs {command!r}"


CHECKED: dict[str, Callable[[str], None]] = {
    "pip install '.[engine]'": _check_pip_install,
    "bash scripts/test.sh": _check_ci_runs_the_test_command,
}


@dataclass(frozen=True)
class Block:
    lang: str
    text: str
    line: int  # 1-based line of the opening fence
    output: str | None  # the text block right after it


def readme_blocks() -> list[Block]:
    """README's fenced blocks (a ``text`` block following a code block becomes its output)."""
    tokens = [t for t in MarkdownIt().parse(README.read_text()) if t.level == 0]
    blocks: list[Block] = []
    for i, tok in enumerate(tokens):
        if tok.type != "fence":
            continue
        assert tok.map is not None
        lang = tok.info.strip()
        after = tokens[i + 1] if i + 1 < len(tokens) else None
        output = after.content if after is not None and after.type == "fence" and after.info.strip() == "text" else None
        before = tokens[i - 1] if i else None
        if lang == "text" and before is not None and before.type == "fence" and before.info.strip() != "text":
            continue  # an output, checked with its block
        blocks.append(Block(lang, tok.content, tok.map[0] + 1, output))
    return blocks


def commands(block: Block) -> list[str]:
    """A bash block's commands, one a line, comments dropped."""
    out = []
    for line in block.text.splitlines():
        command = re.sub(r"\s+#.*$", "", line).strip()
        if command and not command.startswith("#"):
            out.append(command)
    return out


def output_pattern(shown: str) -> re.Pattern[str]:
    """``shown`` as a pattern: decimals, and any number on a VARYING line, may differ."""
    lines = []
    for line in shown.rstrip("\n").splitlines():
        number = r"\d+" if line.startswith(VARYING) else r"\d+\.\d+"
        lines.append(number.join(re.escape(part) for part in re.split(number, line)))
    return re.compile("\n".join(lines) + "\n?")


def run(argv: list[str], cwd: Path) -> str:
    """stdout of ``argv``, which must exit 0."""
    done = subprocess.run(argv, cwd=cwd, capture_output=True, text=True, timeout=TIMEOUT_S)
    assert done.returncode == 0, f"exit {done.returncode}\n{done.stdout[-3000:]}\n{done.stderr[-3000:]}"
    return done.stdout


def check_output(block: Block, stdout: str) -> None:
    if block.output is not None:
        assert output_pattern(block.output).fullmatch(stdout), (
            f"README line {block.line}: the output differs from what the README shows:\n{stdout}"
        )


BLOCKS = readme_blocks()


@pytest.mark.parametrize("block", BLOCKS, ids=[f"{b.lang or 'plain'}@{b.line}" for b in BLOCKS])
def test_readme_block_runs_as_written(block: Block, tmp_path: Path) -> None:
    """The block runs (or is checked, or is listed with the reason it is not run) and prints
    what the README shows."""
    if block.lang == "python":
        script = tmp_path / "snippet.py"
        script.write_text(block.text)
        check_output(block, run([sys.executable, str(script)], tmp_path))
    elif block.lang == "bash":
        cmds = commands(block)
        assert cmds, f"README line {block.line}: an empty bash block"
        last = ""
        for command in cmds:
            argv = shlex.split(command)
            if argv[0] == "python":
                last = run([sys.executable, *argv[1:]], tmp_path)
            elif command in CHECKED:
                CHECKED[command](command)
            else:
                assert command in NOT_RUN, f"README line {block.line}: {command!r} is neither run nor listed here"
        check_output(block, last)
    elif block.lang == "text":
        assert any(block.text.lstrip().startswith(p) for p in PICTURES), (
            f"README line {block.line}: a text block that is no block's output nor a listed picture"
        )
    else:
        pytest.fail(f"README line {block.line}: a {block.lang or 'plain'!r} block; this test runs python and bash")


def test_every_listed_command_is_in_the_readme() -> None:
    """NOT_RUN, CHECKED and PICTURES name only what the README holds (no stale exemptions)."""
    written = {c for b in BLOCKS if b.lang == "bash" for c in commands(b)}
    assert set(NOT_RUN) | set(CHECKED) <= written
    texts = [b.text.lstrip() for b in BLOCKS if b.lang == "text"]
    assert all(any(t.startswith(p) for t in texts) for p in PICTURES)


def test_readme_fits_in_8_kib() -> None:
    """The front door stays short: README.md is at most 8 KiB."""
    assert len(README.read_bytes()) <= 8192


def test_readme_links_resolve() -> None:
    """Every relative link in README.md names a file in the repository."""
    targets = re.findall(r"\]\(([^)#\s]+)(?:#[^)]*)?\)", README.read_text())
    missing = [t for t in targets if "://" not in t and not (ROOT / t).exists()]
    assert not missing, f"README links to missing files: {missing}"


def test_readme_extras_exist() -> None:
    """Every extra the README names (`[name]`) is declared in pyproject.toml."""
    named = set(re.findall(r"`\[([\w-]+)\]`", README.read_text()))
    assert named, "the README names no extra"
    assert named <= _extras(), f"not in pyproject.toml: {sorted(named - _extras())}"
