#!/usr/bin/env bash
# Installs what libmoejit builds with, on Debian/Ubuntu, if something is missing. The CUDA toolkit
# (nvcc, NVRTC, headers) is expected under /usr/local/cuda or on PATH; it is not installed here.
set -euo pipefail
need=()
have_header() { [ -e "/usr/include/$1" ]; }
command -v cmake >/dev/null || need+=(cmake)
command -v ninja >/dev/null || need+=(ninja-build)
command -v g++ >/dev/null || need+=(g++)
command -v pkg-config >/dev/null || need+=(pkg-config)
command -v make >/dev/null || need+=(make)
have_header spdlog/spdlog.h || need+=(libspdlog-dev)
have_header xxhash.h || [ -e "$(dirname "$0")/../.deps/include/xxhash.h" ] || need+=(libxxhash-dev)
have_header gtest/gtest.h || need+=(libgtest-dev)
have_header CLI/CLI.hpp || need+=(libcli11-dev)
have_header nlohmann/json.hpp || need+=(nlohmann-json3-dev)
# libsodium (HMAC of authenticated cache entries), linked statically: Debian's libsodium-dev has the
# PIC libsodium.a. .deps/ may hold it instead (include/sodium.h, lib/libsodium.a).
{ have_header sodium.h && ls /usr/lib/*/libsodium.a /usr/lib/libsodium.a >/dev/null 2>&1; } ||
  [ -e "$(dirname "$0")/../.deps/lib/libsodium.a" ] || need+=(libsodium-dev)
if [ ${#need[@]} -gt 0 ]; then
  if [ "$(id -u)" -ne 0 ] || ! command -v apt-get >/dev/null; then
    echo "missing packages: ${need[*]} (install them, e.g. sudo apt-get install ${need[*]})" >&2
    exit 1
  fi
  echo "installing: ${need[*]}"
  export DEBIAN_FRONTEND=noninteractive
  apt-get update -qq
  apt-get install -y -qq "${need[@]}" >/dev/null
fi
# The Python tests run under the python3 on PATH (pyenv or the system's): give that one pytest.
if ! python3 -c 'import pytest' 2>/dev/null; then
  python3 -m pip install -q pytest 2>/dev/null ||
    { [ "$(id -u)" -eq 0 ] && apt-get install -y -qq python3-pytest >/dev/null; } ||
    echo "warning: pytest is not installed for $(command -v python3): the python tests will fail" >&2
fi
if ! command -v nvcc >/dev/null && [ ! -x /usr/local/cuda/bin/nvcc ]; then
  echo "the CUDA toolkit (nvcc, NVRTC) was not found: install CUDA 12.x or 13.x" >&2
  exit 1
fi
