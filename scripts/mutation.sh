#!/usr/bin/env bash
# Mutation testing of hicache/spec and hicache/core with mutmut (slow: not part of CI).
#
#   scripts/mutation.sh [--sample N | --per-file N] [--seed S] [--jobs J] [--profile P]
#                       [--max-seconds S] [--only GLOB]... [--tests "PATHS"]
#   scripts/mutation.sh --report        # print the report of the last run again
#
# Works in a scratch copy (build/mutation, ignored by git) of the working tree, so uncommitted
# changes are measured and the repository's own config is untouched. --sample N runs N mutants
# drawn with a fixed seed (default 22) instead of all of them; --per-file N draws up to N from
# each file instead, so every file's score rests on enough mutants; --max-seconds bounds the run
# (mutmut runs the cheapest mutants first, so a cut run leaves out the slowest ones). Prints,
# per file, mutants killed (a timeout counts as killed) and survived, and the score; then
# every survivor with its diff. The listing stays in build/mutation/report.txt.
set -euo pipefail
cd "$(dirname "$0")/.."
ROOT=$PWD
SAMPLE=0
PER_FILE=0
SEED=22
JOBS=$(nproc)
PROFILE=ci
ONLY=()
TESTS="tests/spec tests/core tests/stateful tests/test_metrics.py"
MAX_SECONDS=0
REPORT_ONLY=0
die() { echo "mutation.sh: $*" >&2; exit 2; }
value() { [ $# -ge 2 ] && [ -n "$2" ] || die "$1 needs a value"; }
count() {  # flag, value, least: a whole number >= least
  value "$1" "${2-}"
  [[ "$2" =~ ^[0-9]{1,18}$ ]] && [ "$2" -ge "$3" ] || die "$1 $2: must be a whole number >= $3 (at most 18 digits)"
}
while [ $# -gt 0 ]; do
  case "$1" in
    --sample) count "$1" "${2-}" 0; SAMPLE=$2; shift 2 ;;
    --per-file) count "$1" "${2-}" 0; PER_FILE=$2; shift 2 ;;
    --seed) count "$1" "${2-}" 0; SEED=$2; shift 2 ;;
    --jobs) count "$1" "${2-}" 1; JOBS=$2; shift 2 ;;
    --profile) value "$1" "${2-}"; PROFILE=$2; shift 2 ;;
    --only) value "$1" "${2-}"; ONLY+=("$2"); shift 2 ;;
    --tests) value "$1" "${2-}"; TESTS=$2; shift 2 ;;
    --max-seconds) count "$1" "${2-}" 0; MAX_SECONDS=$2; shift 2 ;;
    --report) REPORT_ONLY=1; shift ;;
    -h|--help) sed -n '2,14p' "$0"; exit 0 ;;
    *) die "unknown argument $1 (--help lists them)" ;;
  esac
done
if [ "$SAMPLE" -gt 0 ] && [ "$PER_FILE" -gt 0 ]; then die "--sample and --per-file exclude each other"; fi
[ ${#ONLY[@]} -gt 0 ] || ONLY=("hicache/spec/*.py" "hicache/core/*.py")

PY=$ROOT/.venv/bin/python
WORK=$ROOT/build/mutation
if [ "$REPORT_ONLY" = 0 ]; then
[ -x "$PY" ] || bash scripts/setup.sh
# NOTE: pinned: the sampling step below calls mutmut's generation functions directly.
"$PY" -c 'import mutmut, sys; sys.exit(mutmut.__version__ != "3.8.1")' 2>/dev/null \
  || "$ROOT/.venv/bin/pip" install -q "mutmut==3.8.1" 2>&1 | grep -v -E "^WARNING: Location" || true

rm -rf "$WORK"
mkdir -p "$WORK"
git ls-files -co --exclude-standard -z -- hicache tests docs/examples pyproject.toml | tar --null -T - -cf - | tar -xf - -C "$WORK"

# Fastest tests first, so that -x stops a killed mutant's run early (durations: mutmut's stats).
cat > "$WORK/mutation_order.py" <<'EOF'
"""pytest plugin for the mutation run: order the selected tests by their measured duration."""

import json


def pytest_collection_modifyitems(config, items):
    try:
        with open("mutmut-stats.json") as f:
            durations = json.load(f)["duration_by_test"]
    except (OSError, ValueError, KeyError):
        return
    items.sort(key=lambda item: durations.get(item.nodeid, 0.0))
EOF

"$PY" - "$WORK/pyproject.toml" "$TESTS" "${ONLY[@]}" <<'EOF'
import json, sys
path, tests, *only = sys.argv[1:]
with open(path, "a") as f:
    f.write(f"""
[tool.mutmut]
source_paths = ["hicache"]
only_mutate = {json.dumps(only)}
also_copy = ["mutation_order.py", "docs"]
pytest_add_cli_args_test_selection = {json.dumps(tests.split())}
pytest_add_cli_args = ["-m", "not gpu and not slow", "-p", "no:cacheprovider", "-p", "mutation_order"]
use_git_change_detection = false
""")
EOF

cd "$WORK"
export HYPOTHESIS_PROFILE=$PROFILE
NAMES=()
if [ "$SAMPLE" -gt 0 ] || [ "$PER_FILE" -gt 0 ]; then
  mapfile -t NAMES < <("$PY" - "$SAMPLE" "$PER_FILE" "$SEED" "$JOBS" <<'EOF'
import contextlib, io, json, random, sys
from pathlib import Path

from mutmut import __main__ as mm

n, per_file, seed, jobs = (int(x) for x in sys.argv[1:])
with contextlib.redirect_stdout(io.StringIO()):
    mm.set_mutant_under_test("mutant_generation")
    mm.copy_src_dir()
    mm.copy_also_copy_files()
    mm.create_mutants(jobs)
by_file = {
    str(meta): sorted(json.loads(meta.read_text())["exit_code_by_key"]) for meta in sorted(Path("mutants").rglob("*.py.meta"))
}
total = sum(len(names) for names in by_file.values())
rng = random.Random(seed)
if per_file:
    chosen = [name for names in by_file.values() for name in rng.sample(names, min(per_file, len(names)))]
    print(f"sampling up to {per_file} mutants per file: {len(chosen)} of {total} (seed {seed})", file=sys.stderr)
else:
    names = sorted(name for names in by_file.values() for name in names)
    chosen = rng.sample(names, min(n, len(names)))
    print(f"sampling {len(chosen)} of {total} mutants (seed {seed})", file=sys.stderr)
print("\n".join(sorted(chosen)))
EOF
  )
fi

echo "mutmut over ${ONLY[*]}; tests: $TESTS (hypothesis profile $PROFILE, $JOBS jobs); log: $WORK/mutmut.log"
printf '%s\n' "${NAMES[@]}" > "$WORK/sample.txt"
start=$(date +%s)
rc=0
if [ "$MAX_SECONDS" -gt 0 ]; then
  timeout --signal=INT --kill-after=60 "$MAX_SECONDS" "$ROOT/.venv/bin/mutmut" run --max-children "$JOBS" "${NAMES[@]}" \
    > "$WORK/mutmut.log" 2>&1 || rc=$?
else
  "$ROOT/.venv/bin/mutmut" run --max-children "$JOBS" "${NAMES[@]}" > "$WORK/mutmut.log" 2>&1 || rc=$?
fi
if [ "$rc" != 0 ] && [ "$rc" != 124 ]; then tail -c 4000 "$WORK/mutmut.log" | tr '\r' '\n' | tail -40; exit 1; fi
echo "ran in $(( $(date +%s) - start )) s$([ "$rc" = 124 ] && echo " (cut at --max-seconds: partial)")"
fi

if [ ! -f "$WORK/sample.txt" ]; then
  echo "error: no mutation run to report in $WORK (run: bash scripts/mutation.sh first)" >&2
  exit 2
fi
cd "$WORK"
"$PY" - "$WORK/sample.txt" "$ROOT/.venv/bin/mutmut" <<'EOF' | tee "$WORK/report.txt"
import json, subprocess, sys
from collections import Counter
from pathlib import Path

from mutmut.stats import status_by_exit_code

sample = {line.strip() for line in open(sys.argv[1]) if line.strip()}
ran = 0
by_file: dict[str, Counter[str]] = {}
survivors: list[tuple[str, str, str]] = []
for meta in sorted(Path("mutants").rglob("*.py.meta")):
    source = str(meta.relative_to("mutants"))[: -len(".meta")]
    for name, code in json.loads(meta.read_text())["exit_code_by_key"].items():
        if (sample and name not in sample) or code is None:
            continue
        ran += 1
        status = status_by_exit_code[code]
        counts = by_file.setdefault(source, Counter())
        counts[status] += 1
        if status in ("survived", "no tests", "suspicious"):
            survivors.append((source, name, status))
print(f"{ran} mutants ran" + (f" of {len(sample)} sampled" if sample else ""))
print(f"{'file':40} {'killed':>7} {'survived':>8} {'score':>6}   (timeouts count as killed)")
total = Counter()
for source, c in sorted(by_file.items()):
    killed = c["killed"] + c["timeout"] + c["caught by type check"] + c["segfault"]
    lived = c["survived"] + c["no tests"] + c["suspicious"]
    total["k"] += killed
    total["s"] += lived
    score = 100.0 * killed / (killed + lived) if killed + lived else 100.0
    print(f"{source:40} {killed:7} {lived:8} {score:5.0f}%")
all_ = total["k"] + total["s"]
print(f"{'all':40} {total['k']:7} {total['s']:8} {100.0 * total['k'] / max(all_, 1):5.0f}%")
print(f"\n{len(survivors)} survivors:")
for source, name, status in survivors:
    diff = subprocess.run([sys.argv[2], "show", name], capture_output=True, text=True).stdout
    changed = [line for line in diff.splitlines() if line[:1] in "+-" and line[:3] not in ("+++", "---")]
    print(f"\n{name} [{status}]")
    for line in changed:
        print(f"    {line.strip()}")
EOF
