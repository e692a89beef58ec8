#!/usr/bin/env bash
# The GPU run: the GPU test suite and the benchmarks, writing everything to one directory.
#
#   bash bench/gpu_e2e.sh [PHASE...]        from the repository root on the GPU machine
#
# Phases (default: tests latency stress micro):
#   tests    pytest of tests/gpu, tests/engine, tests/backends, tests/core  -> gpu_tests.txt  (~5 min)
#   latency  bench_hicache.py, TTFT by tier at 350..3500 tokens              (~4 min)
#   stress   bench_hicache_stress.py, rotation + overlap, 3 repeats          (~8 min)
#   micro    transfer.py and storage.py (L1<->L2 and L3 bandwidth)           (~2 min)
#   soak     soak.py under faults and aborts for SOAK_MINUTES (default 5)
# Settings: OUT (default /tmp/hicache-gpu), MODEL (default qwen3-8b), SOAK_MODEL (qwen3-4b),
# REPEATS (3), HICACHE_BENCH_COMMIT (the commit the JSON names; set it where the copy's git is stale). Wheels under .whl/ (e.g. cuda-bindings) are installed first: the GPU machine
# has no package index. Each phase has a time limit, so a hang still leaves the others' files.
set -uo pipefail
OUT=${OUT:-/tmp/hicache-gpu}
MODEL=${MODEL:-qwen3-8b}
mkdir -p "$OUT"
if ls .whl/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --upgrade --target /tmp/site .whl/*.whl
  export PYTHONPATH=/tmp/site:${PYTHONPATH:-}
fi
export PYTHONPATH=$PWD:$PWD/bench:${PYTHONPATH:-} PYTHONUNBUFFERED=1 HICACHE_BENCH_OUT=$OUT
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader
quiet() { grep -v "it/s\]"; }  # progress bars
for phase in "${@:-tests latency stress micro}"; do
  for p in $phase; do
    echo "== $p $(date +%T)"
    case $p in
      tests)
        timeout -k 10 540 python3 -X faulthandler -m pytest -q -p no:cacheprovider -o faulthandler_timeout=120 \
          tests/gpu tests/engine tests/backends tests/core > "$OUT/gpu_tests.txt" 2>&1
        tail -3 "$OUT/gpu_tests.txt"; grep -E "^(FAILED|ERROR)" "$OUT/gpu_tests.txt" | head -20 ;;
      latency)
        timeout -k 10 570 python3 bench/bench_hicache.py --model "$MODEL" --out "$OUT" 2>&1 | quiet | tail -20 ;;
      stress)
        timeout -k 10 570 python3 bench/bench_hicache_stress.py --model "$MODEL" --repeats "${REPEATS:-3}" --out "$OUT" \
          2>&1 | tee "$OUT/stress.log" | quiet | tail -24 ;;
      micro)
        timeout -k 10 280 python3 bench/transfer.py --out "$OUT" 2>&1 | tail -14
        timeout -k 10 280 python3 bench/storage.py --dir "$OUT" --out "$OUT" 2>&1 | tail -14 ;;
      soak)
        timeout -k 10 570 python3 bench/soak.py --model "${SOAK_MODEL:-qwen3-4b}" --device cuda \
          --minutes "${SOAK_MINUTES:-5}" --out "$OUT" 2>&1 | quiet | tail -25 ;;
      *) echo "unknown phase $p (tests latency stress micro soak)"; exit 2 ;;
    esac
  done
done
echo "== done $(date +%T); results in $OUT"
