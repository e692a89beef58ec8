"""``python -m hicache.engine``: one-line errors naming the flag, warnings for flags that do
nothing, failed requests reported apart from the figures, a deterministic workload."""

from __future__ import annotations

import argparse
import json
import os
import re
import shlex
import socket
import subprocess
import sys
import urllib.request
from pathlib import Path
from typing import Any

import pytest
import torch
from prometheus_client.parser import text_string_to_metric_families

from hicache.engine import __main__ as cli_main
from hicache.engine.cli import engine_from_args, ineffective_flags
from hicache.engine.engine import Engine, Output
from hicache.errors import ConfigError
from hicache.facade import _host_memory
from hicache.metrics_http import MetricsServer
from tests.interrupts import run_with_import_interrupted

pytest.importorskip("transformers")

SMALL = ["--requests", "2", "--prefix-tokens", "20", "--suffix-tokens", "2", "--max-new-tokens", "1"]
PRESETS = "llama-tiny, qwen3-4b, qwen3-8b, tiny"
HOST_GIB = (_host_memory() or 0) / 2**30  # the machine's, or its container's limit where lower


def run_main(argv: list[str], capsys: pytest.CaptureFixture[str]) -> tuple[int, str, str]:
    """Exit status, stdout and stderr of ``main(argv)``."""
    try:
        code = cli_main.main(argv)
    except SystemExit as exc:
        code = int(exc.code or 0)
    out, err = capsys.readouterr()
    return code, out, err


def catalogue(tmp_path: Path) -> list[tuple[list[str], str]]:
    """(argv, the one line expected on stderr) for bad input."""
    missing = tmp_path / "no-such-dir" / "l3.bin"
    a_file = tmp_path / "a-file"
    a_file.write_text("")
    not_a_model = tmp_path / "not-a-model"  # a config.json transformers cannot read
    not_a_model.mkdir()
    (not_a_model / "config.json").write_text("{}")
    l3 = ["--enable-hicache", "--hicache-storage-ratio", "1"]
    return [
        (
            ["--num-pages", "10"],
            "error: --num-pages 10: no room in L1 for a prompt of 358 tokens "
            "(with 4 new tokens it needs 23 pages of 16)",
        ),
        (
            ["--prefix-tokens", "100000"],  # the flag written is named, not a default never typed
            "error: --prefix-tokens 100000: no room in L1 for a prompt of 100008 tokens "
            "(with 4 new tokens it needs 6251 pages of 16; --num-pages is 4096)",
        ),
        (["--num-pages", "0"], "error: --num-pages 0: must be an integer >= 1"),
        (["--num-pages", "-5"], "error: --num-pages -5: must be an integer >= 1"),
        (["--num-pages", "abc"], "error: --num-pages abc: not an integer"),
        (["--num-pages", "1.5"], "error: --num-pages 1.5: not an integer"),
        (["--num-pages"], "error: --num-pages: expected one argument"),
        (["--page-size", "0"], "error: --page-size 0: must be an integer in [1, 65,536]"),
        (["--max-batch", "0"], "error: --max-batch 0: must be an integer >= 1"),
        (["--requests", "0"], "error: --requests 0: must be an integer in [1, 100,000]"),
        (["--concurrency", "-1"], "error: --concurrency -1: must be an integer in [1, 100,000]"),
        (["--suffix-tokens", "-1"], "error: --suffix-tokens -1: must be an integer in [0, 1,000,000]"),
        (["--requests", "100001"], "error: --requests 100001: must be an integer in [1, 100,000]"),
        (["--hicache-ratio", "-1"], "error: --hicache-ratio -1: must be >= 0"),
        (["--hicache-size", "nan"], "error: --hicache-size nan: not a finite number"),
        # negative numbers argparse's own pattern would read as flags ("expected one argument")
        (["--hicache-ratio", "-inf"], "error: --hicache-ratio -inf: not a finite number"),
        (["--hicache-size", "-1e9"], "error: --hicache-size -1e9: must be >= 0"),
        (["--hicache-storage-ratio", "-.5"], "error: --hicache-storage-ratio -.5: must be >= 0"),
        (["--num-pages", "-NaN"], "error: --num-pages -NaN: not an integer"),
        (["--hicache-storage-size", "lots"], "error: --hicache-storage-size lots: not a number"),
        (["--hicache-prior-host-gib-s", "0"], "error: --hicache-prior-host-gib-s 0: must be > 0"),
        (["--dtype", "float8"], "error: --dtype float8: invalid choice (choose from auto, float32, bfloat16, float16)"),
        (
            ["--hicache-storage-backend", "s3"],
            "error: --hicache-storage-backend s3: invalid choice (choose from file, dir, mooncake)",
        ),
        (
            ["--hicache-policy", "sometimes"],
            "error: --hicache-policy sometimes: invalid choice (choose from cost, always, never)",
        ),
        (["--metrics-port", "70000"], "error: --metrics-port 70000: must be a port in [0, 65535] (0: any free port)"),
        (
            ["--hicache-storage-backend-extra-config", "{bad"],
            "error: --hicache-storage-backend-extra-config {bad: not valid JSON "
            "(Expecting property name enclosed in double quotes at column 2)",
        ),
        (
            ["--hicache-storage-backend-extra-config", "[1]"],
            "error: --hicache-storage-backend-extra-config [1]: must be a JSON object ({...})",
        ),
        (
            ["--hicache-storage-backend-extra-config", '{"master": 1}'],
            "error: --hicache-storage-backend-extra-config '{\"master\": 1}': unknown key 'master' (known: "
            "mooncake: master_server_address, metadata_server, protocol, local_hostname, device_name, "
            "global_segment_size, local_buffer_size, connect_timeout_s; dir: fsync)",
        ),
        (
            ["--hicache-storage-backend-extra-config", '{"connect_timeout_s":"x"}'],
            'error: --hicache-storage-backend-extra-config {"connect_timeout_s":"x"}: connect_timeout_s must be '
            "a number, got 'x'",
        ),
        (
            [
                *l3,
                "--hicache-storage-backend",
                "mooncake",
                "--hicache-storage-backend-extra-config",
                '{"master_server_address": "127.0.0.1:1", "connect_timeout_s": -1, "device_name": ""}',
            ],
            'error: --hicache-storage-backend-extra-config \'{"master_server_address": "127.0.0.1:1", '
            '"connect_timeout_s": -1, "device_name": ""}\': '
            "mooncake connect_timeout_s must be a positive number up to 1e9, got -1",
        ),
        (
            ["--hicache-storage-backend-extra-config", '{"fsync": 0}'],
            "error: --hicache-storage-backend-extra-config '{\"fsync\": 0}': fsync must be true or false, got 0",
        ),
        (
            [
                *l3,
                *["--hicache-storage-backend", "dir", "--hicache-storage-path", str(tmp_path / "kv")],
                *["--hicache-storage-backend-extra-config", '{"fsync": false, "protocol": "tcp"}'],
            ],
            'error: --hicache-storage-backend-extra-config \'{"fsync": false, "protocol": "tcp"}\': '
            "'protocol': for the mooncake backend, not dir (its keys: fsync)",
        ),
        (
            [
                *l3,
                *["--hicache-storage-backend", "mooncake", "--hicache-storage-backend-extra-config"],
                '{"master_server_address": "127.0.0.1:1", "fsync": true}',
            ],
            'error: --hicache-storage-backend-extra-config \'{"master_server_address": "127.0.0.1:1", '
            "\"fsync\": true}': 'fsync': for the dir backend, not mooncake (its keys: master_server_address, "
            "metadata_server, protocol, local_hostname, device_name, global_segment_size, local_buffer_size, "
            "connect_timeout_s)",
        ),
        (
            ["--hicache-storage-backend-extra-config", '{"protocol":5}'],
            'error: --hicache-storage-backend-extra-config {"protocol":5}: protocol must be a string, got 5',
        ),
        (
            [*l3, "--hicache-storage-backend", "mooncake"],  # the config it needs not given: named alone, no "None"
            "error: --hicache-storage-backend-extra-config: mooncake extra config needs master_server_address "
            "('host:port')",
        ),
        (["--frobnicate"], "error: --frobnicate: unknown flag (see --help)"),
        (["--hicache-rat", "2"], "error: --hicache-rat 2: unknown flag (did you mean --hicache-ratio?)"),
        (["--hicache-rat=2"], "error: --hicache-rat 2: unknown flag (did you mean --hicache-ratio?)"),
        (["--frobnicate", "--num-pages", "3"], "error: --frobnicate: unknown flag (see --help)"),
        (["tiny"], "error: tiny: not a flag (every setting is a --flag; see --help)"),
        (["--enable-hicache=1"], "error: --enable-hicache 1: the flag takes no value"),
        (["--enable-hicache=it's"], "error: --enable-hicache it's: the flag takes no value"),
        (["--help=3"], "error: --help 3: the flag takes no value"),
        ([""], "error: '': not a flag (every setting is a --flag; see --help)"),
        (["--device", "cpu", " "], "error: ' ': not a flag (--device takes one value; see --help)"),
        (["--num-pages=8", "9"], "error: 9: not a flag (--num-pages takes one value; see --help)"),
        (["--enable-hicache", "9"], "error: 9: not a flag (every setting is a --flag; see --help)"),
        (["--foo=a b"], "error: --foo 'a b': unknown flag (see --help)"),
        (["--foo", "a b"], "error: --foo 'a b': unknown flag (see --help)"),
        (["--foo\nbar"], "error: '--foo\\nbar': unknown flag (see --help)"),
        (["--page-size", "a\nb"], "error: --page-size 'a\\nb': not an integer"),
        (["--num-pages", " 0"], "error: --num-pages ' 0': must be an integer >= 1"),
        (["--device", "cpu:1"], "error: --device cpu:1: the host is one device, cpu (or cpu:0)"),
        (
            ["--suffix-tokens", "0", "--max-new-tokens", "70000"],  # the largest part of what does not fit
            "error: --max-new-tokens 70000: no room in L1 for a prompt of 350 tokens "
            "(with 70000 new tokens it needs 4397 pages of 16; --num-pages is 4096)",
        ),
        (
            ["--model", "nosuch"],
            f"error: --model nosuch: not a preset ({PRESETS}) nor a checkpoint directory (config.json)",
        ),
        (["--model", ""], f"error: --model '': not a preset ({PRESETS}) nor a checkpoint directory (config.json)"),
        (
            ["--model", str(tmp_path)],
            f"error: --model {tmp_path}: not a preset ({PRESETS}) nor a checkpoint directory (config.json)",
        ),
        (
            ["--model", str(not_a_model)],
            f"error: --model {not_a_model}: model '{not_a_model}': not a checkpoint transformers can load "
            f"(Unrecognized model in {not_a_model}. Should have a `model_type` key in its config.json.)",
        ),
        (["--device", "banana"], "error: --device banana: not a torch device (cpu, cuda or cuda:N)"),
        (["--device", "meta"], "error: --device meta: the engine runs on cpu or cuda"),
        (
            [*l3, "--hicache-storage-path", str(missing)],
            f"error: --hicache-storage-path {missing}: directory {missing.parent} does not exist",
        ),
        (
            [*l3, "--hicache-storage-path", str(a_file / "l3.bin")],
            f"error: --hicache-storage-path {a_file / 'l3.bin'}: directory {a_file} is not a directory",
        ),
        (
            [*l3, "--hicache-storage-path", str(tmp_path)],
            f"error: --hicache-storage-path {tmp_path}: is a directory; give a file path (backend file)",
        ),
        (
            [*l3, "--hicache-storage-backend", "dir"],
            "error: --hicache-storage-backend dir: needs --hicache-storage-path (a directory)",
        ),
        (
            [*l3, "--hicache-storage-backend", "dir", "--hicache-storage-path", str(tmp_path / ("n" * 300))],
            f"error: --hicache-storage-path {tmp_path / ('n' * 300)}: File name too long",
        ),
        (
            [*l3, "--hicache-storage-path", str(tmp_path / ("n" * 300))],
            f"error: --hicache-storage-path {tmp_path / ('n' * 300)}: File name too long",
        ),
        (
            [*l3, "--hicache-storage-backend", "dir", "--hicache-storage-path", str(a_file)],
            f"error: --hicache-storage-path {a_file}: not a directory (backend dir)",
        ),
        (
            [*l3, "--hicache-storage-backend", "dir", "--hicache-storage-path", str(not_a_model)],
            f"error: --hicache-storage-path {not_a_model}: L3 directory {not_a_model} is not empty and holds "
            "no hicache store (no FORMAT file; it has config.json); give an empty or new directory",
        ),
        (
            ["--enable-hicache", "--hicache-ratio", "0"],
            "error: --hicache-ratio 0: L2 would have no pages; --enable-hicache needs L2",
        ),
        (
            ["--enable-hicache", "--hicache-size", "0"],
            "error: --hicache-size 0: L2 would have no pages; --enable-hicache needs L2",
        ),
        (
            [*l3, "--hicache-storage-size", "1e-9"],
            "error: --hicache-storage-size 1e-9: less than one L3 page (8 KiB)",  # as written, not 1e-09
        ),
        (
            [*l3, "--hicache-storage-ratio", "0.0001"],
            "error: --hicache-storage-ratio 0.0001: less than one L3 page (4096 L1 pages x 0.0001; 0 turns L3 off)",
        ),
        (
            ["--enable-hicache", "--hicache-ratio", "0.0001"],
            "error: --hicache-ratio 0.0001: less than one L2 page (4096 L1 pages x 0.0001)",
        ),
        (
            [
                *l3,
                "--hicache-storage-backend",
                "mooncake",
                "--hicache-storage-backend-extra-config",
                '{"master_server_address": "nonsense"}',
            ],
            'error: --hicache-storage-backend-extra-config \'{"master_server_address": "nonsense"}\': '
            "mooncake master_server_address must be 'host:port', got 'nonsense'",
        ),
        (
            [
                *l3,
                "--hicache-storage-backend",
                "mooncake",
                "--hicache-storage-backend-extra-config",
                '{"master_server_address": "h:\u00b2"}',
            ],
            'error: --hicache-storage-backend-extra-config \'{"master_server_address": "h:\\\\u00b2"}\': '
            "mooncake master_server_address must be 'host:port', got 'h:\u00b2'",
        ),
        (
            [*l3, "--hicache-storage-backend", "dir", "--hicache-storage-path", ""],
            "error: --hicache-storage-path '': "
            "an empty path (a directory for dir, a file for file; leave out: unnamed)",
        ),
        (
            [*l3, "--hicache-storage-path", ""],
            "error: --hicache-storage-path '': "
            "an empty path (a directory for dir, a file for file; leave out: unnamed)",
        ),
        (
            ["--enable-hicache", "--hicache-prior-recompute-us", "1e-320"],
            "error: --hicache-prior-recompute-us 1e-320: cost prior recompute_s_per_token must be a positive "
            "number up to 1e300, got 0.0",
        ),
        (
            ["--enable-hicache", "--disable-hicache-prefetch", "--hicache-layered-restore", "on"],
            "error: --hicache-layered-restore on: a layered restore needs prefetch, which "
            "--disable-hicache-prefetch turns off (a blocking restore has no forward to overlap)",
        ),
    ]


def test_bad_input_catalogue_one_line_naming_the_flag_exit_2(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Every bad input exits 2 with exactly one stderr line, ``error: --flag VALUE: reason``,
    and nothing on stdout (no traceback, no half-run)."""
    for argv, expected in catalogue(tmp_path):
        code, out, err = run_main(argv, capsys)
        lines = [ln for ln in err.splitlines() if not ln.startswith("warning: ")]
        assert (code, lines, out) == (2, [expected], ""), argv


@pytest.mark.skipif(torch.cuda.is_available(), reason="needs a torch without CUDA devices")
def test_a_workload_past_the_checkpoints_context_is_a_flag_error(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """A checkpoint made for 64 positions: a workload whose requests need more is refused
    in one line naming the largest flag written and the model's context, exit 2; one that
    fits is served."""
    from hicache.engine.model import build_model

    net = build_model("tiny", device="cpu")
    net.config.max_position_embeddings = 64  # type: ignore[union-attr]
    net.save_pretrained(tmp_path)  # type: ignore[operator]
    base = ["--model", str(tmp_path), "--requests", "2", "--suffix-tokens", "2"]
    code, out, err = run_main([*base, "--prefix-tokens", "60", "--max-new-tokens", "3"], capsys)
    assert (code, out) == (2, "") and err.strip().splitlines()[-1] == (
        f"error: --prefix-tokens 60: a prompt of 62 tokens and 3 new needs 65 positions, "
        f"the model ({tmp_path}) has 64 (max_position_embeddings)"
    ), err
    code, out, err = run_main([*base, "--prefix-tokens", "59", "--max-new-tokens", "3"], capsys)
    assert code == 0 and "2 requests: 2 served, 0 failed" in out, (out, err)
    assert "Loading weights" not in err  # transformers' bar stays off the run's stderr


def test_cuda_device_on_a_cpu_only_torch_is_a_flag_error(capsys: pytest.CaptureFixture[str]) -> None:
    """``--device cuda`` without CUDA names the flag and the torch build, exit 2."""
    code, _, err = run_main(["--device", "cuda"], capsys)
    why = "this torch has no CUDA support" if torch.version.cuda is None else "no CUDA device is visible"
    assert code == 2
    assert err == f"error: --device cuda: {why} (torch {torch.__version__}); use --device cpu\n"


@pytest.mark.parametrize(
    "exc",
    [
        RuntimeError("[enforce fail at alloc_cpu.cpp:127] DefaultCPUAllocator: can't allocate memory: 40 GB"),
        torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 20.00 GiB"),
        MemoryError(),
    ],
)
def test_running_out_of_memory_while_building_is_one_line(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str], exc: BaseException
) -> None:
    """The host or the device out of memory while the model and engine are built: one line
    naming the model and the flags that shrink it, exit 1, no traceback."""

    def build(*args: object, **kwargs: object) -> object:
        raise exc

    monkeypatch.setattr("hicache.engine.cli.build_model", build)
    code, out, err = run_main(["--model", "tiny", "--requests", "1"], capsys)
    assert code == 1 and out == ""
    assert err.startswith("error: out of memory building the model (tiny) and the engine on cpu: ")
    assert err.endswith("; try a smaller --model, --num-pages or --dtype bfloat16\n") and err.count("\n") == 1


def test_another_runtime_error_while_building_is_not_called_memory(monkeypatch: pytest.MonkeyPatch) -> None:
    def build(*args: object, **kwargs: object) -> object:
        raise RuntimeError("some other failure")

    monkeypatch.setattr("hicache.engine.cli.build_model", build)
    with pytest.raises(RuntimeError, match="some other failure"):
        cli_main.main(["--model", "tiny", "--requests", "1"])


def test_as_a_module_bad_input_prints_one_line_and_no_traceback() -> None:
    """The real entry point: ``python -m hicache.engine`` with a bad flag exits 2 with one line."""
    run = subprocess.run(
        [sys.executable, "-m", "hicache.engine", "--num-pages", "0"], capture_output=True, text=True, timeout=120
    )
    assert (run.returncode, run.stdout, run.stderr) == (2, "", "error: --num-pages 0: must be an integer >= 1\n")


def test_running_the_flags_module_says_where_the_program_is() -> None:
    """``python -m hicache.engine.cli`` (the flags, not the program) runs nothing silently:
    one line naming ``python -m hicache.engine``, exit 2."""
    run = subprocess.run(
        [sys.executable, "-m", "hicache.engine.cli", "--requests", "2"], capture_output=True, text=True, timeout=120
    )
    assert (run.returncode, run.stdout) == (2, "") and run.stderr.endswith(
        "error: hicache.engine.cli holds the engine's flags; run python -m hicache.engine\n"
    ), run.stderr


def test_help_names_the_module_shows_defaults_and_documents_every_flag(capsys: pytest.CaptureFixture[str]) -> None:
    """``--help``: prog is ``python -m hicache.engine``, defaults are shown, no flag lacks help."""
    ap = cli_main.parser()
    undocumented = [a.option_strings for a in ap._actions if not (a.help and a.help.strip())]
    assert undocumented == []
    code, out, _ = run_main(["--help"], capsys)
    assert code == 0 and out.startswith("usage: python -m hicache.engine ")
    assert "(default: 4096)" in out and "(default: file)" in out
    assert "(default: 2)" in out and "(default: 2.0)" not in out  # a float default as ENGINE.md writes it


def args_of(argv: list[str]) -> tuple[argparse.Namespace, set[str]]:
    from hicache.flags import given_flags

    ap = cli_main.parser()
    return ap.parse_args(argv), given_flags(ap, argv)


@pytest.mark.parametrize(
    ("argv", "warning"),
    [
        (["--hicache-storage-path", "/tmp/x"], "--hicache-storage-path has no effect without --enable-hicache"),
        (["--hicache-ratio=3"], "--hicache-ratio has no effect without --enable-hicache"),
        (
            ["--enable-hicache", "--hicache-storage-path", "/tmp/x"],
            "--hicache-storage-path has no effect without --hicache-storage-size or --hicache-storage-ratio > 0",
        ),
        (
            ["--enable-hicache", "--device", "cpu", "--hicache-layered-restore", "on"],
            "--hicache-layered-restore on has no effect on CPU (it needs CUDA)",
        ),
        (
            ["--enable-hicache", "--hicache-size", "1", "--hicache-ratio", "3"],
            "--hicache-ratio has no effect with --hicache-size (the size wins)",
        ),
        (
            ["--enable-hicache", "--hicache-policy", "always", "--hicache-explore", "3"],
            "--hicache-explore has no effect without --hicache-policy cost",
        ),
        (
            ["--enable-hicache", "--hicache-storage-ratio", "1", "--hicache-storage-backend-extra-config", "{}"],
            "--hicache-storage-backend-extra-config has no effect with --hicache-storage-backend file",
        ),
        (["--device", "cpu", "--attention-cudnn", "on"], "--attention-cudnn has no effect on CPU"),
        (
            ["--enable-hicache", "--hicache-storage-size", "0", "--hicache-storage-ratio", "2"],
            "--hicache-storage-ratio has no effect with --hicache-storage-size (the size wins; 0: no L3)",
        ),
    ],
)
def test_a_flag_that_changes_nothing_warns(argv: list[str], warning: str) -> None:
    """Each flag that has no effect with the others is named in a warning."""
    args, given = args_of(argv)
    assert warning in ineffective_flags(args, given)


def test_a_flag_that_is_refused_is_not_also_called_ineffective(capsys: pytest.CaptureFixture[str]) -> None:
    """One message per flag: a layered restore without prefetch is refused, on CPU too (not
    first warned about as having no effect there)."""
    argv = ["--enable-hicache", "--device", "cpu", "--disable-hicache-prefetch", "--hicache-layered-restore", "on"]
    code, out, err = run_main(argv, capsys)
    assert (code, out) == (2, "") and len(err.splitlines()) == 1 and err.startswith("error: --hicache-layered-restore")


def test_flags_that_take_effect_do_not_warn() -> None:
    """A configuration where every flag matters warns about nothing."""
    argv = ["--enable-hicache", "--hicache-storage-ratio", "1", "--hicache-storage-path", "/tmp/x", "--device", "cpu"]
    assert ineffective_flags(*args_of(argv)) == []


@pytest.mark.parametrize(
    ("extra", "warning"),
    [
        (["--hicache-storage-direct"], "--hicache-storage-direct has no effect without --hicache-storage-backend file"),
    ],
    ids=["direct-with-dir"],
)
def test_a_flag_warned_ineffective_is_left_out_and_the_run_serves(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], extra: list[str], warning: str
) -> None:
    """A flag the CLI warns has no effect is not passed on: the run serves its requests
    (the dir store used to refuse it after the warning, exit 2)."""
    argv = [*SMALL, "--enable-hicache", "--hicache-storage-ratio", "1", "--hicache-storage-backend", "dir"]
    code, out, err = run_main([*argv, "--hicache-storage-path", str(tmp_path / "kv"), *extra], capsys)
    assert code == 0 and "2 requests: 2 served, 0 failed" in out, err
    assert f"warning: {warning}" in err.splitlines()


@pytest.mark.parametrize(
    ("extra", "warning"),
    [
        (
            ["--enable-hicache", "--hicache-storage-path", "/nope/x"],
            "--hicache-storage-path has no effect without --hicache-storage-size or --hicache-storage-ratio > 0",
        ),
        (
            ["--enable-hicache", "--hicache-storage-size", "0", "--hicache-storage-ratio", "2",
             "--hicache-storage-backend", "dir"],
            "--hicache-storage-backend has no effect without --hicache-storage-size or --hicache-storage-ratio > 0",
        ),
        (
            ["--enable-hicache", "--hicache-storage-size", "0", "--hicache-storage-path", "/nope/x"],
            "--hicache-storage-path has no effect without --hicache-storage-size or --hicache-storage-ratio > 0",
        ),
    ],
    ids=["path-without-l3", "dir-with-size-0", "path-with-size-0"],
)  # fmt: skip
def test_a_storage_flag_without_l3_only_warns(
    capsys: pytest.CaptureFixture[str], extra: list[str], warning: str
) -> None:
    """With no L3 (no storage size or ratio, or a size of 0, which wins over a ratio) the
    storage flags change nothing: they warn, are not checked, and the run serves."""
    code, out, err = run_main([*SMALL, *extra], capsys)
    assert code == 0 and "2 requests: 2 served, 0 failed" in out, err
    assert f"warning: {warning}" in err.splitlines()
    assert "error" not in err


def test_warnings_reach_stderr_and_the_run_still_succeeds(capsys: pytest.CaptureFixture[str]) -> None:
    """A run with an ineffective flag prints the warning on stderr and serves its requests."""
    code, out, err = run_main([*SMALL, "--hicache-storage-path", "/tmp/x"], capsys)
    assert code == 0 and "2 requests: 2 served, 0 failed" in out
    assert "warning: --hicache-storage-path has no effect without --enable-hicache" in err.splitlines()


@pytest.mark.parametrize("ratio", ["0.1", "1"])
def test_an_l2_smaller_than_a_prompt_is_a_warning_line(ratio: str, capsys: pytest.CaptureFixture[str]) -> None:
    """Backups go to L3 through L2: with an L2 smaller than a prompt, the prompt never
    reaches L3. The CLI says so at start (the hicache logger's warning is silent there)."""
    argv = ["--enable-hicache", "--num-pages", "128", "--hicache-ratio", ratio, "--hicache-storage-ratio", "2"]
    code, out, err = run_main([*argv, "--requests", "2"], capsys)
    assert code == 0 and "2 requests: 2 served, 0 failed" in out, err
    warned = [x for x in err.splitlines() if x.startswith("warning: L2 holds")]
    if ratio == "1":
        assert not warned, err
    else:  # 12 L2 pages against the default workload's prompt of 350 + 8 tokens: 22 pages of 16
        assert warned == [
            "warning: L2 holds 12 pages, fewer than a prompt's 22: backups go to L3 through L2, so such a prompt "
            "stays in L1 only and never reaches L3 (raise --hicache-ratio or --hicache-size)"
        ]


def test_a_run_without_a_terminal_says_how_far_it_got_on_stderr(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """Where tqdm draws no bar (a log, a pipe: here capsys), a line says how many requests
    are done every PROGRESS_EVERY_S (0 here: every step); stdout keeps only the summary."""
    monkeypatch.setattr(cli_main, "PROGRESS_EVERY_S", 0.0)
    code, out, err = run_main([*SMALL, "--requests", "3", "--concurrency", "1"], capsys)
    assert code == 0 and "3 requests: 3 served, 0 failed" in out and "requests:" not in out.split("\n3 requests")[0]
    lines = [x for x in err.splitlines() if x.startswith("requests: ")]
    counts = [int(x.split()[1].split("/")[0]) for x in lines]
    assert lines and all(x.split()[1].endswith("/3") for x in lines)
    assert counts == sorted(counts) and counts[-1] == 3 and 1 in counts


def test_every_request_failing_exits_1_with_the_reason(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """When no request finds room, the reasons are counted, no figure is computed from
    nothing (no StatisticsError) and the exit status is 1."""
    monkeypatch.setattr(Engine, "_prefill", lambda self, seq: False)  # never room in L1
    code, out, err = run_main(["--requests", "4"], capsys)
    assert code == 1
    assert "4 requests: 0 served, 4 failed" in out and "failed 4x: no room in L1 for a prompt of 358 tokens" in out
    assert "throughput" not in out and "TTFT" not in out
    assert err.splitlines()[-1] == "error: all 4 requests failed: no room in L1 for a prompt of 358 tokens (4)"


def test_failed_requests_are_kept_out_of_throughput_and_ttft(capsys: pytest.CaptureFixture[str]) -> None:
    """The report counts failures per reason and computes req/s and TTFT over served requests."""
    engine = Engine("tiny", device="cpu", num_pages=64, cuda_graphs=False)
    ok = [Output(i, [1], None, 0.010 * i, 0.02, 0, "L1") for i in (1, 2, 3)]
    bad = [Output(9, [], None, 99.0, 99.0, 0, "L1", error="no room in L1 for a prompt of 358 tokens")]
    bad.append(Output(10, [], None, 50.0, 50.0, 0, "L1", error="aborted"))
    failed = cli_main.report(engine, ok + bad, wall=2.0)
    engine.close()
    out = capsys.readouterr().out
    assert failed == {"no room in L1 for a prompt of 358 tokens": 1, "aborted": 1}
    assert "5 requests: 3 served, 2 failed" in out
    assert "throughput: 1.50 req/s (3 served in 2.00 s)" in out
    assert "TTFT ms: median 20.00, p90 30.00, max 30.00" in out
    assert "prompt KV from: recompute 3, L1 0, L2 0, L3 0" in out  # nothing cached: recomputed


def test_the_workload_depends_only_on_the_seed() -> None:
    """The same flags and seed give the same prompts; another seed gives others."""
    args, _ = args_of(["--requests", "30", "--seed", "7"])
    first, again = cli_main.workload(args, 1000), cli_main.workload(args, 1000)
    args.seed = 8
    assert first == again and cli_main.digest(first) == cli_main.digest(again)
    assert cli_main.digest(cli_main.workload(args, 1000)) != cli_main.digest(first)


def test_same_seed_same_output(capsys: pytest.CaptureFixture[str]) -> None:
    """Two runs with one seed print the same workload digest and the same served/failed line."""
    runs = [run_main([*SMALL, "--seed", "3"], capsys)[1] for _ in range(2)]
    pick = [[ln for ln in r.splitlines() if ln.startswith(("workload:", "2 requests"))] for r in runs]
    assert pick[0] == pick[1] and len(pick[0]) == 2


def test_metrics_port_in_use_is_a_flag_error(capsys: pytest.CaptureFixture[str]) -> None:
    """A taken ``--metrics-port`` exits 2 naming the flag."""
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        busy = taken.getsockname()[1]
        code, _, err = run_main([*SMALL, "--enable-metrics", "--metrics-port", str(busy)], capsys)
    assert code == 2 and err.splitlines()[-1] == f"error: --metrics-port {busy}: Address already in use"


def test_enable_metrics_serves_the_cache_metrics_while_running(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """``--enable-metrics`` serves /metrics on 127.0.0.1 (scraped here just before it stops)."""
    scraped: list[str] = []
    stop = MetricsServer.stop

    def scrape_then_stop(self: MetricsServer) -> None:
        with urllib.request.urlopen(f"http://127.0.0.1:{self.port}/metrics", timeout=10) as r:
            scraped.append(r.read().decode())
        stop(self)

    monkeypatch.setattr(MetricsServer, "stop", scrape_then_stop)
    code, _, err = run_main([*SMALL, "--enable-metrics"], capsys)
    assert code == 0 and re.search(r"^metrics: http://127\.0\.0\.1:\d+/metrics$", err, re.M)
    (text,) = scraped
    families = {f.name: f for f in text_string_to_metric_families(text)}
    recomputed = families["hicache_recomputed_tokens"]
    assert recomputed.type == "counter" and recomputed.samples[0].value > 0  # the workload's prefills


def test_an_l1_pool_too_large_to_allocate_is_a_flag_error(capsys: pytest.CaptureFixture[str]) -> None:
    """--num-pages beyond the machine's memory: one line naming the flag, exit 2."""
    code, out, err = run_main(["--num-pages", "99999999999999"], capsys)
    lines = [ln for ln in err.splitlines() if not ln.startswith("warning: ")]
    assert code == 2 and out == "" and len(lines) == 1
    assert lines[0] == (
        "error: --num-pages 99999999999999: cannot allocate the L1 pool: L1 pages (--num-pages) 99999999999999 x "
        f"--page-size 16 tokens = 7.629e+08 GiB: more than this machine's host memory ({HOST_GIB:.1f} GiB)"
    )


def test_an_l1_pool_past_what_a_tensor_holds_says_so_without_torch_internals(
    capsys: pytest.CaptureFixture[str],
) -> None:
    code, out, err = run_main(["--num-pages", "99999999999999999999"], capsys)
    lines = [ln for ln in err.splitlines() if not ln.startswith("warning: ")]
    assert code == 2 and out == "" and len(lines) == 1
    assert lines[0].endswith(f" GiB: more than this machine's host memory ({HOST_GIB:.1f} GiB)"), lines[0]


def test_the_seed_is_an_integer_like_every_other_count(capsys: pytest.CaptureFixture[str]) -> None:
    code, _, err = run_main(["--seed", "1e3"], capsys)
    assert (code, err.splitlines()[-1]) == (2, "error: --seed 1e3: not an integer")
    # a negative seed drew the same prompts as its absolute value (random.Random(-1) == Random(1))
    code, _, err = run_main(["--seed", "-1"], capsys)
    assert (code, err.splitlines()[-1]) == (2, "error: --seed -1: must be an integer >= 0")


def test_paged_attention_on_a_cpu_is_a_flag_error(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """Triton runs kernels on a CPU only interpreted (the tests set TRITON_INTERPRET=1);
    without it ``--attention paged`` on cpu is refused up front, not deep inside Triton at
    the first forward."""
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    code, out, err = run_main(["--model", "tiny", "--device", "cpu", "--requests", "1", "--attention", "paged"], capsys)
    assert (code, out) == (2, "")
    assert err == "error: --attention paged: attention 'paged' needs a CUDA device (on CPU: 'gqa' or 'fold')\n"
    with pytest.raises(ConfigError, match="needs a CUDA device"):
        Engine("tiny", device="cpu", attention="paged")


def test_an_l1_pool_too_large_for_its_page_size_names_both_flags(capsys: pytest.CaptureFixture[str]) -> None:
    """A page size that makes the L1 pool too large: the line names the pool's pages, their
    size in tokens, the GiB and --page-size, and only the first line of torch's error."""
    code, _, err = run_main(
        ["--model", "tiny", "--device", "cpu", "--requests", "1", "--page-size", "65536", "--num-pages", "1000000"],
        capsys,
    )
    assert code == 2 and err.count("\n") == 1, err
    assert err.startswith(
        "error: --num-pages 1000000: cannot allocate the L1 pool: L1 pages (--num-pages) 1000000 x --page-size 65536"
        " tokens = 3.125e+04 GiB: "
    ), err


@pytest.mark.parametrize(
    ("flags", "line"),
    [
        (["--page-size", "9" * 23], f"error: --page-size {'9' * 23}: must be an integer in [1, 65,536]"),
        (["--page-size", "65537"], "error: --page-size 65537: must be an integer in [1, 65,536]"),
        (["--enable-hicache", "--hicache-ratio", "1e300"], "error: --hicache-ratio 1e300: must be at most 1e9"),
        (["--enable-hicache", "--hicache-storage-size", "inf"], "error: --hicache-storage-size inf: "),
        (
            ["--enable-hicache", "--hicache-transfer-backend", "triton"],
            "error: --hicache-transfer-backend triton: transfer backend 'triton' needs triton",
        ),
        (
            ["--enable-hicache", "--hicache-storage-ratio", "2", "--hicache-storage-backend", "dir",
             "--hicache-storage-path", "/proc/hicache-kv"],
            "error: --hicache-storage-path /proc/hicache-kv: L3 directory /proc/hicache-kv: on a file system that "
            "stores no data (such as /proc); give a disk path",
        ),
    ],
)  # fmt: skip
def test_out_of_range_values_are_one_line_naming_their_flag(
    flags: list[str], line: str, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """Sizes past what any machine has, a backend this machine cannot run, a directory that
    cannot be made: one line naming the flag and its value, exit 2, no traceback."""
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    code, out, err = run_main(["--model", "tiny", "--device", "cpu", "--requests", "1", *flags], capsys)
    lines = [ln for ln in err.splitlines() if not ln.startswith("warning: ")]
    assert (code, out, len(lines)) == (2, "", 1), err
    assert lines[0].startswith(line), lines[0]


def test_json_output_is_alone_on_stdout(capsys: pytest.CaptureFixture[str]) -> None:
    """--json: stdout is the status JSON alone (it pipes into a JSON reader), the summary
    goes to stderr."""
    code, out, err = run_main(["--model", "tiny", "--device", "cpu", "--requests", "3", "--json"], capsys)
    assert code == 0
    status = json.loads(out)
    assert status["stats"]["finished"] == 3 and "workload: 3 requests" in err and "throughput" in err


@pytest.mark.parametrize("missing", ["tqdm", "transformers"])
def test_without_the_engine_extra_the_module_says_so_in_one_line(missing: str) -> None:
    """``pip install .`` (the cache alone) lacks tqdm and transformers: ``python -m
    hicache.engine`` then names the extra to install, in one line, exit 2, no traceback."""
    code = (
        f"import sys, runpy; sys.modules[{missing!r}] = None; sys.argv = ['hicache.engine', '--help']; "
        "runpy.run_module('hicache.engine', run_name='__main__')"
    )
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert run.returncode == 2 and run.stdout == "" and run.stderr.count("\n") == 1
    assert run.stderr.startswith("error: the reference engine needs the [engine] extra: pip install '.[engine]'")
    assert missing in run.stderr


def test_ctrl_c_while_the_models_library_imports_is_one_line_and_130() -> None:
    """Ctrl-C during the CLI's seconds-long import of transformers prints ``interrupted``
    and exits 130, as it does later (it was a traceback): an import hook interrupts it."""
    code = (
        "import sys, runpy\n"
        "class Interrupt:\n"
        "    def find_spec(self, name, path=None, target=None):\n"
        "        if name == 'transformers':\n"
        "            raise KeyboardInterrupt\n"
        "sys.modules.pop('transformers', None); sys.meta_path.insert(0, Interrupt())\n"
        "sys.argv = ['hicache.engine', '--help']\n"
        "runpy.run_module('hicache.engine', run_name='__main__')\n"
    )
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert (run.returncode, run.stdout, run.stderr) == (130, "", "interrupted\n")


def test_without_transformers_building_a_model_is_a_config_error(monkeypatch: pytest.MonkeyPatch) -> None:
    from hicache.engine import build_model

    monkeypatch.setitem(sys.modules, "transformers", None)
    with pytest.raises(ConfigError, match=r"need the \[engine\] extra: pip install '\.\[engine\]'"):
        build_model("tiny")


def test_an_unavailable_l3_is_a_warning_line(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """A store that could not be reached (a mistyped Mooncake address) leaves the run without
    L3: the CLI says so on stderr, with the store's reason, and still serves (exit 0)."""
    import dataclasses

    from hicache.facade import HiCache

    real = HiCache.status

    def status(self: HiCache) -> Any:
        s = real(self)
        down = {**(s.storage or {}), "available": False, "error": "master 127.0.0.1:1 unreachable"}
        return dataclasses.replace(s, storage=down)

    monkeypatch.setattr(HiCache, "status", status)
    code, out, err = run_main(["--enable-hicache", "--hicache-storage-ratio", "1", "--requests", "2"], capsys)
    assert code == 0 and "2 requests: 2 served, 0 failed" in out
    assert "warning: L3 unavailable, running without it: master 127.0.0.1:1 unreachable\n" in err
    monkeypatch.setattr(HiCache, "status", real)
    code, out, err = run_main(["--enable-hicache", "--hicache-storage-ratio", "1", "--requests", "2"], capsys)
    assert code == 0 and "L3 unavailable" not in err


@pytest.mark.parametrize("n", [1, 2, 3, 4, 5, 6, 9, 10, 11, 20, 101])
def test_the_summary_percentiles_are_nearest_rank(n: int) -> None:
    """The median and p90 are the nearest-rank values (rank ceil(q * n)): with 2 values the
    median is the smaller, with 10 the p90 is the 9th (round-half-even made them the max)."""
    from hicache.engine.__main__ import percentile

    values = [float(i) for i in range(1, n + 1)]
    for q in (0.5, 0.9, 1.0):
        got = percentile(values, q)
        assert sum(v <= got for v in values) >= q * n  # at least q of them at or below it
        assert sum(v < got for v in values) < q * n  # and it is the smallest such value


@pytest.mark.parametrize(
    "module", ["torch", "transformers", "hicache.engine.cli", "hicache.engine.engine", "hicache.metrics_http"]
)
def test_ctrl_c_during_any_of_the_engine_clis_imports_is_one_line_and_130(module: str) -> None:
    """Ctrl-C during any of ``python -m hicache.engine``'s seconds-long imports (torch, the
    models' library, the CLI's own modules) prints ``interrupted`` and exits 130, as later."""
    run = run_with_import_interrupted(
        "sys.argv = ['hicache.engine', '--help']\n"
        "runpy.run_module('hicache.engine', run_name='__main__', alter_sys=True)\n",
        module,
    )
    assert (run.returncode, run.stdout, run.stderr) == (130, "", "interrupted\n")


def test_the_dir_store_takes_fsync_from_the_extra_config(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """``{"fsync": false}`` reaches the dir store (the CLI refused its one key, while the
    Python API took it), and the run serves without a warning."""
    path = tmp_path / "kv"
    argv = [*SMALL, "--enable-hicache", "--hicache-storage-ratio", "1", "--hicache-storage-backend", "dir"]
    argv += ["--hicache-storage-path", str(path), "--hicache-storage-backend-extra-config", '{"fsync": false}']
    args, given = args_of(argv)
    assert ineffective_flags(args, given) == []
    with engine_from_args(args) as e:
        assert e.cache.storage is not None and e.cache.storage.status()["fsync"] is False
    code, out, err = run_main(argv, capsys)
    assert code == 0 and "2 requests: 2 served, 0 failed" in out and "warning" not in err, err


# The argv behind each error line ENGINE.md quotes ("--flag VALUE" starts the line).
DOC_ARGV = {
    "--num-pages 10": ["--device", "cpu", "--num-pages", "10"],
    "--device cuda": ["--device", "cuda"],
    "--hicache-ratio 0": ["--enable-hicache", "--hicache-ratio", "0"],
    "--hicache-policy fast": ["--hicache-policy", "fast"],
    "--hicache-storage-path /nope/x": [
        "--enable-hicache",
        "--hicache-storage-ratio",
        "1",
        "--hicache-storage-path",
        "/nope/x",
    ],
    "--hicache-rat 2": ["--hicache-rat", "2"],
    "--num-pages": ["--num-pages"],
}


def test_the_error_lines_engine_md_quotes_are_the_clis(capsys: pytest.CaptureFixture[str]) -> None:
    """Each ``error:`` line of ENGINE.md's bad-flag block is what the CLI prints, exit 2."""
    doc = (Path(__file__).resolve().parent.parent / "docs" / "ENGINE.md").read_text()
    block = doc.split("every bad flag is one line on stderr", 1)[1].split("```text\n", 1)[1].split("```", 1)[0]
    lines = block.strip().splitlines()
    keys = [re.match(r"error: (\S+(?: [^:]+)?):", line)[1] for line in lines]  # type: ignore[index]
    assert sorted(keys) == sorted(DOC_ARGV), "quote a line for each DOC_ARGV entry, and nothing else"
    for key, line in zip(keys, lines, strict=True):
        if key == "--device cuda" and (torch.cuda.is_available() or torch.version.cuda is not None):
            continue  # the line quotes a CPU-only torch
        code, out, err = run_main(DOC_ARGV[key], capsys)
        assert (code, out, err.splitlines()[-1]) == (
            2,
            "",
            line.replace("torch 2.13.0+cpu", f"torch {torch.__version__}"),
        )


def test_numbers_keep_their_text_through_pickle_and_copy_and_the_config_holds_plain_floats() -> None:
    import copy
    import pickle

    from hicache.engine.cli import engine_kwargs
    from hicache.flags import Written

    args, _ = args_of(["--enable-hicache", "--hicache-ratio", "1e0", "--hicache-prior-host-gib-s", "7.50"])
    for again in (pickle.loads(pickle.dumps(args)), copy.deepcopy(args)):
        assert again.hicache_ratio == 1.0 and again.hicache_ratio.text == "1e0"
        assert again.hicache_prior_host_gib_s.text == "7.50"
    assert isinstance(args.hicache_ratio, Written)
    from hicache.engine.model import build_model

    priors = engine_kwargs(args, build_model("tiny", device="cpu", dtype=torch.float32))["priors"]
    assert type(priors.host_gib_s) is float and type(priors.storage_read_gib_s) is float


def test_a_machine_that_does_not_say_its_memory_leaves_the_sizes_to_the_allocator(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """os.sysconf failing, or saying -1: no pool is refused for want of a figure."""
    from hicache import HiCache, HiCacheConfig
    from hicache.core.geometry import KVGeometry

    real = os.sysconf
    g = KVGeometry(2, 1, 4, 2, torch.float32)
    said: list[ValueError | int] = [ValueError("unrecognized configuration name"), -1]
    for answer in said:

        def sysconf(name: str, answer: ValueError | int = answer) -> int:
            if name == "SC_PHYS_PAGES":
                if isinstance(answer, ValueError):
                    raise answer
                return answer
            return real(name)

        monkeypatch.setattr(os, "sysconf", sysconf)
        with HiCache(HiCacheConfig(g, l1_pages=8, l2_pages=8, device="cpu")) as cache:
            assert cache.status().core.tiers[0].free == 8


def test_layered_restore_without_hicache_is_warned_about_once(capsys: pytest.CaptureFixture[str]) -> None:
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("error")  # the engine's own UserWarning would raise here
        code, _, err = run_main(["--device", "cpu", "--hicache-layered-restore", "on", *SMALL], capsys)
    assert code == 0
    assert [ln for ln in err.splitlines() if "layered" in ln] == [
        "warning: --hicache-layered-restore has no effect without --enable-hicache"
    ]


def test_pools_that_fit_alone_but_not_together_on_a_cpu_are_a_flag_error(capsys: pytest.CaptureFixture[str]) -> None:
    """On a CPU L1 and L2 share host memory: each 60% of it passes alone, together they are
    refused before either is allocated, naming the flag that sized L2."""
    page = 8192  # bytes per page of the tiny model at page size 16
    pages = int(0.6 * HOST_GIB * 2**30 / page)
    gib = pages * page / 2**30
    code, out, err = run_main(["--enable-hicache", "--num-pages", str(pages), "--hicache-ratio", "1"], capsys)
    lines = [ln for ln in err.splitlines() if not ln.startswith("warning: ")]
    assert code == 2 and out == "" and len(lines) == 1
    assert lines[0] == (
        f"error: --hicache-ratio 1: cannot allocate the L2 pool: L2 pages {pages} x --page-size 16 tokens = "
        f"{gib:.4g} GiB: more than this machine's host memory ({HOST_GIB:.1f} GiB) beside the L1 pool's {gib:.4g} GiB"
    )


@pytest.mark.parametrize(
    ("flags", "unbuffered"), [(["--json"], False), ([], True)], ids=["json-buffered", "summary-unbuffered"]
)
@pytest.mark.skipif(not Path("/dev/full").exists(), reason="needs /dev/full")
def test_stdout_that_cannot_be_written_is_one_line_and_exit_1(flags: list[str], unbuffered: bool) -> None:
    """A full disk under stdout: one ``error:`` line and 1, not a traceback (nor Python's
    "Exception ignored" and 120 from its flush at exit)."""
    env = {k: v for k, v in os.environ.items() if k != "PYTHONUNBUFFERED"}
    if unbuffered:
        env["PYTHONUNBUFFERED"] = "1"
    with open("/dev/full", "w") as full:
        run = subprocess.run(
            [sys.executable, "-m", "hicache.engine", "--requests", "2", "--prefix-tokens", "40", *flags],
            stdout=full,
            stderr=subprocess.PIPE,
            text=True,
            timeout=300,
            env=env,
        )
    assert run.returncode == 1, run.stderr
    assert "Traceback" not in run.stderr and "Exception ignored" not in run.stderr, run.stderr
    assert run.stderr.splitlines()[-1] == "error: cannot write the output: No space left on device"


def test_a_reader_that_leaves_ends_the_run_quietly_with_141() -> None:
    """``| head``: once the reader of stdout left, the run ends with 141, as a SIGPIPE would,
    and says nothing about a broken pipe."""
    proc = subprocess.Popen(
        [sys.executable, "-m", "hicache.engine", "--requests", "2", "--prefix-tokens", "40", "--json"],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    assert proc.stdout is not None and proc.stderr is not None
    proc.stdout.close()
    try:
        err = proc.stderr.read()
        assert proc.wait(timeout=300) == 141, err
    finally:
        proc.kill()
    assert "Traceback" not in err and "Broken pipe" not in err and "error:" not in err, err


def test_weights_larger_than_the_host_are_refused_before_they_are_built(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """A preset whose weights alone outgrow the host's memory (qwen3-8b in float32 on a
    small machine) is one line and exit 1 before any weight is allocated, not a process the
    kernel kills part-way with no message. The same model fits a host that holds it."""
    from hicache.engine.model import build_model

    tiny_bytes = 4 * 139_664  # tiny's parameters and buffers in float32 (checked below)
    monkeypatch.setattr("hicache.facade._host_memory", lambda: tiny_bytes - 1)
    code, out, err = run_main(["--model", "tiny", "--requests", "1", "--prefix-tokens", "8"], capsys)
    assert (code, out) == (1, ""), err
    assert err.startswith("error: out of memory building the model (tiny) and the engine on cpu: model 'tiny' needs ")
    assert "GiB of weights in float32, more than this machine's host memory" in err and err.count("\n") == 1
    monkeypatch.setattr("hicache.facade._host_memory", lambda: tiny_bytes)
    net = build_model("tiny")  # exactly as much memory as its weights: built
    assert sum(t.numel() * t.element_size() for t in [*net.parameters(), *net.buffers()]) == tiny_bytes


def test_a_closed_stdout_is_no_error() -> None:
    """``>&-``: Python drops what is printed to a closed stdout; the run serves and exits 0."""
    cmd = f"exec {shlex.quote(sys.executable)} -m hicache.engine --requests 2 --prefix-tokens 40 >&-"
    run = subprocess.run(["sh", "-c", cmd], capture_output=True, text=True, timeout=300)
    assert run.returncode == 0 and "Traceback" not in run.stderr, run.stderr


@pytest.mark.parametrize(
    ("limit", "capped"), [("1073741824", True), ("max", False), ("9223372036854771712", False), ("x", False)]
)
def test_a_containers_memory_limit_is_the_host_memory_the_checks_use(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, limit: str, capped: bool
) -> None:
    """Inside a container the kernel kills a process past the container's memory limit:
    the memory checks use it where it is below the machine's ("max", or v1's huge number:
    no limit; anything else unreadable is ignored)."""
    import hicache.facade as facade

    physical = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    (tmp_path / "memory.max").write_text(limit + "\n")
    monkeypatch.setattr(facade, "CGROUP_LIMITS", (str(tmp_path / "absent"), str(tmp_path / "memory.max")))
    assert facade._host_memory() == (min(physical, 1 << 30) if capped else physical)


def test_ctrl_c_while_the_engine_closes_is_one_line_and_130(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """A Ctrl-C while the CLI closes the engine at the end of a run (a write_back flush into
    the store) prints ``interrupted`` and exits 130, as earlier in the run (a traceback)."""
    from hicache.engine.engine import Engine

    real = Engine.close
    closes: list[int] = []

    def interrupted_close(self: Engine) -> None:
        closes.append(1)
        real(self)
        raise KeyboardInterrupt  # as it ends: the store is closed, the Ctrl-C still to come out

    monkeypatch.setattr(Engine, "close", interrupted_close)
    argv = ["--device", "cpu", "--requests", "3", "--prefixes", "1", "--prefix-tokens", "32", "--enable-hicache"]
    argv += ["--hicache-write-policy", "write_back", "--hicache-storage-ratio", "2"]
    argv += ["--hicache-storage-backend", "dir", "--hicache-storage-path", str(tmp_path / "kv")]
    try:
        code, _, err = run_main(argv, capsys)
    except KeyboardInterrupt:  # NOTE: caught here: escaping, it would end the whole pytest run
        pytest.fail("the Ctrl-C while the engine closed came out of main()")
    assert closes == [1] and (code, err.splitlines()[-1]) == (130, "interrupted"), err
    assert "Traceback" not in err


def test_ctrl_c_as_the_cli_exits_is_one_line_and_130() -> None:
    """A Ctrl-C once the run is over, while the interpreter exits (an exit handler still
    running): ``interrupted`` and 130, not a process ended by SIGINT without a word."""
    code = (
        "import atexit, os, runpy, signal, sys, time\n"
        "atexit.register(lambda: (os.kill(os.getpid(), signal.SIGINT), time.sleep(5)))\n"
        "sys.argv = ['hicache.engine', '--device', 'cpu', '--requests', '2', '--prefixes', '1',"
        " '--prefix-tokens', '32']\n"
        "runpy.run_module('hicache.engine', run_name='__main__', alter_sys=True)\n"
    )
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert (run.returncode, run.stderr.splitlines()[-1:]) == (130, ["interrupted"]), run.stderr[-2000:]
