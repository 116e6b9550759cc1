#!/usr/bin/env bash
# A/B of the working tree against a git revision, on the GPU machine: builds the library of both
# (outside the repository, under $AB_WORK, default /tmp/moejit-ab), runs the GPU tests on the
# working tree's build, then tools/bench/ab_libs.py with both libraries (and the revision's a
# second time, as the control whose intervals should contain 1) at every shape of
# tools/bench/BENCHMARKS.md and in every layout. Logs and tables land in OUTDIR.
#
#   tools/bench/ab-dispatch.sh OUTDIR [REVISION]     (REVISION: default main)
#
# Environment: STEPS (default "build test ab"; any subset, in that order, e.g. STEPS=ab to rerun
# the rounds on builds already made), ROUNDS (ab_libs.py rounds, default 1000), AB_WORK.
# The revision is exported with git archive (no worktree is added); xxhash.h and libsodium come
# from .deps/ where the system lacks them (the GPU machine: the lead carries .deps/).
# Exit status: 0 when every step passed; else the first failing step's status (later steps still
# run where they can). Without a GPU the test and A/B steps fail with a message saying so.
set -uo pipefail
usage() { sed -n '2,15p' "$0"; exit 2; }
[ $# -ge 1 ] && [ $# -le 2 ] || usage
repo=$(cd "$(dirname "$0")/../.." && pwd)
out=$(mkdir -p "$1" && cd "$1" && pwd) || exit 2
rev=${2:-main}
steps=${STEPS:-build test ab}
rounds=${ROUNDS:-1000}
work=${AB_WORK:-/tmp/moejit-ab}
AB_NAME=ab-dispatch.sh
# shellcheck source-path=SCRIPTDIR source=ab_common.sh
. "$repo/tools/bench/ab_common.sh"

if has_step build; then
  ab_build "$rev" moejit "" -DMOEJIT_BUILD_TOOLS=OFF
fi

gpu_seen() { nvidia-smi -L >/dev/null 2>&1; }

if has_step test; then
  note "GPU tests of the working tree (ctest -L gpu, MOEJIT_REQUIRE_GPU=1) -> $out/gpu-tests.log"
  if ! gpu_seen; then
    fail 3 "no GPU here (nvidia-smi finds none): run this on the GPU machine"
  elif [ ! -d "$new_build" ]; then
    fail 2 "no build in $new_build: run with STEPS including build first"
  else
    MOEJIT_REQUIRE_GPU=1 timeout 900 ctest --test-dir "$new_build" -L gpu --no-tests=error \
      --output-on-failure >"$out/gpu-tests.log" 2>&1 || fail 1 "GPU tests failed"
    grep -E "tests passed|tests failed|Failed|No tests" "$out/gpu-tests.log" | tail -n 12
  fi
fi

if has_step ab; then
  # The shapes of tools/bench/BENCHMARKS.md (T,K,H,dtype), its "others worth covering" at T=4096.
  cases=(1536,2,128,fp32 1,8,7168,bf16 32,8,7168,bf16 64,2,4096,bf16 4096,8,7168,bf16
         4096,8,7168,fp16 8192,2,4096,bf16 8192,2,4096,fp32 16384,8,2048,bf16 4096,4,2880,bf16
         4096,8,4096,bf16 4096,1,5120,bf16 4096,4,6144,bf16 4096,8,3584,bf16)
  note "ab_libs.py: $rev (A, A2 its control) against the working tree (B), ${#cases[@]} shapes x 3 layouts, $rounds rounds -> $out/ab.txt"
  if ! gpu_seen; then
    fail 3 "no GPU here (nvidia-smi finds none): the A/B needs one"
  elif [ ! -e "$base_build/libmoejit.so" ] || [ ! -e "$new_build/libmoejit.so" ]; then
    fail 2 "missing $base_build/libmoejit.so or $new_build/libmoejit.so: run with STEPS including build"
  else
    nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem,temperature.gpu \
      --format=csv >"$out/gpu-state.csv" 2>&1
    args=(--lib "A=$base_build/libmoejit.so" --lib "A2=$base_build/libmoejit.so"
          --lib "B=$new_build/libmoejit.so" --layout token_major,gather_map,token_index
          --rounds "$rounds")
    for c in "${cases[@]}"; do args+=(--case "$c"); done
    # Each library compiles its kernels into a cache of its own: the first call of a shape is not
    # timed, but a shared cache would hand A's cubins to nobody else anyway (keys differ).
    MOEJIT_CACHE_DIR="$work/cache" timeout 1800 python3 "$repo/tools/bench/ab_libs.py" "${args[@]}" \
      >"$out/ab.txt" 2>&1 || fail 1 "ab_libs.py failed (log: $out/ab.txt)"
    grep -q "no GPU found" "$out/ab.txt" && fail 3 "ab_libs.py found no GPU through torch"
    cat "$out/ab.txt"
    # Where B is slower: its interval (A's time over B's, per round) entirely under 0.99.
    python3 - "$out/ab.txt" >"$out/slower.txt" <<'PY'
import re, sys
for line in open(sys.argv[1]):
    m = re.search(r"\| B [0-9.]+ us [0-9.]+ \[([0-9.]+), ([0-9.]+)\]", line)
    if m and float(m.group(2)) < 0.99:
        print("slower: " + line.rstrip())
PY
    grep -c "OUTPUTS DIFFER" "$out/ab.txt" >"$out/outputs-differ.txt"
    note "B slower than 0.99 at $(wc -l <"$out/slower.txt") case(s) (slower.txt); outputs differing at $(cat "$out/outputs-differ.txt") (ab.txt)"
  fi
fi
[ "$status" -eq 0 ] && note "all steps passed" || note "FAILED (status $status)"
exit "$status"
