#!/usr/bin/env bash
# What libmoejit builds and tests with, on Debian/Ubuntu. Says what it installs and where:
#   - missing build tools and headers: Debian packages, with apt-get (as root), into /usr;
#   - pytest for the Python tests: Debian's python3-pytest when the python3 on PATH is the
#     system's, else a venv inside the build folder (build/pytest-venv), which the build then
#     uses (tools/configure.sh). Nothing is ever pip-installed into a system Python.
# The CUDA toolkit (nvcc, NVRTC and its headers, CUDA 12.x or 13.x) is expected under
# /usr/local/cuda or on PATH; it is not installed here.
set -euo pipefail
repo=$(cd "$(dirname "$0")/.." && pwd)
need=()
have_header() { [ -e "/usr/include/$1" ]; }
command -v cmake >/dev/null || need+=(cmake)
command -v ninja >/dev/null || need+=(ninja-build)
command -v g++ >/dev/null || need+=(g++)
command -v pkg-config >/dev/null || need+=(pkg-config)
command -v make >/dev/null || need+=(make)
command -v abidiff >/dev/null || need+=(abigail-tools)  # tools/check-abi.sh: abidw, abidiff
have_header spdlog/spdlog.h || need+=(libspdlog-dev)
have_header xxhash.h || [ -e "$repo/.deps/include/xxhash.h" ] || need+=(libxxhash-dev)
have_header gtest/gtest.h || need+=(libgtest-dev)
have_header CLI/CLI.hpp || need+=(libcli11-dev)
have_header nlohmann/json.hpp || need+=(nlohmann-json3-dev)
# libsodium (HMAC of authenticated cache entries), linked statically: Debian's libsodium-dev has the
# PIC libsodium.a. .deps/ may hold it instead (include/sodium.h, lib/libsodium.a).
{ have_header sodium.h && ls /usr/lib/*/libsodium.a /usr/lib/libsodium.a >/dev/null 2>&1; } ||
  [ -e "$repo/.deps/lib/libsodium.a" ] || need+=(libsodium-dev)

# The Python tests run under the python3 on PATH (CMake's Python3_EXECUTABLE).
python=$(command -v python3 || true)
system_python=0
[ -n "$python" ] && [ "$(readlink -f "$python")" = "$(readlink -f /usr/bin/python3 2>/dev/null)" ] &&
  system_python=1
pytest_venv=0
if [ -z "$python" ]; then
  need+=(python3 python3-pytest python3-venv)
elif ! "$python" -c 'import pytest' 2>/dev/null; then
  if [ $system_python = 1 ]; then need+=(python3-pytest); else pytest_venv=1; fi
fi
# venvs (the pytest venv, tools/wheel-check.sh) need ensurepip, a package of its own on Debian.
if [ $system_python = 1 ] && ! "$python" -c 'import ensurepip' 2>/dev/null; then
  need+=(python3-venv)
fi

if [ ${#need[@]} -gt 0 ]; then
  if [ "$(id -u)" -ne 0 ] || ! command -v apt-get >/dev/null; then
    echo "missing packages: ${need[*]} (install them, e.g. sudo apt-get install ${need[*]})" >&2
    exit 1
  fi
  echo "installing Debian packages with apt-get (into /usr): ${need[*]}"
  export DEBIAN_FRONTEND=noninteractive
  apt-get update -qq
  apt-get install -y -qq "${need[@]}" >/dev/null
fi
if [ $pytest_venv = 1 ] && ! "$repo/build/pytest-venv/bin/python" -c 'import pytest' 2>/dev/null; then
  echo "installing pytest from PyPI into $repo/build/pytest-venv (a venv over $python, which has" \
    "no pytest; the Python tests run there)"
  "$python" -m venv --system-site-packages "$repo/build/pytest-venv"
  "$repo/build/pytest-venv/bin/python" -m pip install -q pytest
fi
if ! command -v nvcc >/dev/null && [ ! -x /usr/local/cuda/bin/nvcc ]; then
  echo "the CUDA toolkit (nvcc, NVRTC and its headers) was not found: install CUDA 12.x or 13.x" >&2
  exit 1
fi
