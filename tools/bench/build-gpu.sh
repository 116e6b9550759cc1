#!/usr/bin/env bash
# Builds libmoejit and moejit-bench for the GPU machine into build-gpu/ (Release, Ninja, tests off;
# -DXXHASH_INCLUDE_DIR=$PWD/.deps/include when that folder exists: the H200 has xxHash's runtime
# but not xxhash.h, and the lead carries the header there). Output to the log given as $1; on
# failure its last lines are printed and the status is 1. Used by run-h200.sh and
# run-cliffs-epilogue.sh.
set -uo pipefail
cd "$(dirname "$0")/../.." || exit 1
log=${1:?usage: build-gpu.sh LOG}
configure=(-G Ninja -DCMAKE_BUILD_TYPE=Release -DMOEJIT_BUILD_TESTS=OFF)
[ -d .deps/include ] && configure+=("-DXXHASH_INCLUDE_DIR=$PWD/.deps/include")
if ! { cmake -B build-gpu "${configure[@]}" && cmake --build build-gpu --target moejit moejit-bench; } \
    >"$log" 2>&1; then
  tail -n 40 "$log"
  echo "build failed (log: $log)"
  exit 1
fi
