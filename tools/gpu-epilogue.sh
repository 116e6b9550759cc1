#!/usr/bin/env bash
# The epilogue (issue 59) on the GPU machine, in two commands of under 9 minutes each (a third,
# optional); logs and results in OUTDIR:
#
#   tools/gpu-epilogue.sh OUTDIR tests       build (build-gpu/, tests on); the epilogue's GPU tests
#                                            (tests/gpu/test_epilogue_gpu.cpp) -> epilogue-gpu.log;
#                                            the Python ones (moejit.combine with residual=..., the
#                                            torch op) -> python-epilogue.log
#   tools/gpu-epilogue.sh OUTDIR bench       tools/bench/run-cliffs-epilogue.sh OUTDIR epilogue:
#                                            the fused call against the chains -> epilogue.txt,
#                                            epilogue.json (and bench.log)
#   tools/gpu-epilogue.sh OUTDIR regression  the combine's own GPU tests whose kernels and launch
#                                            path the epilogue shares -> combine-gpu.log
#
# Run "tests" first: "bench" builds build-gpu/ again with the tests off (tools/bench/build-gpu.sh),
# which only relinks, and "regression" needs the test build. Exit status: 0 when every step
# passed, else the first failure's. The summaries are printed last.
set -uo pipefail
cd "$(dirname "$0")/.." || exit 1
out=$(mkdir -p "${1:?usage: gpu-epilogue.sh OUTDIR tests|bench|regression}" && cd "$1" && pwd)
part=${2:?usage: gpu-epilogue.sh OUTDIR tests|bench|regression}
status=0
step() {  # name, log, timeout, command...: runs it, records the first failure
  local name=$1 log=$2 limit=$3
  shift 3
  printf '\n### %s -> %s\n' "$name" "$log"
  timeout "$limit" "$@" >"$log" 2>&1
  local rc=$?
  if [ $rc -ne 0 ]; then
    echo "gpu-epilogue.sh: $name failed with status $rc (log: $log)"
    [ "$status" -ne 0 ] || status=$rc
  fi
}
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem,temperature.gpu,power.draw \
  --format=csv >"$out/gpu-state-$part.csv" 2>&1 || true

case $part in
  tests)
    cfg=(-G Ninja -DCMAKE_BUILD_TYPE=Release -DMOEJIT_BUILD_TESTS=ON)
    [ -e .deps/include/xxhash.h ] && cfg+=("-DXXHASH_INCLUDE_DIR=$PWD/.deps/include")
    printf '### build (%s cores) -> %s/build.log\n' "$(nproc)" "$out"
    if ! timeout 200 bash -c 'cmake -B build-gpu "$@" && cmake --build build-gpu --target moejit \
          moejit_gpu_tests moejit_epilogue_gpu_tests' _ "${cfg[@]}" >"$out/build.log" 2>&1; then
      tail -n 40 "$out/build.log"
      echo "gpu-epilogue.sh: build failed (log: $out/build.log)"
      exit 1
    fi
    # MOEJIT_REQUIRE_GPU=1: a GPU that cannot be used fails the tests instead of skipping them.
    step "epilogue GPU tests" "$out/epilogue-gpu.log" 240 \
      env MOEJIT_REQUIRE_GPU=1 build-gpu/tests/gpu/moejit_epilogue_gpu_tests
    step "Python epilogue tests" "$out/python-epilogue.log" 90 \
      env MOEJIT_REQUIRE_GPU=1 PYTHONPATH="$PWD/python" MOEJIT_LIBRARY="$PWD/build-gpu/libmoejit.so" \
      python3 -m pytest -q -p no:cacheprovider tests/python/test_torch.py -k epilogue
    printf '\n### summaries\n== epilogue-gpu.log\n'
    grep -E '^\[  (PASSED|FAILED|SKIPPED) |^\[ +OK|tests? ran|Failure' "$out/epilogue-gpu.log" |
      tail -n 20
    printf '== python-epilogue.log\n'
    tail -n 3 "$out/python-epilogue.log"
    ;;
  bench)
    # EPILOGUE_ARGS="--shapes decode" (then "--shapes prefill") splits it, should it run long.
    step "bench (run-cliffs-epilogue.sh epilogue)" "$out/bench.log" 535 \
      tools/bench/run-cliffs-epilogue.sh "$out" epilogue
    tail -n 40 "$out/bench.log"
    ;;
  regression)
    [ -x build-gpu/tests/gpu/moejit_gpu_tests ] || {
      echo "gpu-epilogue.sh: build-gpu has no moejit_gpu_tests: run the tests part first"
      exit 1
    }
    step "combine GPU tests" "$out/combine-gpu.log" 500 \
      env MOEJIT_REQUIRE_GPU=1 build-gpu/tests/gpu/moejit_gpu_tests
    grep -E '^\[  (PASSED|FAILED|SKIPPED) |tests? ran|Failure' "$out/combine-gpu.log" | tail -n 20
    ;;
  *)
    echo "gpu-epilogue.sh: unknown part '$part' (tests, bench, regression)"
    exit 2
    ;;
esac
exit "$status"
