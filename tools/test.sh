#!/usr/bin/env bash
# The tests, from a fresh clone: install build dependencies, build, run every test group. GPU
# tests skip with their reason where no GPU is usable. Pass ctest arguments to narrow it down,
# e.g. tools/test.sh -L gpu.
set -euo pipefail
here="$(dirname "$0")"
"$here/setup-deps.sh"
"$here/configure.sh"
cd "$here/../build"
exec ctest --output-on-failure "$@"
