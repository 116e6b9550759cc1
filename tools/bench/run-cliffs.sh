#!/usr/bin/env bash
# Issue 58's changes on the GPU machine: the tests, then the A/B against the library before them.
# Parts (default: test ab), each with its logs in the output directory given as $1:
#
#   test  builds build-gpu/ with the tests (library, moejit-bench, GPU tests) and runs every GPU
#         test in one process (gpu-tests.log: the skewed routings, a heavy token's bits on every
#         path, awkward hidden sizes at every alignment, R * H past 2^31 with a hot token, a graph
#         replaying a hot token, and the suite before them). SANITIZE=1 adds compute-sanitizer
#         memcheck and synccheck on the heavy-token tests (memcheck.log, synccheck.log).
#   ab    builds the library of REV (default 7b9f05e, the tree before this work) in $AB_WORK (default
#         /tmp/moejit-cliffs-ab), then tools/bench/ab_libs.py, REV (A, and A2 its control) against
#         build-gpu's library (B): the token index at every shape of tools/bench/BENCHMARKS.md
#         (ab.txt; the other layouts' modules at those shapes are byte-identical, nothing to time)
#         with ROUNDS rounds (default 400), and issue 58's awkward hidden sizes in every layout
#         (ab-awkward.txt, AWKWARD_ROUNDS, default 60). slower.txt lists where B's interval lies
#         entirely under 0.99.
#
#   tools/bench/run-cliffs.sh "$OUT" test         # about 6 minutes on one H100 (estimated)
#   tools/bench/run-cliffs.sh "$OUT" ab           # about 5 minutes (estimated)
#   tools/bench/run-cliffs-epilogue.sh "$OUT" skew awkward   # the benchmark cases and their peers
#
# The second and third reuse build-gpu/ from the first while the machine stays warm (a bare
# machine builds again). Exit status: 0 when every step passed, else the first failing step's.
set -uo pipefail
cd "$(dirname "$0")/../.." || exit 1
repo=$PWD
out=$(mkdir -p "${1:-./cliffs-out}" && cd "${1:-./cliffs-out}" && pwd) || exit 2
shift || true
parts=("$@")
[ ${#parts[@]} -gt 0 ] || parts=(test ab)
for p in "${parts[@]}"; do
  case $p in test | ab) ;; *)
    echo "run-cliffs.sh: unknown part '$p' (test, ab)"
    exit 2
    ;;
  esac
done
rev=${REV:-7b9f05e}
work=${AB_WORK:-/tmp/moejit-cliffs-ab}
status=0
note() { printf '\n### %s\n' "$*"; }
fail() {  # fail STATUS MESSAGE
  echo "run-cliffs.sh: $2"
  [ "$status" -ne 0 ] || status=$1
}
wants() { [[ " ${parts[*]} " == *" $1 "* ]]; }
cfg=(-G Ninja -DCMAKE_BUILD_TYPE=Release)
[ -e .deps/include/xxhash.h ] && [ ! -e /usr/include/xxhash.h ] &&
  cfg+=("-DXXHASH_INCLUDE_DIR=$repo/.deps/include")
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem,temperature.gpu \
  --format=csv >"$out/gpu-state.csv" 2>&1 || true

# build-gpu/ with the tests: the library and moejit-bench for every part, the GPU tests for `test`.
targets=(moejit moejit-bench)
wants test && targets+=(moejit_gpu_tests)
note "build: build-gpu/ (${targets[*]}) -> $out/build.log"
if ! { cmake -B build-gpu "${cfg[@]}" -DMOEJIT_BUILD_TESTS=ON &&
  cmake --build build-gpu --target "${targets[@]}"; } >"$out/build.log" 2>&1; then
  tail -n 30 "$out/build.log"
  fail 1 "the build failed (log: $out/build.log)"
  exit "$status"
fi

if wants test; then
  tests=build-gpu/tests/gpu/moejit_gpu_tests
  note "GPU tests, one process -> $out/gpu-tests.log"
  MOEJIT_REQUIRE_GPU=1 timeout 480 "$tests" >"$out/gpu-tests.log" 2>&1 ||
    fail 1 "GPU tests failed (log: $out/gpu-tests.log)"
  grep -E "^\[  (PASSED|FAILED|SKIPPED) |^\[       OK \].*(Skewed|Heavy|Awkward|PastTwo|Graph)|cases, " \
    "$out/gpu-tests.log" | tail -n 40
  if [ -n "${SANITIZE:-}" ]; then
    export PATH="$PATH:/usr/local/cuda/bin"
    heavy='CombineGpu.HeavyTokenIsTheSameOnEveryPathAndGeometry:CombineGpu.WalksPastAHotTokensList'
    heavy+=':CombineGpu.TokenIndexWithAHotToken'
    for tool in memcheck synccheck; do
      note "compute-sanitizer $tool on the heavy-token tests -> $out/$tool.log"
      timeout 300 compute-sanitizer --error-exitcode 9 --print-limit 30 --tool "$tool" "$tests" \
        --gtest_filter="$heavy" >"$out/$tool.log" 2>&1 || fail 1 "$tool failed (log: $out/$tool.log)"
      grep -E "ERROR SUMMARY|PASSED|FAILED" "$out/$tool.log" | tail -n 3
    done
  fi
fi

if wants ab; then
  note "build: $rev -> $work/base-build (the library only) -> $out/build-base.log"
  base_sha=$(git rev-parse --verify "$rev^{commit}" 2>>"$out/build-base.log")
  if [ -z "$base_sha" ]; then
    fail 2 "revision '$rev' is not in this repository's history"
  elif ! { rm -rf "$work/base-src" && mkdir -p "$work/base-src" &&
    git archive "$base_sha" | tar -x -C "$work/base-src" &&
    cmake -S "$work/base-src" -B "$work/base-build" "${cfg[@]}" -DMOEJIT_BUILD_TESTS=OFF \
      -DMOEJIT_BUILD_TOOLS=OFF && cmake --build "$work/base-build" --target moejit; } \
    >>"$out/build-base.log" 2>&1; then
    fail 1 "the $rev build failed (log: $out/build-base.log)"
  else
    echo "$rev = $base_sha; B = $(git rev-parse HEAD)$(git diff --quiet HEAD || echo ' + changes')" |
      tee "$out/revisions.txt"
    libs=(--lib "A=$work/base-build/libmoejit.so" --lib "A2=$work/base-build/libmoejit.so"
      --lib "B=$repo/build-gpu/libmoejit.so")
    # tools/bench/BENCHMARKS.md's shapes and its "others worth covering" at T = 4096.
    bench=(1536,2,128,fp32 1,8,7168,bf16 32,8,7168,bf16 64,2,4096,bf16 4096,8,7168,bf16
      4096,8,7168,fp16 8192,2,4096,bf16 8192,2,4096,fp32 16384,8,2048,bf16 4096,4,2880,bf16
      4096,8,4096,bf16 4096,1,5120,bf16 4096,4,6144,bf16 4096,8,3584,bf16)
    args=("${libs[@]}" --layout token_index --rounds "${ROUNDS:-400}")
    for c in "${bench[@]}"; do args+=(--case "$c"); done
    note "ab_libs.py: token index at the BENCHMARKS shapes -> $out/ab.txt"
    MOEJIT_CACHE_DIR="$work/cache" timeout 420 python3 tools/bench/ab_libs.py "${args[@]}" \
      >"$out/ab.txt" 2>&1 || fail 1 "ab_libs.py failed (log: $out/ab.txt)"
    args=("${libs[@]}" --layout token_major,gather_map,token_index --rounds "${AWKWARD_ROUNDS:-60}")
    for c in 6000,8,1000,fp16 6000,8,1000,bf16 6000,8,1001,bf16 6000,8,1001,fp32 \
      6000,8,7169,bf16 6000,8,7169,fp16; do args+=(--case "$c"); done
    note "ab_libs.py: awkward hidden sizes, every layout -> $out/ab-awkward.txt"
    MOEJIT_CACHE_DIR="$work/cache" timeout 300 python3 tools/bench/ab_libs.py "${args[@]}" \
      >"$out/ab-awkward.txt" 2>&1 || fail 1 "ab_libs.py failed (log: $out/ab-awkward.txt)"
    cat "$out/ab.txt" "$out/ab-awkward.txt"
    # Where B is slower: its interval (A's time over B's, per round) entirely under 0.99.
    python3 - "$out/ab.txt" "$out/ab-awkward.txt" >"$out/slower.txt" <<'PY'
import re, sys
for path in sys.argv[1:]:
    for line in open(path):
        m = re.search(r"\| B [0-9.]+ us [0-9.]+ \[([0-9.]+), ([0-9.]+)\]", line)
        if m and float(m.group(2)) < 0.99:
            print("slower: " + line.rstrip())
PY
    note "B slower than 0.99 at $(wc -l <"$out/slower.txt") case(s) (slower.txt); outputs differing: $(cat "$out/ab.txt" "$out/ab-awkward.txt" | grep -c 'OUTPUTS DIFFER')"
  fi
fi
[ "$status" -eq 0 ] && note "all steps passed" || note "FAILED (status $status)"
exit "$status"
