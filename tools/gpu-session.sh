#!/usr/bin/env bash
# Everything that needs a GPU, in one go (GPU time is scarce): build with tests, the GPU tests,
# the disk cache across processes, warming with moejit-precompile then serving in no-compile mode,
# the installed-package check (examples, Python), a wheel carried in .whl/ (tools/gpu-wheel-check.sh),
# and the benchmark against peers.
#   tools/gpu-session.sh OUTDIR          (NO_BENCH=1: everything but the benchmark)
set -uo pipefail
cd "$(dirname "$0")/.." || exit 1
out=$(mkdir -p "${1:-./gpu-out}" && cd "${1:-./gpu-out}" && pwd)
# Tests on explicitly: tools/bench/run-h200.sh configures the same build-gpu/ with them off, and a
# reused build folder would otherwise keep that (and ctest would find nothing to run).
cfg=(-G Ninja -DCMAKE_BUILD_TYPE=Release -DMOEJIT_BUILD_TESTS=ON)
[ -e .deps/include/xxhash.h ] && cfg+=("-DXXHASH_INCLUDE_DIR=$PWD/.deps/include")
if ! { cmake -B build-gpu "${cfg[@]}" && cmake --build build-gpu; } >"$out/build.log" 2>&1; then
  tail -n 40 "$out/build.log"
  exit 1
fi
demo=build-gpu/tools/demo/moejit-demo
scratch=$(mktemp -d)

echo "== GPU tests (ctest -L gpu)"
failed=()
MOEJIT_REQUIRE_GPU=1 timeout 420 ctest --test-dir build-gpu -L gpu --no-tests=error --output-on-failure \
  >"$out/gpu-tests.log" 2>&1 || failed+=("GPU tests")
grep -E "Test +#|tests passed|cases, |Failure|No tests" "$out/gpu-tests.log" | head -n 30

echo "== disk cache: a second process on a warm cache loads its kernels from disk"
for run in 1 2; do
  MOEJIT_CACHE_DIR="$scratch/cache" $demo --tokens 64 --topk 2 --hidden 4096 >"$out/cache-run$run.log" 2>&1
  echo "process $run: $(grep -E 'first call' "$out/cache-run$run.log")"
done

echo "== moejit-demo in each dtype pair it takes (checked against a float64 reference)"
for dtypes in "fp16 fp16" "fp32 fp32" "bf16 fp32" "fp16 bf16"; do
  read -r in_dt out_dt <<<"$dtypes"
  $demo --tokens 512 --dtype "$in_dt" --out-dtype "$out_dt" >"$out/demo-$in_dt-$out_dt.log" 2>&1 ||
    failed+=("demo $in_dt->$out_dt")
  echo "$in_dt -> $out_dt: $(grep -E '^check' "$out/demo-$in_dt-$out_dt.log")"
done

echo "== moejit-precompile (DeepSeek-V3 config, sm_90), then serve in no-compile mode"
build-gpu/tools/precompile/moejit-precompile --model-config tools/precompile/configs/deepseek-v3.json \
  --arch sm_90 --cache-dir "$scratch/warm" 2>&1 | tail -n 2
for layout in gather_map token_major token_index; do
  MOEJIT_CACHE_DIR="$scratch/warm" MOEJIT_CACHE_MODE=no-compile $demo --layout $layout \
    >"$out/nocompile-$layout.log" 2>&1
  echo "$layout (no-compile): exit $? | $(grep -E 'first call|check' "$out/nocompile-$layout.log" | tr '\n' ' ')"
done

echo "== package: install, examples, Python"
BUILD_DIR=build-gpu tools/gpu-check-package.sh >"$out/package.log" 2>&1 || failed+=("package")
sed -n '/==== summary/,$p' "$out/package.log"

# A wheel built on a development machine (tools/wheel-check.sh), carried in .whl/: installed over
# this machine's PyTorch environment with the toolkit out of reach.
wheel=$(ls .whl/moejit-*.whl 2>/dev/null | tail -n 1)
if [ -n "$wheel" ]; then
  echo "== wheel: $wheel in the PyTorch environment, toolkit hidden"
  tools/gpu-wheel-check.sh "$wheel" "$out/wheel" 2>&1 | tail -n 30
  [ "${PIPESTATUS[0]}" -eq 0 ] || failed+=("wheel")
fi

if [ -z "${NO_BENCH:-}" ]; then
  echo "== benchmark"
  tools/bench/run-h200.sh "$out/bench" 2>&1 | tail -n 60
  [ "${PIPESTATUS[0]}" -eq 0 ] || failed+=("benchmark")
fi
rm -rf "$scratch"
if [ ${#failed[@]} -gt 0 ]; then
  echo "== FAILED: ${failed[*]}"
  exit 1
fi
echo "== all steps passed"
