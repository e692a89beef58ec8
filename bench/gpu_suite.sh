#!/usr/bin/env bash
# One device call: GPU tests + transfer and storage benchmarks. Results go to $OUT (and
# bench/results/ when run by hand). Usage on the GPU machine, from the repo root:
#   bash bench/gpu_suite.sh
set -uo pipefail
OUT=${OUT:-bench/results}
mkdir -p "$OUT"
if ls .whl/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
  export PYTHONPATH=/tmp/site:${PYTHONPATH:-}
fi
export PYTHONPATH=$PWD:${PYTHONPATH:-} PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader
python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__, torch.cuda.get_device_name())"
df -h /tmp . | tail -n +1
echo "== GPU tests"
python3 -X faulthandler -m pytest -v -p no:cacheprovider tests/gpu tests/backends > "$OUT/gpu_tests.txt" 2>&1
grep -E "PASSED|FAILED|ERROR|passed|failed|Fatal|Segmentation|^tests" "$OUT/gpu_tests.txt" | grep -v PASSED | tail -20
grep -B2 -A12 "Fatal Python error" "$OUT/gpu_tests.txt" | grep -E "File .*(hicache|tests)/" | head -10
echo "== bench/race_demo.py (the stream race the engine's wait prevents)"
python3 bench/race_demo.py --trials 5
echo "== bench/transfer.py"
python3 bench/transfer.py --out "$OUT" 2>&1 | tail -14
echo "== bench/storage.py"
python3 bench/storage.py --dir /tmp --out "$OUT" 2>&1 | tail -14
python3 bench/storage.py --dir /tmp --out "$OUT" --chunk-pages 1000000 --tag h200-unchunked 2>&1 | tail -14
