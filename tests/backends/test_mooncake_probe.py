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


@pytest.mark.parametrize(
    ("key", "value", "says"),
    [
        ("global_segment_size", "20000000tb", "at most 1 PiB"),
        ("global_segment_size", 2**64, "at most 1 PiB"),
        ("local_buffer_size", "2048tb", "at most 1 PiB"),
        ("local_buffer_size", "1" + "0" * 400, "at most 1 PiB"),
        ("local_buffer_size", "1" + "0" * 400 + "gb", "at most 1 PiB"),
        ("connect_timeout_s", 10**400, "up to 1e9"),
        ("connect_timeout_s", float("nan"), "up to 1e9"),
        ("local_hostname", "host\x00name", "NUL"),  # C++ would read it cut at the NUL
        ("metadata_server", "P2PHANDSHAKE\x00", "NUL"),
        ("master_server_address", "127.0.0.1\x00:50051", "host:port"),
    ],
)
def test_values_mooncakes_setup_cannot_take_are_config_errors(key: str, value: object, says: str) -> None:
    """Sizes past 2**64 were a TypeError from Mooncake's setup, a huge local buffer a
    MemoryError from its C++, and a long digit string an OverflowError while parsing it; a
    string with a NUL reached the C++ cut short."""
    from hicache.errors import ConfigError

    with pytest.raises(ConfigError, match=says):
        mooncake.MooncakeConfig.from_extra({"master_server_address": "127.0.0.1:50051", key: value})


def test_sizes_up_to_a_pebibyte_are_taken() -> None:
    config = mooncake.MooncakeConfig.from_extra(
        {"master_server_address": "127.0.0.1:50051", "global_segment_size": "1024tb", "local_buffer_size": "16mb"}
    )
    assert (config.global_segment_size, config.local_buffer_size) == (1 << 50, 16 << 20)
