#!/usr/bin/env bash
# The host tests under sanitizers, in a build of their own:
#   tools/sanitize.sh            AddressSanitizer + UndefinedBehaviorSanitizer (build-asan/)
#   tools/sanitize.sh thread     ThreadSanitizer (build-tsan/): the caches' threads and locks
# Extra arguments go to ctest. Every error is fatal. Found so far: loading a C caller's
# out-of-range enum in C++ (src/c_enum.h). GPU tests skip without a GPU, as in tools/test.sh.
set -euo pipefail
cd "$(dirname "$0")/.."
mode=address
if [ $# -gt 0 ] && [[ "$1" != -* ]]; then mode=$1; shift; fi
case "$mode" in
  address)
    flags="-fsanitize=address,undefined -fno-sanitize-recover=all -fno-omit-frame-pointer"
    dir=build-asan type=Debug ;;
  thread)
    flags="-fsanitize=thread"
    dir=build-tsan type=RelWithDebInfo ;;
  *) echo "usage: tools/sanitize.sh [address|thread] [ctest arguments]" >&2; exit 2 ;;
esac
tools/setup-deps.sh
export PATH="$PATH:/usr/local/cuda/bin"
extra=()
[ -e .deps/include/xxhash.h ] && [ ! -e /usr/include/xxhash.h ] && extra+=(-DXXHASH_INCLUDE_DIR="$PWD/.deps/include")
[ -x build/pytest-venv/bin/python ] && extra+=(-DPython3_EXECUTABLE="$PWD/build/pytest-venv/bin/python")
# --as-needed: gcc passes it by default except when sanitizing. The build links nothing it does not
# use (NVRTC and the driver are dlopen'd; api.link_dependencies_are_system_runtimes checks it);
# this keeps a sanitized link as lean as the plain one all the same.
cmake -S . -B "$dir" -G Ninja -DCMAKE_BUILD_TYPE=$type -DCMAKE_C_FLAGS="$flags" \
  -DCMAKE_CXX_FLAGS="$flags" -DCMAKE_EXE_LINKER_FLAGS="$flags -Wl,--as-needed" \
  -DCMAKE_SHARED_LINKER_FLAGS="$flags -Wl,--as-needed" "${extra[@]}" >/dev/null
cmake --build "$dir" -j"$(nproc)"
cd "$dir"
export UBSAN_OPTIONS=print_stacktrace=1:halt_on_error=1
export TSAN_OPTIONS="halt_on_error=1 suppressions=$PWD/../tools/tsan-suppressions.txt"
export ASAN_OPTIONS=detect_leaks=1
# Programs built outside the sanitized build (the installed examples, python3) load the sanitized
# library: the runtime must come first (ASan) and python's own allocations are not ours to check.
outside='^(install\.|python\.)'
ctest --output-on-failure -E "$outside" "$@"
if [ "$mode" = address ]; then
  LD_PRELOAD="$(gcc -print-file-name=libasan.so) $(gcc -print-file-name=libubsan.so)" \
    ASAN_OPTIONS=detect_leaks=0 ctest --output-on-failure -R "$outside" "$@"
fi
