#!/usr/bin/env bash
# The main job, from a fresh clone: install build dependencies, build, and run moejit-demo (a real
# combine checked against a CPU reference and timed on a GPU; without one, it compiles the kernels
# and says that no GPU was found).
set -euo pipefail
here="$(dirname "$0")"
"$here/setup-deps.sh"
"$here/configure.sh"
exec "$here/../build/tools/demo/moejit-demo" "$@"
