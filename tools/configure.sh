#!/usr/bin/env bash
# Configures and builds libmoejit into ./build (Release, Ninja). Used by tools/demo.sh and
# tools/test.sh.
set -euo pipefail
cd "$(dirname "$0")/.."
export PATH="$PATH:/usr/local/cuda/bin"
extra=()
[ -e .deps/include/xxhash.h ] && [ ! -e /usr/include/xxhash.h ] && extra+=(-DXXHASH_INCLUDE_DIR="$PWD/.deps/include")
cmake -S . -B build -G Ninja -DCMAKE_BUILD_TYPE=Release "${extra[@]}" >/dev/null
cmake --build build -j"$(nproc)"
