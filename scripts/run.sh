#!/usr/bin/env bash
# The main job: set up, then the core demo (insert, match, evict across tiers, status).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
.venv/bin/python -m hicache.demo "$@"
