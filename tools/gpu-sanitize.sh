#!/usr/bin/env bash
# The GPU tests under NVIDIA's compute-sanitizer (needs a GPU and the toolkit's compute-sanitizer):
#   memcheck   every test: out-of-bounds and misaligned device accesses, launch errors
#   synccheck  every test: barriers and warp syncs used wrongly
#   racecheck  the tests of the kernels that share lists through shared memory (the token index's
#              scans, both one-token kernels) and of the launch modes (CUDA graph, dependent launch);
#              the full matrix under racecheck takes more than five minutes
# and first a self-check: memcheck must catch a planted out-of-bounds write (the test
# SanitizerPlant.AnOutputBufferOneRowShort, which runs only with MOEJIT_SANITIZER_PLANT=1: a real
# combine into an output buffer one row short), or the clean runs after it prove nothing.
# Each run's output goes to OUTDIR/<tool>[-<test>].txt, and a summary to OUTDIR/summary.txt; exits
# non-zero if any run reports an error or times out, or if the self-check catches nothing.
#   tools/gpu-sanitize.sh OUTDIR
# With MOEJIT_SANITIZER_PLANT=1 in the environment, the plant also runs among the memcheck tests,
# and the script must then fail (what a real out-of-bounds write in the library would do).
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
failed=()
run() {  # tool, gtest filter, output name, seconds[, more compute-sanitizer options]
  # racecheck alone sometimes stalls in a process's first seconds (a test that takes 5-6 s ran
  # into 120 s; the same test again, right after: 6 s). A stalled racecheck run gets one more
  # try, said out loud; a second stall or any report still fails the run.
  local rc attempt
  for attempt in 1 2; do
    timeout "$4" compute-sanitizer --error-exitcode 9 --print-limit 30 --tool "$1" ${5:-} \
      $([ "$1" = racecheck ] && echo --racecheck-report hazard) "$tests" --gtest_filter="$2" \
      >"$out/$3.txt" 2>&1
    rc=$?
    [ $rc -eq 124 ] && [ "$1" = racecheck ] && [ $attempt -eq 1 ] || break
    echo "$3: timed out after $4 s; trying once more"
    mv "$out/$3.txt" "$out/$3.stalled.txt"
  done
  [ $rc -eq 124 ] && echo "$3: timed out after $4 s"
  [ $rc -ne 0 ] && failed+=("$3")
  grep -E "OK \]|FAILED|SKIPPED|ERROR SUMMARY|RACECHECK SUMMARY" "$out/$3.txt" | head -n 20
  echo "$3: exit $rc; $(grep -h -E "ERROR SUMMARY|RACECHECK SUMMARY|PASSED|FAILED  \]" \
    "$out/$3.txt" | tr '\n' ' ')" >>"$out/summary.txt"
}
: >"$out/summary.txt"
echo "== self-check: memcheck catches a planted out-of-bounds write"
plant=SanitizerPlant.AnOutputBufferOneRowShort
MOEJIT_SANITIZER_PLANT=1 timeout 120 compute-sanitizer --error-exitcode 9 --print-limit 30 \
  --tool memcheck "$tests" --gtest_filter="$plant" >"$out/memcheck-plant.txt" 2>&1
plant_rc=$?
if [ $plant_rc -eq 9 ] && grep -q "Invalid __global__ write" "$out/memcheck-plant.txt"; then
  echo "self-check: caught: $(grep -m1 "Invalid __global__ write" "$out/memcheck-plant.txt")" |
    tee -a "$out/summary.txt"
else
  echo "self-check: memcheck did not catch the planted write (exit $plant_rc; see" \
    "memcheck-plant.txt)" | tee -a "$out/summary.txt"
  failed+=("self-check")
fi
echo "== memcheck"
# Tests that provoke a CUDA error on purpose run on their own with API errors unreported (memcheck
# and synccheck), every other test with them reported; device-side checks stay on for all:
#  - AModuleOfADestroyedContextIsNeverServedAgain destroys contexts under a live runtime, whose
#    destroy then asks each module's context for its id (cuCtxGetId):
#    CUDA_ERROR_CONTEXT_IS_DESTROYED is the answer that tells it to leave that module alone.
#  - AStreamOfAnotherContextIsRefused launches on a stream of another context, which the driver
#    refuses with CUDA_ERROR_INVALID_HANDLE: the refusal is what the test checks.
# The plant (above) stays out unless MOEJIT_SANITIZER_PLANT=1 asks for it (it skips without).
provoking=CombineGpu.AModuleOfADestroyedContextIsNeverServedAgain:CombineGpu.AStreamOfAnotherContextIsRefused
others="*-$provoking"
[ "${MOEJIT_SANITIZER_PLANT:-}" = 1 ] || others="$others:$plant"
run memcheck "$others" memcheck 300
run memcheck "$provoking" memcheck-provoked-errors 60 "--report-api-errors no"
echo "== synccheck"
run synccheck "*-$provoking:$plant" synccheck 300
run synccheck "$provoking" synccheck-provoked-errors 60 "--report-api-errors no"
# racecheck one test per process: each takes seconds, but one run of several tests once stalled
# for minutes on the first of them (the same test alone: 5 s). Not WalksPastAHotTokensList: its
# walks of token_idx (8200 tokens on the list path) ran past 100 s under racecheck; memcheck and
# synccheck above cover it.
echo "== racecheck"
for t in TokenIndexWithAHotToken TokenIndexListsPastOneGridOfRows \
  SmallCallScanWindowsAHotTokensRows SlabScanListsAHotTokensRows \
  OneTokenSkipsDroppedRowsWhateverTheyHold OneTokenGatherMapIgnoresWhatNoSlotNames \
  DroppedSlotsIgnoreNonFiniteGates DependentLaunchGpu.SeesThePreviousKernelsWrites \
  CudaGraphCaptureAndReplay; do
  # A bare name is a CombineGpu test.
  [[ $t == *.* ]] || t="CombineGpu.$t"
  run racecheck "$t" "racecheck-${t#*.}" 120
done
if [ ${#failed[@]} -gt 0 ]; then
  echo "== failed: ${failed[*]}" | tee -a "$out/summary.txt"
  exit 1
fi
echo "== all tools clean; the self-check caught the planted write" | tee -a "$out/summary.txt"
