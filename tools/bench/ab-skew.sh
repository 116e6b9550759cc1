#!/usr/bin/env bash
# A/B of the skewed token_index routings (moejit-bench --skew) between a git revision (A) and the
# working tree (B), on the GPU machine: builds the library and moejit-bench of both under $AB_WORK
# (default /tmp/moejit-ab-skew; the revision exported with git archive), runs the working tree's
# GPU tests (moejit_gpu_tests, moejit_epilogue_gpu_tests, MOEJIT_REQUIRE_GPU=1: the heavy token's
# bits on every path and geometry, the skewed routings against the float64 reference), then
# `moejit-bench --skew` of A and B alternately, A B A B, and prints per shape, routing and drop
# rate each side's median over its two runs and B / A (under 1: B is faster). Logs in OUTDIR.
#
#   tools/bench/ab-skew.sh OUTDIR [REVISION]     (REVISION: default main)
#
# Environment: STEPS (default "build test ab"; any subset, in that order), AB_WORK. xxhash.h and
# libsodium come from .deps/ where the system lacks them. About 4-5 minutes on an H100, 16 cores.
# Exit status: 0 when every step passed, else the first failing step's.
set -uo pipefail
usage() { sed -n '2,14p' "$0"; exit 2; }
[ $# -ge 1 ] && [ $# -le 2 ] || usage
repo=$(cd "$(dirname "$0")/../.." && pwd)
out=$(mkdir -p "$1" && cd "$1" && pwd) || exit 2
rev=${2:-main}
steps=${STEPS:-build test ab}
work=${AB_WORK:-/tmp/moejit-ab-skew}
AB_NAME=ab-skew.sh
# shellcheck source-path=SCRIPTDIR source=ab_common.sh
. "$repo/tools/bench/ab_common.sh"

if has_step build; then
  ab_build "$rev" moejit-bench "moejit-bench moejit_gpu_tests moejit_epilogue_gpu_tests"
fi

if has_step test || has_step ab; then
  if ! nvidia-smi -L >"$out/gpu.txt" 2>&1; then
    fail 3 "no GPU here (nvidia-smi finds none): run this on the GPU machine"
    exit "$status"
  fi
  cat "$out/gpu.txt"
fi

if has_step test; then
  for t in moejit_gpu_tests moejit_epilogue_gpu_tests; do
    note "GPU tests: $t (MOEJIT_REQUIRE_GPU=1) -> $out/$t.log"
    MOEJIT_REQUIRE_GPU=1 MOEJIT_CACHE_DIR="$work/cache-new" timeout 300 \
      "$new_build/tests/gpu/$t" >"$out/$t.log" 2>&1 || fail 1 "$t failed (log: $out/$t.log)"
    grep -E "^\[  (PASSED|FAILED|SKIPPED) |^\[       OK \].*(Skewed|Heavy)" "$out/$t.log" | tail -n 12
  done
fi

if has_step ab; then
  # Each side its own kernel cache: the first run compiles (outside the timed rounds).
  run_side() {  # run_side A|B ROUND
    local bench="$base_build/tools/bench/moejit-bench" cache="$work/cache-base"
    [ "$1" = B ] && bench="$new_build/tools/bench/moejit-bench" cache="$work/cache-new"
    note "moejit-bench --skew, $1 round $2 -> $out/skew-$1$2.txt"
    MOEJIT_CACHE_DIR="$cache" timeout 150 "$bench" --skew --no-l2-warm \
      --json "$out/skew-$1$2.json" >"$out/skew-$1$2.txt" 2>&1 ||
      fail 1 "moejit-bench --skew ($1 round $2) failed (log: $out/skew-$1$2.txt)"
  }
  for round in 1 2; do
    run_side A "$round"
    run_side B "$round"
  done
  note "B / A per routing (median of each side's two runs' medians) -> $out/ab-skew.txt"
  python3 - "$out" >"$out/ab-skew.txt" <<'EOF' || fail 1 "could not compare (see $out/ab-skew.txt)"
import json, statistics, sys, os
out = sys.argv[1]
def load(side):
    runs = {}
    for r in (1, 2):
        path = os.path.join(out, f"skew-{side}{r}.json")
        if not os.path.exists(path):
            continue
        for c in json.load(open(path)).get("skew_cases", []):
            if "median_us" in c:
                key = (c["label"], c["routing"], c["drop_percent"])
                runs.setdefault(key, []).append(c["median_us"])
    return runs
a, b = load("A"), load("B")
print(f"{'shape':<24} {'routing':<24} {'drop':>5} {'A_us':>10} {'B_us':>10} {'B/A':>7}")
ratios = []
for key in a:
    if key not in b:
        continue
    ma, mb = statistics.median(a[key]), statistics.median(b[key])
    ratios.append(mb / ma)
    print(f"{key[0]:<24} {key[1]:<24} {key[2]:>5} {ma:>10.2f} {mb:>10.2f} {mb / ma:>7.3f}")
if not ratios:
    sys.exit("no routing measured on both sides")
print(f"{len(ratios)} routings; B/A from {min(ratios):.3f} to {max(ratios):.3f}, "
      f"geometric mean {statistics.geometric_mean(ratios):.3f}")
EOF
  cat "$out/ab-skew.txt"
fi
exit "$status"
