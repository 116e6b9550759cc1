#!/usr/bin/env bash
# One command on the GPU machine: build (Release, Ninja, build-gpu/), run moejit-bench on every
# case with --jit, run the peers on the same shapes, merge. Everything lands in the directory given
# as $1 (default ./bench-out); the compact tables are printed last.
#
#   tools/bench/run-h200.sh "$OUT"     # 2-4 minutes on an H200 (build, bench, peers twice)
#
# Exit status: 0 when every step passed; otherwise the first failing step's status (the later steps
# still run, so one failure does not lose the other figures).
set -uo pipefail
cd "$(dirname "$0")/../.." || exit 1
out=$(mkdir -p "${1:-./bench-out}" && cd "${1:-./bench-out}" && pwd)
status=0
note() { printf '\n### %s\n' "$*"; }
step_failed() { echo "run-h200.sh: $1 failed with status $2 (log: $3)"; [ "$status" -ne 0 ] || status=$2; }

note "build ($(nproc) cores) -> $out/build.log"
tools/bench/build-gpu.sh "$out/build.log" || exit 1
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem,temperature.gpu,power.draw \
  --format=csv >"$out/gpu-state.csv" 2>&1 || true

note "moejit-bench --jit -> $out/bench.txt, bench.json"
timeout 240 build-gpu/tools/bench/moejit-bench --jit --json "$out/bench.json" >"$out/bench.txt" 2>&1
rc=$?
[ $rc -eq 0 ] || step_failed moejit-bench $rc "$out/bench.txt"

note "peers.py -> $out/peers.txt, peers.json"
peer_cases=()
[ -s "$out/bench.json" ] && peer_cases=(--cases-from "$out/bench.json")
MOEJIT_LIBRARY="$PWD/build-gpu/libmoejit.so" timeout 360 python3 tools/bench/peers.py \
  "${peer_cases[@]}" --json "$out/peers.json" >"$out/peers.txt" 2>&1
rc=$?
[ $rc -eq 0 ] || step_failed peers.py $rc "$out/peers.txt"

# The decode shapes again, alone, in 1000 paired rounds: their contenders differ by hundredths of
# a microsecond, which the main run's 200 rounds do not resolve (tools/bench/NOTES.md, version 38).
note "peers.py, decode shapes, 1000 paired rounds -> $out/peers-decode.txt, peers-decode.json"
MOEJIT_LIBRARY="$PWD/build-gpu/libmoejit.so" timeout 240 python3 tools/bench/peers.py \
  "${peer_cases[@]}" --max-tokens 64 --reps 1000 --no-l2-warm --json "$out/peers-decode.json" \
  >"$out/peers-decode.txt" 2>&1
rc=$?
[ $rc -eq 0 ] || step_failed "peers.py (decode)" $rc "$out/peers-decode.txt"

if [ -s "$out/bench.json" ]; then
  peers_json=()
  [ -s "$out/peers.json" ] && peers_json=("$out/peers.json")
  [ -s "$out/peers.json" ] && [ -s "$out/peers-decode.json" ] &&
    peers_json+=(--decode-peers "$out/peers-decode.json")
  if ! { python3 tools/bench/merge_results.py "$out/bench.json" "${peers_json[@]}" >"$out/h200.json" &&
    python3 tools/bench/merge_results.py "$out/bench.json" "${peers_json[@]}" --markdown \
      >"$out/h200.md"; }; then
    step_failed merge_results.py 1 "$out/h200.json"
  fi
fi

# Tables last: the end of the output is what a remote run hands back.
note "moejit-bench (full output in bench.txt)"
sed -n '/^JIT figures/,$p' "$out/bench.txt" | head -n 12
sed -n '/^Summary/,$p' "$out/bench.txt"
grep -hE 'FAIL|failed|no GPU' "$out/bench.txt" "$out/peers.txt" 2>/dev/null | tail -n 8
note "merged (h200.json, h200.md; per-peer tables in peers.txt)"
[ -s "$out/h200.md" ] && cat "$out/h200.md"
[ "$status" -eq 0 ] || tail -n 15 "$out/bench.txt" "$out/peers.txt"
exit "$status"
