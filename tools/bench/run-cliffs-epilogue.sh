#!/usr/bin/env bash
# The benchmark cases of issues 58 and 59 on the GPU machine, in one command: build (build-gpu/),
# then the parts asked for (default: all of them), each with its own log and JSON in the output
# directory given as $1 (default ./bench-out):
#
#   skew      moejit-bench --skew  -> skew.txt, skew.json; peers.py --skew -> peers-skew.txt/json
#             (skewed token_index routings, each over the uniform routing's time: the 1.5x target;
#             index_add_ and the Triton atomic scatter on the very same routings)
#   awkward   moejit-bench --awkward-h -> awkward.txt/json; peers.py --awkward-h ->
#             peers-awkward.txt/json (H = 1000, 1001, 2880, 5000, 7000, 7169 in every dtype:
#             %adj, and every peer paired with libmoejit)
#   epilogue  epilogue_peers.py -> epilogue.txt/json (issue 59's chains, their checks, the bytes
#             and the time a fused call must reach)
#
#   tools/bench/run-cliffs-epilogue.sh "$OUT"                 # all (estimated 12 minutes, H100)
#   tools/bench/run-cliffs-epilogue.sh "$OUT" skew awkward    # estimated 7 minutes
#   tools/bench/run-cliffs-epilogue.sh "$OUT" epilogue        # estimated 5 minutes
#   QUICK=1 tools/bench/run-cliffs-epilogue.sh "$OUT"         # a smoke run: fewer shapes and runs
#   EPILOGUE_ARGS="--shapes decode" tools/bench/run-cliffs-epilogue.sh "$OUT" epilogue
#                                    # more epilogue_peers.py options (--shapes, --epilogue, ...)
#
# Exit status: 0 when every step passed; otherwise the first failing step's status (the later
# steps still run). The summaries are printed last.
set -uo pipefail
cd "$(dirname "$0")/../.." || exit 1
out=$(mkdir -p "${1:-./bench-out}" && cd "${1:-./bench-out}" && pwd)
shift || true
parts=("$@")
[ ${#parts[@]} -gt 0 ] || parts=(skew awkward epilogue)
for p in "${parts[@]}"; do
  case $p in skew | awkward | epilogue) ;; *)
    echo "run-cliffs-epilogue.sh: unknown part '$p' (skew, awkward, epilogue)"
    exit 2
    ;;
  esac
done
quick=()
[ -n "${QUICK:-}" ] && quick=(--quick)
status=0
note() { printf '\n### %s\n' "$*"; }
step() { # name, log, timeout, command...: runs it, records its status
  local name=$1 log=$2 limit=$3
  shift 3
  note "$name -> $log"
  timeout "$limit" "$@" >"$log" 2>&1
  local rc=$?
  if [ $rc -ne 0 ]; then
    echo "run-cliffs-epilogue.sh: $name failed with status $rc (log: $log)"
    [ "$status" -ne 0 ] || status=$rc
  fi
}
wants() { [[ " ${parts[*]} " == *" $1 "* ]]; }

note "build ($(nproc) cores) -> $out/build.log"
tools/bench/build-gpu.sh "$out/build.log" || exit 1
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem,temperature.gpu,power.draw \
  --format=csv >"$out/gpu-state.csv" 2>&1 || true
bench=build-gpu/tools/bench/moejit-bench
export MOEJIT_LIBRARY="$PWD/build-gpu/libmoejit.so"

if wants skew; then
  step "moejit-bench --skew" "$out/skew.txt" 200 \
    "$bench" --skew --no-l2-warm "${quick[@]}" --json "$out/skew.json"
  step "peers.py --skew" "$out/peers-skew.txt" 240 \
    python3 tools/bench/peers.py --skew --no-l2-warm "${quick[@]}" --json "$out/peers-skew.json"
fi
if wants awkward; then
  step "moejit-bench --awkward-h" "$out/awkward.txt" 200 \
    "$bench" --awkward-h --no-l2-warm "${quick[@]}" --json "$out/awkward.json"
  step "peers.py --awkward-h" "$out/peers-awkward.txt" 300 \
    python3 tools/bench/peers.py --awkward-h --no-l2-warm "${quick[@]}" \
    --json "$out/peers-awkward.json"
fi
if wants epilogue; then
  step "epilogue_peers.py" "$out/epilogue.txt" 540 \
    python3 tools/bench/epilogue_peers.py "${quick[@]}" ${EPILOGUE_ARGS:-} --json "$out/epilogue.json"
fi

# Summaries last: the end of the output is what a remote run hands back.
if wants skew; then
  note "moejit-bench --skew (full output in skew.txt)"
  tac "$out/skew.txt" | sed '/^Skewed token_index routing/q' | tac  # the summary: the last table
  note "peers.py --skew summary (per-routing tables in peers-skew.txt)"
  sed -n '/^Skewed token_index routing/,$p' "$out/peers-skew.txt"
fi
if wants awkward; then
  note "moejit-bench --awkward-h summary (full output in awkward.txt)"
  sed -n '/^Summary/,$p' "$out/awkward.txt"
  note "peers.py --awkward-h: paired ratios (peers-awkward.txt)"
  grep -E '^== | / libmoejit_' "$out/peers-awkward.txt"
fi
if wants epilogue; then
  note "epilogue_peers.py summary (per-case tables in epilogue.txt)"
  sed -n '/^Summary/,$p' "$out/epilogue.txt"
fi
grep -hE 'FAIL|failed|no GPU|Traceback' "$out"/*.txt 2>/dev/null | tail -n 12
exit "$status"
