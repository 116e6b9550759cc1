#!/usr/bin/env bash
# One command for the packaging checks on a machine with an NVIDIA GPU:
#   tools/gpu-check-package.sh            (from the repository root)
# 1. configure + build (Ninja, Release)        4. build + run examples/c (pkg-config)
# 2. install into a scratch prefix             5. python tests against the INSTALLED library,
# 3. build + run examples/cpp (find_package)      GPU required (MOEJIT_REQUIRE_GPU=1)
#                                              6. ctest -L install on the build tree
# Prints a summary; exit status 0 only if every step passed. Kernels compile into a fresh cache
# (MOEJIT_CACHE_DIR under the scratch directory), so the cold path is what gets tested.
# Environment: BUILD_DIR (default build-gpu-check), JOBS (default nproc), KEEP=1 keeps the scratch.
set -uo pipefail

cd "$(dirname "$0")/.."
BUILD_DIR=${BUILD_DIR:-build-gpu-check}
JOBS=${JOBS:-$(nproc)}
WORK=$(mktemp -d "${TMPDIR:-/tmp}/moejit-gpu-check.XXXXXX")
PREFIX=$WORK/prefix
export MOEJIT_CACHE_DIR=$WORK/cache
mkdir -p "$WORK/logs"
[ "${KEEP:-0}" = 1 ] || trap 'rm -rf "$WORK"' EXIT

declare -a SUMMARY=()
FAILED=0

# step NAME COMMAND...: runs COMMAND with output in a log. This is a GPU check, so an example
# that skips (exit 77: no GPU seen) is a failure too.
step() {
  local name=$1
  shift
  local log="$WORK/logs/$name.log" start=$SECONDS rc
  printf '== %-28s ' "$name"
  "$@" >"$log" 2>&1
  rc=$?
  local took=$((SECONDS - start))s
  if [ $rc -eq 0 ]; then
    echo "PASS ($took)"
    SUMMARY+=("PASS  $name")
  else
    echo "FAIL ($took, exit $rc$([ $rc -eq 77 ] && echo ': skipped, no GPU seen'))"
    SUMMARY+=("FAIL  $name (log: $log)")
    FAILED=1
    tail -n 60 "$log" | sed 's/^/   | /'
  fi
  # On success, the key result lines (the examples' PASS line, pytest's summary) are enough.
  [ $rc -ne 0 ] ||
    grep -E '^(PASS|FAIL|SKIP):|[0-9]+ (passed|failed)|^SKIPPED' "$log" | sed 's/^/   > /' | tail -n 8
  return $rc
}

run_example() { "$@"; }

build_c_example() {
  if command -v pkg-config >/dev/null 2>&1; then
    PKG_CONFIG_PATH=$PREFIX/lib/pkgconfig cmake -S examples/c -B "$WORK/example-c" -G Ninja &&
      cmake --build "$WORK/example-c"
  else
    # No pkg-config here: compile with the flags moejit.pc would give, and say so.
    echo "pkg-config not found: compiling with -I$PREFIX/include -L$PREFIX/lib -lmoejit directly"
    local cuda=${CUDA_HOME:-/usr/local/cuda}
    local cudalib
    cudalib=$(ls -d "$cuda/lib64" "$cuda/lib" 2>/dev/null | head -n 1)
    mkdir -p "$WORK/example-c" &&
      cc -std=c99 -Wall -Wextra -O2 -I"$PREFIX/include" -I"$cuda/include" examples/c/combine.c \
        -o "$WORK/example-c/moejit-example-c" -L"$PREFIX/lib" -lmoejit -Wl,-rpath,"$PREFIX/lib" \
        -L"$cudalib" -lcudart -Wl,-rpath,"$cudalib" -lm
  fi
}

echo "moejit packaging check in $WORK (build: $BUILD_DIR)"
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader 2>/dev/null | sed 's/^/GPU: /'

if step build bash -c "cmake -S . -B '$BUILD_DIR' -G Ninja -DCMAKE_BUILD_TYPE=Release -DMOEJIT_BUILD_TESTS=ON &&
                       cmake --build '$BUILD_DIR' -j '$JOBS'" &&
   step install cmake --install "$BUILD_DIR" --prefix "$PREFIX"; then
  ls -l "$PREFIX"/lib/libmoejit.so* | sed 's/^/   /'
  step example-cpp.build bash -c "cmake -S examples/cpp -B '$WORK/example-cpp' -G Ninja \
         -DCMAKE_PREFIX_PATH='$PREFIX' && cmake --build '$WORK/example-cpp'" &&
    step example-cpp.run run_example "$WORK/example-cpp/moejit-example-cpp"
  step example-c.build build_c_example &&
    step example-c.run run_example "$WORK/example-c/moejit-example-c"
  step python env PYTHONPATH="$PWD/python" MOEJIT_LIBRARY="$PREFIX/lib/libmoejit.so.0" \
    MOEJIT_LAYOUT_PROBE="$BUILD_DIR/tests/python/moejit_layout_probe" MOEJIT_REQUIRE_GPU=1 \
    python3 -m pytest -q -rs -p no:cacheprovider tests/python
  if command -v pkg-config >/dev/null 2>&1; then
    step ctest-install ctest --test-dir "$BUILD_DIR" -L install --no-tests=error --output-on-failure
  else
    # The pkg-config tests cannot run here; say so in the summary instead of failing on them.
    step ctest-install-without-pkgconfig ctest --test-dir "$BUILD_DIR" -L install --no-tests=error \
      -E 'install\.(pkgconfig|example_c\.)' --output-on-failure
    SUMMARY+=("NOTE  pkg-config not installed: install.pkgconfig and install.example_c.* not run")
  fi
fi

echo
echo "==== summary ($( [ $FAILED = 0 ] && echo ALL PASSED || echo FAILURES)) ===="
printf '%s\n' "${SUMMARY[@]}"
[ "${KEEP:-0}" = 1 ] && echo "scratch kept: $WORK"
exit $FAILED
