#!/usr/bin/env bash
# The wheel as a user gets it, on this machine (no GPU needed):
#   1. builds it with `pip wheel .` in a fresh venv (scikit-build-core runs the project's CMake;
#      pip fetches scikit-build-core from PyPI into its isolated build environment),
#   2. installs it into another fresh venv (with --pip-nvrtc also pip's nvidia-cuda-nvrtc, from
#      PyPI, so the library must compile with it),
#   3. shows what the installed library links (readelf -d, ldd) and what the wheel holds,
#   4. runs tests/python against the installed package (MOEJIT_TEST_INSTALLED=1), never the
#      checkout's python/.
#   tools/wheel-check.sh [--pip-nvrtc] [OUTDIR]
# Everything lives in build/wheel-check/ (the wheel: build/wheel-check/dist/); the logs also go to
# OUTDIR if given. The venvs use the python3 on PATH with --system-site-packages, so its pytest
# (Debian: python3-pytest) serves; without one, pytest is installed into the test venv, not into
# that Python. Used by CI (.ci/run); tools/gpu-wheel-check.sh runs the same tests on a GPU.
set -euo pipefail
cd "$(dirname "$0")/.."
pip_nvrtc=0
if [ "${1:-}" = --pip-nvrtc ]; then pip_nvrtc=1; shift; fi
work=$PWD/build/wheel-check
out=${1:-$work/logs}
rm -rf "$work/build-venv" "$work/test-venv" "$work/dist"
mkdir -p "$work/dist" "$out"
out=$(cd "$out" && pwd)

echo "== building the wheel (fresh venv $work/build-venv; log: $out/wheel-build.log)"
python3 -m venv "$work/build-venv"
settings=()
[ -e .deps/include/xxhash.h ] && [ ! -e /usr/include/xxhash.h ] &&
  settings+=("--config-settings=cmake.define.XXHASH_INCLUDE_DIR=$PWD/.deps/include")
export PATH="$PATH:/usr/local/cuda/bin"  # as tools/configure.sh: CMake finds the toolkit by nvcc
if ! "$work/build-venv/bin/python" -m pip wheel --no-deps -w "$work/dist" "${settings[@]}" . \
    >"$out/wheel-build.log" 2>&1; then
  tail -n 40 "$out/wheel-build.log"
  exit 1
fi
wheel=$(ls "$work"/dist/moejit-*.whl)
echo "$(basename "$wheel"): $(du -k "$wheel" | cut -f1) KiB"
python3 -m zipfile -l "$wheel" | sed 's/^/   /'

echo "== installing it into a fresh venv ($work/test-venv)"
python3 -m venv --system-site-packages "$work/test-venv"
py=$work/test-venv/bin/python
"$py" -m pip install -q --no-deps "$wheel"
if [ $pip_nvrtc = 1 ]; then
  echo "   + nvidia-cuda-nvrtc (CUDA 13) from PyPI into the test venv"
  "$py" -m pip install -q "nvidia-cuda-nvrtc>=13,<14"
fi
if ! "$py" -c 'import pytest' 2>/dev/null; then
  echo "   + pytest from PyPI into the test venv ($(python3 --version) on PATH has none)"
  "$py" -m pip install -q pytest
fi
lib=$("$py" -c 'import moejit, os; print(os.path.join(os.path.dirname(moejit.__file__), "libmoejit.so.0"))')
{
  echo "installed library: $lib"
  readelf -d "$lib" | grep -E 'NEEDED|SONAME|RPATH|RUNPATH'
  ldd "$lib"
} | tee "$out/wheel-library.txt" | sed 's/^/   /'

echo "== tests/python against the installed wheel (log: $out/wheel-pytest.log)"
expect=()
[ $pip_nvrtc = 1 ] && expect=(MOEJIT_EXPECT_NVRTC=pip)
scratch=$(mktemp -d)
trap 'rm -rf "$scratch"' EXIT
# A fresh cache: the kernels compile with the NVRTC this environment gives the library.
if env -u MOEJIT_LIBRARY -u MOEJIT_PRECOMPILE -u PYTHONPATH MOEJIT_TEST_INSTALLED=1 \
    MOEJIT_CACHE_DIR="$scratch/cache" "${expect[@]}" \
    "$py" -m pytest -q -rs -s -p no:cacheprovider "$PWD/tests/python" >"$out/wheel-pytest.log" 2>&1; then
  grep -E "NVRTC used:|passed|failed" "$out/wheel-pytest.log" | sed 's/^/   /'
else
  tail -n 60 "$out/wheel-pytest.log"
  exit 1
fi
echo "== wheel check passed: $wheel"
