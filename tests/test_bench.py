"""The end-to-end benchmarks on CPU (tiny model): what their JSON records, where it goes,
and that a recompute is reported as one."""

from __future__ import annotations

import argparse
import functools
import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from tests.interrupts import run_with_import_interrupted

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "bench"))

import common  # noqa: E402

pytest.importorskip("transformers")


def bench(script: str, *flags: str, out: Path) -> dict[str, object]:
    cmd = [sys.executable, script, "--model", "tiny", "--device", "cpu", *flags, "--out", str(out), "--tag", "t"]
    run = subprocess.run(cmd, cwd=ROOT / "bench", capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    (result,) = out.glob(f"{Path(script).stem}-tiny-*-t.json")
    assert result.with_suffix(".png").stat().st_size > 0
    data: dict[str, object] = json.loads(result.read_text())
    return data


def test_latency_bench_splits_hicache_time_into_bookkeeping_and_issuing_copies(tmp_path: Path) -> None:
    """Rows carry the host-time split (bookkeeping + issuing copies = all hicache calls),
    restored pages equal the pages as computed, and tier ``none`` is labelled recompute."""
    data = bench("bench_hicache.py", "--prefix-tokens", "200", "--iterations", "3", "--warmup", "1", out=tmp_path)
    rows = {r["tier"]: r for r in data["rows"]}  # type: ignore[attr-defined]
    assert set(rows) == {"none", "l2", "l3"}
    assert rows["none"]["transfer_issue_ms"] == 0  # without hicache nothing is copied
    assert rows["none"]["sources"] == {"recompute": 6}  # 3 iterations x 2 prefixes
    for tier in ("l2", "l3"):
        r = rows[tier]
        assert r["sources"] == {tier.upper(): 6}
        assert r["restores_checked"] > 0 and r["page_mismatches"] == 0
        assert r["transfer_issue_ms"] > 0 and r["cache_calls_ms"]["start_restore"] > 0
        calls = sum(r["cache_calls_ms"].values())
        assert abs(r["bookkeeping_ms"] + r["transfer_issue_ms"] - calls) < 1e-6
        assert r["transfer_issue_ms"] < calls <= r["cache_ms"] * 1.05  # the engine's own count, plus timer cost
    # the L2 floor: its tail measured (L1 hits, checked by the bench), no copy rate on CPU;
    # its requests come after the row's figures (as many layered prefills as restores)
    r = rows["l2"]
    assert r["floor_tail_forward_ms"] > 0 and r["floor_plain_h2d_ms"] == 0
    assert r["floor_ms"] == r["floor_tail_forward_ms"] and r["floor_ratio"] == r["ttft_ms"] / r["floor_ms"]
    assert "floor_ms" not in rows["none"] and "floor_ms" not in rows["l3"]


def test_result_meta_records_versions_commit_device_and_the_settings_as_run(tmp_path: Path) -> None:
    """The JSON meta names torch/triton/transformers, the commit, the device and date, and
    the settings the engine really ran with (no CUDA graphs on CPU, whatever the flags)."""
    data = bench("bench_hicache.py", "--prefix-tokens", "48", "--iterations", "1", "--warmup", "1", out=tmp_path)
    meta = data["meta"]
    assert isinstance(meta, dict)
    assert set(meta["versions"]) >= {"torch", "triton", "transformers", "python"}
    assert meta["versions"]["torch"] == __import__("torch").__version__
    assert meta["commit"] is None or len(meta["commit"].split("+")[0]) == 40
    assert meta["device"] == "CPU" and len(meta["date"]) == 10
    assert meta["cuda_graphs"] is False and meta["layered_restore"] is False and meta["attention"] == "gqa"


def test_stress_bench_labels_recompute_and_draws_both_charts(tmp_path: Path) -> None:
    """A small stress run: policy ``never`` and tier ``none`` serve every request by recompute
    (not "L1"), ``always`` restores from its tier, and overlap/blocking rows are present."""
    flags = ["--prefixes", "4", "--prefix-tokens", "64", "--requests", "8", "--l1-prefixes", "2"]
    flags += ["--storage", "pagecache", "--decoders", "1", "--decode-tokens", "8", "--warmup-rotations", "1"]
    data = bench("bench_hicache_stress.py", *flags, out=tmp_path)
    rows = {(r["variant"], r["tier"], r["policy"]): r for r in data["rows"]}  # type: ignore[attr-defined]
    assert rows[("rotation", "none", "-")]["served_from"]["recompute"] == 8
    assert rows[("rotation", "l2", "never")]["served_from"]["recompute"] == 8
    assert rows[("rotation", "l2", "always")]["served_from"]["L2"] == 8
    assert rows[("rotation", "l3", "always")]["sources_in_order"] == "3" * 8
    assert {v for v, _, _ in rows} == {"rotation", "overlap", "blocking"}
    assert all(r["page_mismatches"] == 0 for r in rows.values())


def test_results_go_outside_the_checkout_by_default(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """Without ``--out`` results go to $HICACHE_BENCH_OUT, else /tmp/hicache-bench: never
    into the tracked tree."""
    monkeypatch.delenv("HICACHE_BENCH_OUT", raising=False)
    assert ROOT not in common.default_out().resolve().parents
    monkeypatch.setenv("HICACHE_BENCH_OUT", str(tmp_path))
    assert common.default_out() == tmp_path


@pytest.mark.parametrize("kind", ["bench_hicache-", "bench_hicache_stress-"])
def test_the_replot_command_redraws_a_result(tmp_path: Path, kind: str) -> None:
    """``python bench/plots.py FILE.json``, as RESULTS.md says, for a latency and a stress
    result: run as a script (its module-level helpers defined before the script part)."""
    src = sorted((ROOT / "bench" / "results").glob(f"{kind}qwen3-8b-*-h200-*.json"))[-1]
    shutil.copy(src, tmp_path / src.name)
    run = subprocess.run([sys.executable, "plots.py", str(tmp_path / src.name)], cwd=ROOT / "bench",
                         capture_output=True, text=True, timeout=120)  # fmt: skip
    assert run.returncode == 0, run.stderr[-2000:]
    assert (tmp_path / src.name).with_suffix(".png").stat().st_size > 0


def test_curated_results_redraw_from_their_json(tmp_path: Path) -> None:
    """Every curated bench_hicache result's chart can be drawn again from its JSON."""
    import plots

    curated = sorted((ROOT / "bench" / "results").glob("bench_hicache*.json"))
    assert curated
    for src in curated:
        shutil.copy(src, tmp_path / src.name)
        plots.replot(tmp_path / src.name)
        assert (tmp_path / src.name).with_suffix(".png").stat().st_size > 0


@pytest.mark.parametrize(
    ("argv", "says"),
    [
        (["core_ops.py", "--nodes", "0"], "error: --nodes 0: must be at least 1"),
        (["transfer.py", "--reps", "-1"], "error: --reps -1: must be at least 1"),
        (["transfer.py", "--device", "bogus"], "error: --device bogus: not a torch device"),
        (["transfer.py", "--device", "mps"], "error: --device mps: the benchmarks run on cpu or cuda"),
        (["transfer.py", "--device", "cpu:1"], "error: --device cpu:1: there is one CPU device (cpu)"),
        (["transfer.py", "--backend", "cuda"], "error: --backend cuda: invalid choice"),
        (["transfer.py", "--pages", "99999999999"], "error: --pages 99999999999: must be at most 4096"),
        (["transfer.py", "--tag", "a/b"], "error: --tag a/b: must be a plain file name part"),
        (["transfer.py", "--l1-pages", "0"], "error: --l1-pages 0: must be at least 1"),
        (["bench_hicache.py", "--tag", "a/b"], "error: --tag a/b: must be a plain file name part"),
        (["bench_hicache.py", "--straight-runs", "-1"], "--straight-runs -1: must be at least 0"),
        (["bench_hicache.py", "--warmup", "0"], "--warmup 0: must be at least 1"),
        (["bench_hicache.py", "--prefix-tokens", "15"], "--prefix-tokens 15: less than one page (--page-size 16)"),
        (
            ["storage.py", "--dir", "/nonexistent/hicache"],
            "error: --dir /nonexistent/hicache: not an existing directory",
        ),
        (["core_ops.py", "--out", "/dev/null/x"], "error: --out /dev/null/x: /dev/null is not a directory"),
        (["soak.py", "--requests", "60"], "--requests 60: must exceed --warmup 200"),
        (["bench_hicache.py", "--device", "tpu"], "--device tpu: not a torch device"),
        (["bench_hicache.py", "--model", "nope"], "--model nope: not a preset"),
        (["bench_hicache.py", "--suffix-tokens", "-5"], "--suffix-tokens -5: must be an integer in [0, 1,000,000]"),
        (["bench_hicache.py", "--max-new-tokens", "0"], "--max-new-tokens 0: must be an integer in [1, 1,000,000]"),
        (["bench_hicache.py", "--out="], "--out '': an empty path"),
        (["bench_hicache_stress.py", "--device", "tpu"], "--device tpu: not a torch device"),
        (["bench_hicache_stress.py", "--repeats", "0"], "--repeats 0: must be at least 1"),
        (["bench_hicache_stress.py", "--decoders", "-1"], "--decoders -1: must be at least 0"),
        (["bench_hicache_stress.py", "--no-rotation", "--decoders", "0"], "--no-rotation with --decoders 0: nothing"),
        (["bench_hicache_stress.py", "--disk-dir", "/nonexistent"], "--disk-dir /nonexistent: not an existing dir"),
        (["bench_hicache_stress.py", "--l1-prefixes", "0"], "--l1-prefixes 0: must be at least 1"),
        (
            ["bench_hicache_stress.py", "--suffix-tokens", "-100"],
            "--suffix-tokens -100: must be an integer in [0, 1,000,000]",
        ),
        (["plots.py", "README.md"], "error: README.md: not a bench_hicache result"),
        (["plots.py", "results"], "error: results: a directory"),
        (
            ["bench_hicache.py", "--iterations", "99999999999999999999999"],
            "--iterations 99999999999999999999999: must be at most 1000000000000",
        ),
        (["bench_hicache.py", "--tag", "h200.old"], "error: --tag h200.old: must be a plain file name part"),
        (["bench_hicache.py", "--prefix-tokens", "32", "--suffix-tokens", "0"], "--suffix-tokens 0: the prefix"),
        (["bench_hicache_stress.py", "--prefixes", "3", "--l1-prefixes", "3"], "--l1-prefixes 3: L1 would hold"),
        (["plots.py", "/nonexistent/bench_hicache-x.json"], "error: /nonexistent/bench_hicache-x.json: no such file"),
        (["soak.py", "--minutes", "nan"], "error: --minutes nan: not a finite number"),
        (["soak.py", "--fault-rate", "nan"], "error: --fault-rate nan: must be a rate in [0, 1]"),
        (
            ["bench_hicache.py", "--prefix-tokens", "20000000"],
            "error: --prefix-tokens 20000000: must be an integer in [1, 1,000,000]",
        ),
        (
            ["bench_hicache_stress.py", "--prefix-tokens", "20000000"],
            "error: --prefix-tokens 20000000: must be an integer in [1, 1,000,000]",
        ),
        (["fleet.py", "--instances", "0"], "error: --instances 0: must be at least 1"),
        (
            [
                "bench_hicache.py",
                *("--model", "tiny", "--prefix-tokens", "32", "--tiers", "none", "l3"),
                *("--hicache-storage-path", "/nonexistent/l3.bin"),
            ],
            "error: --hicache-storage-path /nonexistent/l3.bin: ",
        ),
        (["soak.py", "--hot", "-1"], "error: --hot -1: must be at least 1"),
        (["soak.py", "--rotating", "0"], "error: --rotating 0: must be at least 1"),
        (["soak.py", "--warmup", "0"], "error: --warmup 0: must be at least 1"),
        (["soak.py", "--max-prefix-tokens", "-5"], "error: --max-prefix-tokens -5: must be at least 2"),
        (["soak.py", "--max-prefix-tokens", "16"], "--max-prefix-tokens 16: must exceed the page size 16"),
        (["storage.py", "--workers", "100000"], "error: --workers 100000: must be at most 256"),
        (["storage.py", "--chunk-pages", "0"], "error: --chunk-pages 0: must be at least 1"),
        (["share.py", "--bandwidth-pages", "0"], "error: --bandwidth-pages 0: must be at least 1"),
        (["fleet.py", "--system-tokens", "10", "5"], "error: --system-tokens '10 5': MIN must be <= MAX"),
        (["fleet.py", "--user-tokens", "0", "5"], "error: --user-tokens 0: must be at least 1"),
        (["fleet.py", "--turns-mean", "0.5"], "error: --turns-mean 0.5: must be >= 1"),
        (["fleet.py", "--system-zipf", "nan"], "error: --system-zipf nan: not a number"),
        (["fleet.py", "--turns-mean", "inf"], "error: --turns-mean inf: not a finite number"),
        (["fleet.py", "--warmup", "1"], "error: --warmup 1: must be in [0, 1)"),
        (["fleet.py", "--l2-gib-s", "0"], "error: --l2-gib-s 0: must be > 0"),
        (["fleet.py", "--l2-fixed-ms", "-1"], "error: --l2-fixed-ms -1: must be >= 0"),
    ],
)
def test_a_bad_benchmark_flag_is_one_line_and_no_traceback(argv: list[str], says: str) -> None:
    """A count of 0 or less, a directory that cannot be used, or a run too short for its
    leak baseline: one error line naming it, a non-zero exit, no traceback, before any work."""
    run = subprocess.run([sys.executable, *argv], cwd=ROOT / "bench", capture_output=True, text=True, timeout=120)
    assert run.returncode == 2 and run.stdout == ""
    lines = [ln for ln in run.stderr.splitlines() if not ln.startswith("warning: ")]
    assert len(lines) == 1 and lines[0].startswith(says if says.startswith("error: ") else f"error: {says}"), (
        run.stderr[-2000:]
    )


def test_the_soak_warns_of_the_tier_flags_it_overrides() -> None:
    """The soak sizes L2 and L3 itself: an L2/L3 size flag given is said to have no effect
    (here before the run is refused at another flag, so nothing is built)."""
    argv = ["soak.py", "--hicache-ratio", "2", "--hicache-storage-size", "1", "--page-size", "16", "--requests", "60"]
    run = subprocess.run([sys.executable, *argv], cwd=ROOT / "bench", capture_output=True, text=True, timeout=120)
    assert run.returncode == 2, run.stderr[-2000:]
    warned = [ln for ln in run.stderr.splitlines() if ln.startswith("warning: ")]
    assert warned == [
        f"warning: --{flag} has no effect in the soak (it sizes L2 and L3 itself)"
        for flag in ("hicache-ratio", "hicache-storage-size")
    ]


@pytest.mark.parametrize("script", ["bench_hicache.py", "bench_hicache_stress.py"])
def test_a_refused_run_leaves_no_out_directory(script: str, tmp_path: Path) -> None:
    """--out names a directory to be made; a run refused at its flags (here --device) makes
    none: nothing is left behind."""
    out = tmp_path / "new" / "results"
    run = subprocess.run(
        [sys.executable, script, "--device", "tpu", "--out", str(out)],
        cwd=ROOT / "bench", capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert run.returncode == 2 and "--device tpu" in run.stderr, run.stderr[-2000:]
    assert not (tmp_path / "new").exists()


def test_guarded_lets_another_runtime_error_through() -> None:
    def main() -> None:
        raise RuntimeError("a bug")

    with pytest.raises(RuntimeError, match="a bug"):
        common.guarded(main)


@pytest.mark.parametrize(
    ("exc", "code", "says"),
    [
        (KeyboardInterrupt(), 130, "interrupted"),
        (OSError(28, "No space left"), 2, "error: [Errno 28] No space left"),
        (
            RuntimeError("[enforce fail at alloc_cpu.cpp:127] DefaultCPUAllocator: can't allocate memory: 9 TB\nmore"),
            2,
            "error: out of memory: [enforce fail at alloc_cpu.cpp:127] DefaultCPUAllocator: can't allocate memory: "
            "9 TB; try fewer or smaller pages",
        ),
        (MemoryError(), 2, "error: out of memory: MemoryError; try fewer or smaller pages"),
    ],
)
def test_guarded_ends_a_benchmark_with_one_line(
    capsys: pytest.CaptureFixture[str], exc: BaseException, code: int, says: str
) -> None:
    """Ctrl-C or an error the user can act on ends a benchmark with one line and an exit code."""

    def main() -> None:
        raise exc

    with pytest.raises(SystemExit) as ended:
        common.guarded(main)
    assert ended.value.code == code
    assert capsys.readouterr().err.strip() == says


@pytest.mark.parametrize(
    ("argv", "says"),
    [
        (["--sample"], "--sample needs a value"),
        (["--sample", "abc"], "--sample abc: must be a whole number >= 0"),
        (["--jobs", "0"], "--jobs 0: must be a whole number >= 1"),
        (["--sample", "9" * 23], f"--sample {'9' * 23}: must be a whole number >= 0"),  # past bash's integers
        (["--only"], "--only needs a value"),
        (["--bogus"], "unknown argument --bogus"),
        (["--sample", "3", "--per-file", "2"], "--sample and --per-file exclude each other"),
    ],
)
def test_the_mutation_script_refuses_a_bad_argument_in_one_line(argv: list[str], says: str) -> None:
    """scripts/mutation.sh names the bad argument and exits 2 before any work (no bash
    'unbound variable' or 'integer expression expected')."""
    run = subprocess.run(
        ["bash", str(ROOT / "scripts" / "mutation.sh"), *argv], capture_output=True, text=True, timeout=60
    )
    assert run.returncode == 2
    assert run.stderr.startswith(f"mutation.sh: {says}") and run.stderr.count("\n") == 1, run.stderr


def test_bench_hicache_warns_about_the_engine_flags_it_sets_itself() -> None:
    """Engine flags the latency bench overrides per tier are named as having no effect (it
    stops at the bad prefix length right after, before any work)."""
    argv = ["bench_hicache.py", "--num-pages", "4", "--hicache-policy", "never", "--prefix-tokens", "10"]
    run = subprocess.run([sys.executable, *argv], cwd=ROOT / "bench", capture_output=True, text=True, timeout=120)
    assert run.returncode != 0 and "Traceback" not in run.stderr
    assert "warning: --num-pages has no effect" in run.stderr
    assert "warning: --hicache-policy has no effect: policy always forces each tier" in run.stderr


def test_storage_bench_times_plain_and_store_in_turn_and_takes_the_median_turn_ratio(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    import storage

    clock = [0.0]
    calls: list[str] = []
    # the disk's rate drifts: turn k's plain read takes plain_s[k], the store's store_s[k]
    plain_s, store_s = [1.0, 2.0, 3.0, 4.0, 5.0], [3.0, 3.0, 3.0, 5.0, 5.0]

    def run(name: str, times: list[float]) -> None:
        calls.append(name)
        clock[0] += times[calls.count(name) - 1]

    monkeypatch.setattr("storage.time.perf_counter", lambda: clock[0])
    got = storage.paired(
        lambda: run("plain", plain_s),
        lambda: run("store", store_s),
        5,
        lambda: calls.append("drop plain"),
        lambda: calls.append("drop store"),
    )
    assert calls[:6] == ["drop plain", "plain", "drop store", "store", "drop plain", "plain"]
    # the medians, and the median of the turns' ratios (1/3, 2/3, 1, 0.8, 1), not 3.0 / 3.0
    assert got == (3.0, 3.0, 0.8)


def test_transfer_bench_samples_every_function_in_turn_each_round_starting_further_along(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    import transfer

    clock = [0.0]
    calls: list[str] = []

    # the machine drifts: the n-th call of any function takes n seconds
    def run(name: str) -> None:
        calls.append(name)
        clock[0] += len(calls)

    monkeypatch.setattr("transfer.time.perf_counter", lambda: clock[0])
    got = transfer.interleaved({k: functools.partial(run, k) for k in "abc"}, 3)
    # one warm-up each, then rounds a b c, b c a, c a b
    assert calls == list("abc") + list("abc") + list("bca") + list("cab")
    assert got == {"a": [4.0, 9.0, 11.0], "b": [5.0, 7.0, 12.0], "c": [6.0, 8.0, 10.0]}


def test_the_main_job_routes_each_option_to_the_benchmarks_that_have_it() -> None:
    """scripts/run.sh's options: one both benchmarks have goes to both, one only the stress
    benchmark has to it alone (it used to reach the latency benchmark too and fail there),
    values and ``--flag=value`` kept with their flag, an unknown option refused."""
    import main_job

    parsers = {name: make() for name, make in main_job.BENCHES.items()}
    argv = [
        "--out",
        "/tmp/x",
        "--repeats",
        "2",
        "--no-rotation",
        "--iterations=3",
        "--tiers",
        "none",
        "l2",
        "--model",
        "tiny",
    ]
    split = main_job.route(argv, parsers)
    assert split["bench_hicache.py"] == [
        "--out",
        "/tmp/x",
        "--iterations=3",
        "--tiers",
        "none",
        "l2",
        "--model",
        "tiny",
    ]
    assert split["bench_hicache_stress.py"] == ["--out", "/tmp/x", "--repeats", "2", "--no-rotation", "--model", "tiny"]
    for bad, says in ((["--bogus", "1"], "--bogus: no benchmark has this option"), (["stray"], "stray: not an option")):
        with pytest.raises(ValueError, match=says):
            main_job.route(bad, parsers)


@pytest.mark.parametrize(
    ("argv", "says"),
    [
        (["--prefix-tokens", "350", "3500"], "bench_hicache_stress.py takes one value after --prefix-tokens"),
        (["--out"], "--out: bench_hicache.py takes one value after --out"),
        (["--no-rotation", "x"], "--no-rotation x: bench_hicache_stress.py takes no value"),
        (["--out", "/tmp/x", "--tiers"], "--tiers: bench_hicache.py takes one or more values"),
    ],
    ids=["several-for-one", "out-without-value", "value-for-a-switch", "tiers-without-values"],
)
def test_the_main_job_refuses_values_a_benchmark_would_refuse(argv: list[str], says: str) -> None:
    """Values one of the benchmarks would refuse are an error naming it before anything
    runs (``--prefix-tokens 350 3500`` ran the latency benchmark, then failed in the stress
    one); the same option with one value goes to both."""
    import main_job

    parsers = {name: make() for name, make in main_job.BENCHES.items()}
    with pytest.raises(ValueError, match=says):
        main_job.route(argv, parsers)
    split = main_job.route(["--prefix-tokens", "350"], parsers)
    assert split == {name: ["--prefix-tokens", "350"] for name in parsers}


@pytest.mark.parametrize(
    ("argv", "says"),
    [
        (["--requests", "abc"], "error: --requests abc: not an integer"),
        (["--prefix-tokens", "0"], "error: --prefix-tokens 0: must be an integer in [1, 1,000,000]"),
        (["--repeats", "-1"], "error: --repeats -1: must be at least"),
    ],
    ids=["both-not-an-int", "both-zero", "stress-only-negative"],
)
def test_the_main_job_checks_every_value_before_either_benchmark_runs(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str], argv: list[str], says: str
) -> None:
    """A value a benchmark refuses ends the main job with its usage error (exit 2) before
    either benchmark starts (``--requests abc`` ran the whole latency benchmark first)."""
    import main_job

    started: list[list[str]] = []

    def call(cmd: list[str]) -> int:
        started.append(cmd)
        return 0

    monkeypatch.setattr(subprocess, "call", call)
    assert main_job.main([*argv, "--out", str(tmp_path / "out")]) == 2
    assert started == [] and says in capsys.readouterr().err
    assert main_job.main(["--out", str(tmp_path / "out")]) == 0 and len(started) == 2


def test_the_main_job_refuses_an_unknown_option_in_one_line() -> None:
    run = subprocess.run(
        [sys.executable, str(ROOT / "bench" / "main_job.py"), "--bogus", "1"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert (run.returncode, run.stdout, run.stderr) == (2, "", "error: --bogus: no benchmark has this option\n")


def test_result_files_are_json_without_nan(tmp_path: Path) -> None:
    """A figure with nothing to compare against (a speed-up without its recompute row) is
    written as null, not NaN (which is not JSON), and plots."""
    rows = [{"tier": "l2", "prefix_tokens": 350, "ttft_ms": 7.0, "speedup": float("nan"), "x": [float("inf"), 1.0]}]
    stem = common.write_results(tmp_path, "bench_hicache-tiny", "cpu", {"model": "tiny"}, rows, "t")
    text = stem.with_suffix(".json").read_text()
    assert "NaN" not in text and "Infinity" not in text
    doc = json.loads(text)
    assert doc["rows"][0]["speedup"] is None and doc["rows"][0]["x"] == [None, 1.0]


def test_an_out_directory_that_cannot_be_written_is_refused_with_the_flags() -> None:
    """A place the permission bits allow (root passes os.access everywhere) but where no file
    can be made: refused when the flags are read, not after the first benchmark ran."""
    with pytest.raises(argparse.ArgumentTypeError, match=r"(cannot write in /proc|/proc is not writable)"):
        common.out_dir("/proc/hicache-results")


def test_the_main_job_ends_quietly_with_130_on_ctrl_c(monkeypatch: pytest.MonkeyPatch) -> None:
    """The benchmark it runs gets the Ctrl-C too and says "interrupted"; the main job adds
    no traceback of its own."""
    import main_job

    def interrupted(*args: object, **kwargs: object) -> int:
        raise KeyboardInterrupt

    monkeypatch.setattr(subprocess, "call", interrupted)
    assert main_job.main([]) == 130


def test_output_into_a_closed_pipe_ends_quietly() -> None:
    """``| head``: once the reader left, the benchmark stops with 141 (as a SIGPIPE would)
    and no "error: [Errno 32] Broken pipe" (exit 2 is for bad flags)."""
    code = "import common\ncommon.guarded(lambda: [print('x' * 200) for _ in range(200_000)])"
    proc = subprocess.Popen(
        [sys.executable, "-c", code], cwd=ROOT / "bench", stdout=subprocess.PIPE, stderr=subprocess.PIPE
    )
    assert proc.stdout is not None and proc.stderr is not None
    assert proc.stdout.readline().strip() == b"x" * 200
    proc.stdout.close()
    err = proc.stderr.read().decode()
    assert proc.wait(timeout=120) == 141, err
    assert err == ""


@pytest.mark.parametrize("script", ["bench_hicache.py", "bench_hicache_stress.py", "transfer.py"])
def test_ctrl_c_while_a_benchmark_imports_torch_is_one_line_and_130(script: str) -> None:
    """Ctrl-C during a benchmark's seconds-long imports (torch first) prints ``interrupted``
    and exits 130, as it does later in the run (it was a traceback)."""
    path = str(ROOT / "bench" / script)
    run = run_with_import_interrupted(
        f"sys.path.insert(0, {str(ROOT / 'bench')!r})\n"
        f"sys.argv = [{path!r}, '--help']\n"
        f"runpy.run_path({path!r}, run_name='__main__')\n"
    )
    assert (run.returncode, run.stdout, run.stderr) == (130, "", "interrupted\n")


def test_ctrl_c_while_the_main_job_imports_torch_is_one_line_and_130() -> None:
    """Ctrl-C during the main job's seconds-long import of the benchmarks (and torch) prints
    ``interrupted`` and exits 130, as it does later (it was a traceback)."""
    main_job = str(ROOT / "bench" / "main_job.py")
    run = run_with_import_interrupted(
        f"sys.path.insert(0, {str(ROOT / 'bench')!r})\n"
        f"sys.argv = [{main_job!r}, '--help']\n"
        f"runpy.run_path({main_job!r}, run_name='__main__')\n"
    )
    assert (run.returncode, run.stdout, run.stderr) == (130, "", "interrupted\n")


@pytest.mark.parametrize(
    ("text", "says"),
    [
        ("{}", 'not a bench_hicache result (it needs "rows", a list, and "meta", an object)'),
        ("[1]", 'not a bench_hicache result (it needs "rows", a list, and "meta", an object)'),
        ("{x", "not JSON (Expecting property name enclosed in double quotes: line 1 column 2 (char 1))"),
    ],
)
def test_plots_names_what_is_wrong_with_a_result_file(tmp_path: Path, text: str, says: str) -> None:
    """A result file that is not JSON, or JSON without rows and meta: one line saying which,
    not the repr of a KeyError."""
    path = tmp_path / "bench_hicache-x.json"
    path.write_text(text)
    run = subprocess.run(
        [sys.executable, "plots.py", str(path)], cwd=ROOT / "bench", capture_output=True, text=True, timeout=120
    )
    assert (run.returncode, run.stdout, run.stderr) == (2, "", f"error: {path}: {says}\n")


def test_a_probes_defaults_yield_to_the_users_flags() -> None:
    """A probe passes its defaults before the user's words: each flag is given once (the
    parser refuses one given twice), the user's value when the user gives it."""
    from common import with_defaults

    defaults = ["--no-rotation", "--repeats", "1", "--decoders", "4"]
    assert with_defaults(defaults, []) == defaults
    assert with_defaults(defaults, ["--decoders", "8", "--no-rotation"]) == [
        "--repeats",
        "1",
        "--decoders",
        "8",
        "--no-rotation",
    ]
    assert with_defaults(defaults, ["--repeats=3"]) == ["--no-rotation", "--decoders", "4", "--repeats=3"]
