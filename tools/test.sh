#!/usr/bin/env bash
# The tests, from a fresh clone: install build dependencies (tools/setup-deps.sh says what and
# where), build everything, run every test group. GPU tests skip with their reason where no GPU is
# usable. Pass ctest arguments to narrow it down, e.g. tools/test.sh -L gpu. The wheel's own check
# (build it, install it into a venv, test it there; needs PyPI) is tools/wheel-check.sh.
set -euo pipefail
here="$(dirname "$0")"
"$here/setup-deps.sh"
"$here/configure.sh"
cd "$here/../build"
exec ctest --output-on-failure "$@"
