#!/usr/bin/env bash
# The GPU tests under NVIDIA's compute-sanitizer (needs a GPU and the toolkit's compute-sanitizer):
#   memcheck   every test: out-of-bounds and misaligned device accesses, launch errors
#   synccheck  every test: barriers and warp syncs used wrongly
#   racecheck  the tests of the kernels that share lists through shared memory (the token index's
#              scans, the one-token kernel) and of the launch modes (CUDA graph, dependent launch);
#              the full matrix under racecheck takes more than five minutes
# Each tool's output goes to OUTDIR/<tool>.txt; exits non-zero if any tool reports an error.
#   tools/gpu-sanitize.sh OUTDIR
set -uo pipefail
cd "$(dirname "$0")/.." || exit 1
out=$(mkdir -p "${1:-./gpu-sanitize-out}" && cd "${1:-./gpu-sanitize-out}" && pwd)
export PATH="$PATH:/usr/local/cuda/bin"
command -v compute-sanitizer >/dev/null || { echo "compute-sanitizer not found" >&2; exit 2; }
cfg=(-G Ninja -DCMAKE_BUILD_TYPE=Release -DMOEJIT_BUILD_TESTS=ON)
[ -e .deps/include/xxhash.h ] && cfg+=("-DXXHASH_INCLUDE_DIR=$PWD/.deps/include")
if ! { cmake -B build-gpu "${cfg[@]}" && cmake --build build-gpu --target moejit_gpu_tests; } \
  >"$out/build.log" 2>&1; then
  tail -n 40 "$out/build.log"
  exit 1
fi
tests=build-gpu/tests/gpu/moejit_gpu_tests
shared_memory='CombineGpu.TokenIndex*:CombineGpu.OneToken*:CombineGpu.DroppedSlots*'
shared_memory+=':CombineGpu.DependentLaunch*:CombineGpu.CudaGraph*'
failed=()
run() {  # tool, gtest filter
  echo "== $1"
  timeout 600 compute-sanitizer --error-exitcode 9 --print-limit 30 --tool "$1" \
    $([ "$1" = racecheck ] && echo --racecheck-report hazard) "$tests" --gtest_filter="$2" \
    >"$out/$1.txt" 2>&1 || failed+=("$1")
  grep -E "OK \]|FAILED|SKIPPED|ERROR SUMMARY|RACECHECK SUMMARY" "$out/$1.txt" | head -n 20
}
run memcheck '*'
run synccheck '*'
run racecheck "$shared_memory"
if [ ${#failed[@]} -gt 0 ]; then
  echo "== failed: ${failed[*]}"
  exit 1
fi
echo "== all tools clean"
