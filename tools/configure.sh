#!/usr/bin/env bash
# Configures libmoejit into ./build (Release, Ninja, tests on) and builds everything, or only the
# targets named: tools/demo.sh builds moejit-demo alone, tools/test.sh everything.
#   tools/configure.sh [TARGET...]
set -euo pipefail
cd "$(dirname "$0")/.."
export PATH="$PATH:/usr/local/cuda/bin"
extra=()
[ -e .deps/include/xxhash.h ] && [ ! -e /usr/include/xxhash.h ] && extra+=(-DXXHASH_INCLUDE_DIR="$PWD/.deps/include")
# The venv tools/setup-deps.sh made when the python3 on PATH has no pytest: the Python tests run there.
[ -x build/pytest-venv/bin/python ] && extra+=(-DPython3_EXECUTABLE="$PWD/build/pytest-venv/bin/python")
cmake -S . -B build -G Ninja -DCMAKE_BUILD_TYPE=Release -DMOEJIT_BUILD_TESTS=ON "${extra[@]}" >/dev/null
targets=()
for target in "$@"; do targets+=(--target "$target"); done
cmake --build build -j"$(nproc)" "${targets[@]}"
