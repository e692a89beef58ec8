#!/usr/bin/env bash
# GPU-side runs, in phases, for device calls. Usage on the GPU machine, from the repo root:
#   bash bench/gpu_e2e.sh tests latency8b     (phases run in the order given)
# Phases: tests, transfer (race demo, transfer and storage benchmarks), latency8b, latency8b-quick,
# attnprobe (attention backends: memory per shape, speed of a tail call and a decode call), attention8b (ATTN_VARIANTS, default 6 attention variants, ~1.1 min each), latency4b, stress8b, stress4b (STRESS_REPEATS, default 3: ~7.5 min each), soak (SOAK_MINUTES, default 5),
# layered8b (LAYERED_VARIANTS, default off on: ~1.1 min each), overlap8b (the overlap variants with
# short fresh prefills eager and graphed (the default), ~2 min), launchprofile (bench/launch_profile.py, ~1 min), hangprobe (the layered restore beside decoding, ~2 min), fwdprofile (kernels of a restored tail's forward by kind), layerload (layer-by-layer H2D ways), soak-bisect (SOAK_VARIANTS from base nograph torch noverify arena1 mmapfixed; ~2.2 min each), bookkeeping.
# latency8b, latency8b-quick and latency4b run with --hicache-layered-restore ${LAYERED:-on} (the README tables);
# stress8b, stress4b, soak and soakrestores (policy always, smaller L1: restores throughout) with the
# engine's default unless LAYERED is set.
# Results go to $OUT (default bench/results). stress and soak phases stop after PHASE_TIMEOUT s (570), so a
# hang leaves the device call time to return what it wrote (stress phases tee their log to $OUT).
set -uo pipefail
OUT=${OUT:-bench/results}
mkdir -p "$OUT"
if ls .whl/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
  export PYTHONPATH=/tmp/site:${PYTHONPATH:-}
fi
export PYTHONPATH=$PWD:${PYTHONPATH:-} PYTHONUNBUFFERED=1 TQDM_MININTERVAL=5
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader
df -h . /dev/shm | tail -2
for phase in "$@"; do
  echo "== $phase $(date +%T)"
  case $phase in
    tests)
      timeout -k 10 480 python3 -X faulthandler -m pytest -q -p no:cacheprovider -o faulthandler_timeout=120 tests/gpu tests/engine tests/backends \
        tests/core/test_controller.py > "$OUT/gpu_tests-e2e.txt" 2>&1
      tail -3 "$OUT/gpu_tests-e2e.txt"; grep -E "^(FAILED|ERROR)" "$OUT/gpu_tests-e2e.txt" | head -20 ;;
    transfer)
      python3 bench/race_demo.py --trials 5
      python3 bench/transfer.py --out "$OUT" 2>&1 | tail -14
      python3 bench/storage.py --dir /tmp --out "$OUT" 2>&1 | tail -14
      python3 bench/storage.py --dir /tmp --out "$OUT" --chunk-pages 1000000 --tag h200-unchunked 2>&1 | tail -14 ;;
    layerload) python3 bench/layer_load.py --out "$OUT" ;;  # zero-copy layer-ranged H2D vs DMA, ~1 min
    fwdprofile) python3 bench/forward_profile.py --context 3500 --tail 22 --out "$OUT/forward_profile-$(date +%F)-h200.json" ;;  # ~1 min
    bookkeeping) python3 bench/bookkeeping.py --prefix-tokens 3500 && python3 bench/bookkeeping.py --prefix-tokens 350 ;;
    latency8b) (cd bench && python3 bench_hicache.py --model qwen3-8b --hicache-layered-restore "${LAYERED:-on}" --out "$OUT" 2>&1 | grep -v "it/s\]" | tail -20) ;;
    latency8b-quick) (cd bench && python3 bench_hicache.py --model qwen3-8b --prefix-tokens 350 3500 --tiers none l2 --hicache-layered-restore "${LAYERED:-on}" \
        --out "$OUT" --tag h200-quick 2>&1 | grep -v "it/s\]" | tail -12) ;;
    attnprobe) python3 bench/rss_shapes.py --shapes 300 2>&1 | grep -v -i "warn\|^  F\." ;;  # ~1 min
    attention8b)  # attention variants side by side (README: what the cuDNN fix costs), ~1.1 min each
      for v in ${ATTN_VARIANTS:-paged:off gqa:off gqa:on gqa:graphs fold:off fold:graphs}; do
        echo "-- attention ${v%%:*}, cuDNN ${v#*:}"
        (cd bench && python3 bench_hicache.py --model qwen3-8b --prefix-tokens 350 3500 --tiers none l2 \
          --attention "${v%%:*}" --attention-cudnn "${v#*:}" --out "$OUT" --tag "h200-attn-${v%%:*}-${v#*:}" 2>&1 \
          | grep -E "^ +[0-9]+ +(none|l2)")
      done ;;
    layered8b)  # layered restore off and on side by side (latency quick rows), ~1.1 min each
      for v in ${LAYERED_VARIANTS:-off on}; do
        echo "-- layered restore $v"
        (cd bench && python3 bench_hicache.py --model qwen3-8b --prefix-tokens 350 3500 --tiers none l2 \
          --hicache-layered-restore $v --out "$OUT" --tag "h200-layered-$v" 2>&1 | grep -E "^ +[0-9]+ +(none|l2)|Error")
      done ;;
    latency4b) (cd bench && python3 bench_hicache.py --model qwen3-4b --hicache-layered-restore "${LAYERED:-on}" --out "$OUT" 2>&1 | grep -v "it/s\]" | tail -20) ;;
    stress8b) (cd bench && timeout -k 10 "${PHASE_TIMEOUT:-570}" python3 bench_hicache_stress.py --model qwen3-8b --disk-dir "$PWD" --repeats "${STRESS_REPEATS:-3}" \
        ${LAYERED:+--hicache-layered-restore "$LAYERED"} --out "$OUT" 2>&1 | tee "$OUT/$phase.log" | grep -v "it/s\]" | tail -18) ;;
    stress4b) (cd bench && timeout -k 10 "${PHASE_TIMEOUT:-570}" python3 bench_hicache_stress.py --model qwen3-4b --disk-dir "$PWD" --repeats "${STRESS_REPEATS:-3}" \
        ${LAYERED:+--hicache-layered-restore "$LAYERED"} --out "$OUT" 2>&1 | tee "$OUT/$phase.log" | grep -v "it/s\]" | tail -18) ;;
    soak-bisect)  # where the GPU soak's resident memory grows: one short soak per variant (SOAK_VARIANTS)
      for name in ${SOAK_VARIANTS:-base nograph torch mmapfixed}; do
        env=(); flags=()
        case $name in
          nograph) flags=(--disable-cuda-graph) ;;
          torch) flags=(--hicache-transfer-backend torch) ;;
          noverify) flags=(--no-verify-pages) ;;
          arena1) env=(MALLOC_ARENA_MAX=1) ;;
          mmapfixed) env=(MALLOC_MMAP_THRESHOLD_=131072 MALLOC_TRIM_THRESHOLD_=131072) ;;
        esac
        echo "-- $name"
        env "${env[@]}" python3 bench/soak.py --model qwen3-4b --device cuda --minutes "${SOAK_BISECT_MINUTES:-1.75}" \
          --sample-s 15 --out "$OUT" --tag "h200-$name" "${flags[@]}" 2>&1 | grep -E "RSS|errors|leaks|anon memory"
      done ;;
    hangprobe)  # the layered restore beside concurrent decoding: which stream/event stalls (~1 min each)
      echo "-- the stream pattern alone (bench/layered_hang_min.py)"
      timeout 120 python3 bench/layered_hang_min.py --rounds 300 > "$OUT/hang_min.log" 2>&1; tail -8 "$OUT/hang_min.log"
      for v in "" "--disable-cuda-graph"; do
        echo "-- layered restore with decoders ${v:-(graphs)}"
        log="$OUT/hang_probe${v:+-nograph}.log"
        (cd bench && timeout 300 python3 layered_hang_probe.py --model qwen3-8b --requests 40 $v --out "$OUT" \
          --tag h200-hangprobe > "$log" 2>&1); grep -v "it/s\]" "$log" | tail -12
      done ;;
    soakrestores)  # restores on every request a prefix allows (policy always, smaller L1), ~3 min
      timeout -k 10 "${PHASE_TIMEOUT:-570}" python3 bench/soak.py --model qwen3-4b --device cuda --minutes "${SOAK_MINUTES:-2.5}" \
        --num-pages 900 --hicache-policy always ${LAYERED:+--hicache-layered-restore "$LAYERED"} --out "$OUT" \
        --tag h200-restores${LAYERED:+-layered-$LAYERED} 2>&1 | grep -v "it/s\]" | tail -28 ;;
    overlap8b)  # the overlap variants, short fresh prefills eager and graph-replayed, side by side (~2 min)
      for v in "--cuda-graph-short-prefills off" ""; do
        echo "-- overlap ${v:-(default: short prefills graphed)}"
        (cd bench && timeout -k 10 280 python3 bench_hicache_stress.py --model qwen3-8b --no-rotation --repeats 2 $v \
          --out "$OUT" --tag "h200-overlap${v:+-short-eager}" 2>&1 | grep -v "it/s\]" | tail -9)
      done ;;
    launchprofile)  # where the host time of starting a layered restore goes (~1 min)
      (cd bench && timeout -k 10 200 python3 launch_profile.py --model qwen3-8b --out "$OUT" --tag h200-launch-profile 2>&1 \
        | grep -v "it/s\]" | tee "$OUT/launch_profile.log" | tail -24) ;;
    soak) timeout -k 10 "${PHASE_TIMEOUT:-570}" python3 bench/soak.py --model qwen3-4b --device cuda --minutes "${SOAK_MINUTES:-5}" ${LAYERED:+--hicache-layered-restore "$LAYERED"} --out "$OUT" 2>&1 | tail -25 ;;
  esac
done
echo "== done $(date +%T)"
