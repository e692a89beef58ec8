"""The Mooncake store's setup probe (a fresh process that sets up a client): why it failed
is what the probe said, not a guess."""

from __future__ import annotations

import pytest

from hicache.backends.stores import mooncake


@pytest.mark.parametrize(
    ("code", "expected"),
    [
        ("print('rc', 0, flush=True)", None),
        ("print('rc', -1, flush=True)", "setup failed: -1"),
        (
            "import sys\nprint('loading', file=sys.stderr)\n"
            "raise ImportError('libibverbs.so.1: cannot open shared object file')",
            "the setup probe exited (1) before an answer: ImportError: libibverbs.so.1: cannot open shared object file",
        ),
        ("import sys\nsys.exit(3)", "the setup probe exited (3) before an answer: no output"),
    ],
)
def test_the_probe_reports_what_the_process_said(
    monkeypatch: pytest.MonkeyPatch, code: str, expected: str | None
) -> None:
    """A client library that cannot load was reported as 'no answer from the master': the
    probe now names the last line the process printed before it exited."""
    monkeypatch.setattr(mooncake, "_PROBE", code)
    assert mooncake._probe(["127.0.0.1"], 60.0) == expected


def test_a_probe_that_never_answers_is_no_answer_from_the_master(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(mooncake, "_PROBE", "import time\ntime.sleep(600)")
    assert mooncake._probe(["127.0.0.1"], 0.2) == "no answer from the master within 0.2 s (setup probe)"
