#!/usr/bin/env bash
# The main job: set up, then a short run of the end-to-end benchmarks — TTFT by tier
# (recompute / L2 / L3) and throughput under prefix rotation — printing tables and writing
# JSON + PNG to $HICACHE_BENCH_OUT (default /tmp/hicache-bench; the checkout stays clean).
# Without a GPU: the tiny model on CPU (about 30 s on 2 idle cores); with one: the Qwen3-8B shape in
# bf16. Each extra option goes to the benchmark(s) that have it (bench/main_job.py; e.g. --out DIR).
set -euo pipefail
ROOT=$(cd "$(dirname "$0")/.." && pwd)
(cd "$ROOT" && bash scripts/setup.sh)
# NOTE: run from the caller's directory, so a relative --out means what the caller meant;
# unbuffered, so progress shows as it happens when the output goes to a pipe or a log.
PYTHONUNBUFFERED=1 "$ROOT/.venv/bin/python" "$ROOT/bench/main_job.py" "$@"
