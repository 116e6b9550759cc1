#!/usr/bin/env bash
# The main job, from a fresh clone: install build dependencies (tools/setup-deps.sh says what and
# where), build moejit-demo and what it links (not the tests), and run it: a real combine checked
# against a float64 CPU reference and timed on a GPU; without one, it compiles the kernels it would
# use and says why no GPU can be used. Arguments go to moejit-demo (--help lists them).
set -euo pipefail
here="$(dirname "$0")"
"$here/setup-deps.sh"
"$here/configure.sh" moejit-demo
exec "$here/../build/tools/demo/moejit-demo" "$@"
