#!/usr/bin/env bash
# The wheel in a PyTorch environment on a GPU machine, with the CUDA toolkit out of reach, proving
# that pip's NVRTC (nvidia-cuda-nvrtc, which torch brings) is all the library needs:
#   tools/gpu-wheel-check.sh WHEEL OUTDIR
# WHEEL: a moejit-*.whl built elsewhere (tools/wheel-check.sh leaves one in build/wheel-check/dist;
# it needs no network here). Steps, each logged under OUTDIR:
#   1. a venv with --system-site-packages over python3 (torch, pip's NVRTC, pytest come from
#      there), the wheel installed into it with --no-deps --no-index;
#   2. the toolkit out of reach: CUDA_HOME / CUDA_PATH unset, every /usr/local/cuda* entry dropped
#      from PATH and LD_LIBRARY_PATH, and where a private mount namespace is allowed (unshare -m,
#      as root) /usr/local/cuda* hidden under empty tmpfs mounts in it, so that even ld.so.cache
#      leads nowhere (the machine itself is left as it is);
#   3. ldd / readelf -d of the installed library; a combine on the GPU with the library's debug log,
#      the NVRTC it loaded (its log line and /proc/self/maps), which must be pip's;
#   4. tests/python against the installed wheel: GPU required (MOEJIT_REQUIRE_GPU=1), pip's NVRTC
#      required (MOEJIT_EXPECT_NVRTC=pip), a fresh kernel cache so every kernel compiles here;
#   5. the moejit-precompile console command warms a cache for DeepSeek-V3 (sm_90), and a combine
#      then runs in no-compile mode from it.
# Exit status 0 only if every step passed.
set -uo pipefail
if [ $# -ne 2 ] || [ ! -f "$1" ]; then
  echo "usage: tools/gpu-wheel-check.sh WHEEL OUTDIR" >&2
  exit 2
fi
wheel=$(cd "$(dirname "$1")" && pwd)/$(basename "$1")
out=$(mkdir -p "$2" && cd "$2" && pwd)
cd "$(dirname "$0")/.." || exit 1
repo=$PWD

if [ "${MOEJIT_WHEEL_CHECK_INNER:-}" != 1 ]; then
  # Hide the toolkit in a private mount namespace when allowed; otherwise run with the filtered
  # environment alone and say so.
  if [ "$(id -u)" = 0 ] && command -v unshare >/dev/null && unshare -m true 2>/dev/null; then
    echo "toolkit hidden: /usr/local/cuda* under empty tmpfs mounts in a private mount namespace" |
      tee "$out/toolkit.txt"
    exec unshare -m --propagation private env MOEJIT_WHEEL_CHECK_INNER=1 MOEJIT_HIDE_TOOLKIT=1 \
      bash "$repo/tools/gpu-wheel-check.sh" "$wheel" "$out"
  fi
  echo "toolkit NOT hidden from ld.so.cache (no private mount namespace here): environment" \
    "filtered only" | tee "$out/toolkit.txt"
fi
if [ "${MOEJIT_HIDE_TOOLKIT:-}" = 1 ]; then
  for d in /usr/local/cuda*; do
    if [ ! -d "$d" ] || [ -L "$d" ]; then continue; fi
    mount -t tmpfs -o ro,size=4k none "$d" 2>&1 | tee -a "$out/toolkit.txt" ||
      echo "could not hide $d" | tee -a "$out/toolkit.txt"
  done
fi

# Drop every path under /usr/local/cuda* from a colon list.
filter() { tr ':' '\n' <<<"$1" | grep -v '^/usr/local/cuda' | paste -sd: -; }
PATH=$(filter "$PATH")
LD_LIBRARY_PATH=$(filter "${LD_LIBRARY_PATH:-}")
export PATH LD_LIBRARY_PATH
[ -n "$LD_LIBRARY_PATH" ] || unset LD_LIBRARY_PATH
unset CUDA_HOME CUDA_PATH MOEJIT_LIBRARY MOEJIT_PRECOMPILE MOEJIT_NVRTC_LIBRARY PYTHONPATH

scratch=$(mktemp -d)
trap 'rm -rf "$scratch"' EXIT
failed=()
step() {  # step NAME COMMAND...: output to OUTDIR/NAME.log, its tail on failure
  local name=$1
  shift
  printf '== %-24s ' "$name"
  if "$@" >"$out/$name.log" 2>&1; then
    echo PASS
  else
    echo "FAIL (exit $?; $out/$name.log)"
    tail -n 40 "$out/$name.log" | sed 's/^/   | /'
    failed+=("$name")
  fi
}

{
  echo "wheel: $wheel"
  python3 --version
  nvidia-smi --query-gpu=name,driver_version --format=csv,noheader 2>&1
  echo "toolkit reachable? nvcc: $(nvcc --version >/dev/null 2>&1 && echo runs || echo does not run);" \
    "/usr/local/cuda/lib64: $(ls /usr/local/cuda/lib64 2>&1 | head -c 200 | tr '\n' ' ')"
  echo "ld.so.cache's NVRTC (hidden files cannot be opened):"
  ldconfig -p | grep libnvrtc || echo "  none"
} 2>&1 | tee "$out/environment.txt"

venv=$scratch/venv
py=$venv/bin/python
# python3 may itself be a venv (the GPU machine's PyTorch lives in one): --system-site-packages
# would then see the base interpreter's packages, not its. A .pth file in the new venv names the
# site-packages of the python3 on PATH, so torch, pip's NVRTC and pytest come from there.
parent_site=$(python3 -c 'import site; print(site.getsitepackages()[0])')
step install bash -c "python3 -m venv --system-site-packages '$venv' &&
  echo '$parent_site' >\"\$('$py' -c 'import site; print(site.getsitepackages()[0])')/parent-env.pth\" &&
  '$py' -m pip install --no-deps --no-index '$wheel' && '$py' -m pip list 2>/dev/null |
  grep -Ei '^(moejit|torch|nvidia-cuda-nvrtc|pytest) '"
[ ${#failed[@]} -eq 0 ] || exit 1

lib=$("$py" -c 'import moejit, os; print(os.path.join(os.path.dirname(moejit.__file__), "libmoejit.so.0"))')
step library bash -c "echo '$lib'; readelf -d '$lib' | grep -E 'NEEDED|SONAME|RPATH|RUNPATH'; ldd '$lib'"
sed 's/^/   /' "$out/library.log"

# One combine on the GPU, in a fresh cache: which NVRTC compiled it.
cat >"$scratch/combine.py" <<'EOF'
import os, re, torch, moejit
from moejit import _nvrtc
x = torch.randn(64, 8, 7168, device="cuda", dtype=torch.bfloat16)
g = torch.rand(64, 8, device="cuda")
out = moejit.combine(x, gates=g)
ref = (x.double() * g.double().unsqueeze(-1)).sum(1)
err = ((out.double() - ref).norm() / ref.norm()).item()
print(f"moejit {moejit.version()}, torch {torch.__version__}, {torch.cuda.get_device_name()}: "
      f"relative error {err:.2e}")
assert err < 4e-3
maps = sorted({line.split()[-1] for line in open("/proc/self/maps") if "libnvrtc" in line})
print("NVRTC mapped in this process:", *maps, sep="\n  ")
pip = _nvrtc.find_pip_nvrtc()
print("pip's NVRTC:", pip)
assert pip is not None, "no nvidia-cuda-nvrtc in this environment"
assert not any(m.startswith("/usr/local/cuda") for m in maps), "a toolkit NVRTC was loaded"
EOF
# The library's own word (its debug line) must name pip's NVRTC too.
nvrtc_check() {
  env MOEJIT_LOG_LEVEL=debug MOEJIT_CACHE_DIR="$scratch/cache-combine" "$py" "$scratch/combine.py" &&
    grep -E "loaded NVRTC [0-9.]+ from /.*/nvidia/cu[0-9]+/lib/libnvrtc\.so\.[0-9]+ " \
      "$out/nvrtc.log" >/dev/null
}
step nvrtc nvrtc_check
grep -E "loaded NVRTC|relative error|mapped|^  /|pip's NVRTC" "$out/nvrtc.log" | sed 's/^/   /'

step pytest env MOEJIT_TEST_INSTALLED=1 MOEJIT_REQUIRE_GPU=1 MOEJIT_EXPECT_NVRTC=pip \
  MOEJIT_CACHE_DIR="$scratch/cache-pytest" "$py" -m pytest -q -rs -s -p no:cacheprovider \
  "$repo/tests/python"
grep -E "NVRTC used:|passed|failed|SKIPPED" "$out/pytest.log" | sed 's/^/   /'

configs=$(dirname "$lib")/precompile-configs
step precompile "$venv/bin/moejit-precompile" --model-config "$configs/deepseek-v3.json" \
  --arch sm_90 --cache-dir "$scratch/warm"
tail -n 1 "$out/precompile.log" | sed 's/^/   /'
step no-compile env MOEJIT_CACHE_DIR="$scratch/warm" MOEJIT_CACHE_MODE=no-compile "$py" -c '
import torch, moejit
x = torch.randn(4096, 8, 7168, device="cuda", dtype=torch.bfloat16)
m = torch.randperm(4096 * 8, device="cuda", dtype=torch.int32).reshape(4096, 8)
out = moejit.combine(x.reshape(-1, 7168), layout="gather_map", gather_map=m,
                     gates=torch.rand(4096, 8, device="cuda"))
torch.cuda.synchronize()
print("served from the warmed cache:", moejit.stats())
assert moejit.stats()["compiles"] == 0'
tail -n 1 "$out/no-compile.log" | sed 's/^/   /'

if [ ${#failed[@]} -gt 0 ]; then
  echo "== FAILED: ${failed[*]} (logs in $out)"
  exit 1
fi
echo "== wheel check on the GPU passed (logs in $out)"
