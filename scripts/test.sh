#!/usr/bin/env bash
# The test command: set up, then ruff, mypy --strict and pytest (fast hypothesis profile).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
export HYPOTHESIS_PROFILE=${HYPOTHESIS_PROFILE:-ci}
echo "== ruff"; .venv/bin/ruff check .
echo "== mypy --strict"; .venv/bin/mypy
echo "== pytest (hypothesis profile: $HYPOTHESIS_PROFILE)"
# NOTE: a worker per core (HICACHE_TEST_WORKERS to change it; 0: in this process), each
# test file on one worker: a file's module-scoped servers and caches stay in one process.
.venv/bin/python -m pytest -q -m "not gpu" -n "${HICACHE_TEST_WORKERS:-auto}" --dist loadfile "$@"
