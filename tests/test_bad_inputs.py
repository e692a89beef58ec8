"""Every bad input of the catalogue gets its typed error naming the value, and changes
nothing; docs/RELIABILITY.md shows exactly this catalogue."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from hicache.testing.bad_inputs import BadInput, catalogue, markdown

CASES = catalogue()


@pytest.mark.parametrize("case", CASES, ids=[f"{c.area}: {c.what}" for c in CASES])
def test_bad_input_is_refused_clearly(case: BadInput) -> None:
    before = case.state() if case.state else None
    with pytest.raises(case.error) as info:
        case.run()
    assert case.message in str(info.value), str(info.value)
    assert type(info.value) is case.error, f"{type(info.value).__name__}, not the {case.error.__name__} listed"
    if case.state is not None:
        assert case.state() == before, "a refused call changed the state"


def test_reliability_doc_lists_the_catalogue() -> None:
    doc = (Path(__file__).resolve().parent.parent / "docs" / "RELIABILITY.md").read_text()
    assert markdown() in doc, "docs/RELIABILITY.md is out of date: python -m hicache.testing.bad_inputs"


def test_the_catalogue_leaves_no_files_behind(tmp_path: Path) -> None:
    """Its scratch directories (a symlink, a too-large store) go when the process exits."""
    scratch = tmp_path / "tmp"
    scratch.mkdir()
    code = (
        "from hicache.testing.bad_inputs import catalogue\n"
        "for c in catalogue():\n"
        "    try:\n"
        "        c.run()\n"
        "    except Exception:\n"
        "        pass\n"
    )
    env = {**os.environ, "TMPDIR": str(scratch)}
    subprocess.run([sys.executable, "-c", code], env=env, check=True, timeout=120)
    left = [p.name for p in scratch.iterdir() if not p.name.startswith("torchinductor")]  # torch's own cache
    assert not left


def test_the_catalogue_printed_to_a_reader_that_went_away_ends_quietly() -> None:
    """``python -m hicache.testing.bad_inputs | head -1``: the reader gone, the command
    stops with 141 and no traceback, as the explorers do."""
    import subprocess
    import sys

    proc = subprocess.Popen(
        [sys.executable, "-m", "hicache.testing.bad_inputs"],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    assert proc.stdout is not None
    proc.stdout.close()  # NOTE: before it writes: every write then fails (EPIPE), deterministically
    _, err = proc.communicate(timeout=300)
    assert "Traceback" not in err, err[-2000:]
    assert proc.returncode == 141, err[-2000:]
