#!/usr/bin/env bash
# The C ABI of libmoejit.so against the last release's, with libabigail (Debian: abigail-tools):
# builds the library with debug info in a folder of its own, writes its ABI with abidw and
# compares it with the committed baseline (abi/libmoejit-<release>.abi) with abidiff.
#
#   tools/check-abi.sh [--source DIR] [--build-dir DIR] [--baseline FILE]
#   tools/check-abi.sh [--source DIR] [--build-dir DIR] --dump FILE
#
# Exit 0 when every change is compatible: added functions (and variables), enumerators appended
# to an enum, and members appended to a struct_size-versioned struct (its first member is
# struct_size) past the release's size of it, the struct seen only through pointers; and what
# libabigail calls harmless (say, a return type swapped between an enum and an int of its size).
# Every change is printed first (abidiff's leaf report, harmless ones included): additions listed.
# Exit 1 with abidiff's report of what is not compatible: a function removed or changed, an enum
# value changed, a member inserted before the end of a struct or into its tail padding (the old
# size would cover it: the library could not tell an old caller's struct from a new one), a
# member of the release changed, or any change to a type passed by value. Exit 2 when the check
# itself could not run. --dump writes the ABI of the tree instead (how the baseline is made, from
# the release's commit: see abi/README.md).
#   --source DIR     the tree to build (default: this checkout)
#   --build-dir DIR  where to build it (default: DIR/build-abi)
#   --baseline FILE  the ABI to compare with (default: the one abi/libmoejit-*.abi here)
set -euo pipefail
here="$(cd "$(dirname "$0")/.." && pwd)"
source_dir="$here" build_dir="" baseline="" dump=""
usage() { sed -n '6,7p' "$0" | sed 's/^#  //' >&2; exit 2; }
die() { echo "check-abi: $*" >&2; exit 2; }
while [ $# -gt 0 ]; do
  [ $# -ge 2 ] || usage
  case "$1" in
    --source) source_dir="$(cd "$2" && pwd)" ;;
    --build-dir) build_dir="$2" ;;
    --baseline) baseline="$2" ;;
    --dump) dump="$2" ;;
    *) usage ;;
  esac
  shift 2
done
build_dir="${build_dir:-$source_dir/build-abi}"
for tool in abidw abidiff python3; do
  command -v "$tool" >/dev/null ||
    die "$tool not found (Debian: apt-get install abigail-tools, as tools/setup-deps.sh does)"
done
if [ -z "$dump" ] && [ -z "$baseline" ]; then
  shopt -s nullglob
  found=("$here"/abi/libmoejit-*.abi)
  [ ${#found[@]} -eq 1 ] ||
    die "expected one baseline abi/libmoejit-<version>.abi, found ${#found[@]}"
  baseline="${found[0]}"
fi

# -O0 -g: abidw reads the DWARF of the public types and the exported functions, which is the same
# at every optimization level (0.2.0's dumps from a RelWithDebInfo and a Debug build are
# byte-identical); -O0 builds in about half the time. Only the library, two jobs (CI has 2 cores).
export PATH="$PATH:/usr/local/cuda/bin"
extra=()
[ -e "$source_dir/.deps/include/xxhash.h" ] && [ ! -e /usr/include/xxhash.h ] &&
  extra+=(-DXXHASH_INCLUDE_DIR="$source_dir/.deps/include")
cmake -S "$source_dir" -B "$build_dir" -G Ninja -DCMAKE_BUILD_TYPE=Debug \
  -DMOEJIT_BUILD_TESTS=OFF -DMOEJIT_BUILD_TOOLS=OFF "${extra[@]}" >/dev/null ||
  die "configuring $source_dir failed"
cmake --build "$build_dir" -j2 --target moejit >"$build_dir/build.log" 2>&1 ||
  { cat "$build_dir/build.log" >&2; die "building libmoejit failed"; }

# The public header's types only, the exported functions only, no build paths, no DT_NEEDED: the
# dump depends on the API, not on where or against which spdlog it was built.
current="$build_dir/libmoejit.abi"
abidw --headers-dir "$source_dir/include/moejit" --drop-private-types --exported-interfaces-only \
  --no-corpus-path --no-comp-dir-path --short-locs --no-elf-needed \
  --out-file "${dump:-$current}" "$build_dir/libmoejit.so" || die "abidw failed"
if [ -n "$dump" ]; then
  echo "check-abi: wrote the ABI of $source_dir to $dump"
  exit 0
fi

release="$(basename "$baseline" .abi)"
release="${release#libmoejit-}"
helper="$here/tools/abi_versioned_structs.py"
python3 "$helper" suppressions "$baseline" >"$build_dir/compatible.abignore"
python3 "$helper" additions >"$build_dir/additions.abignore"
python3 "$helper" prefix "$baseline" "$current" >"$build_dir/libmoejit-prefix.abi"

# abidiff's exit status is a bit mask: 1 error, 2 usage error, 4 ABI change, 8 incompatible.
# No default suppression files: the user's or the system's would change the verdict.
run_abidiff() {
  local rc=0
  abidiff --no-default-suppression "$@" >"$out" 2>&1 || rc=$?
  if [ $((rc & 3)) -ne 0 ]; then
    cat "$out" >&2
    die "abidiff failed (exit $rc): abidiff --no-default-suppression $*"
  fi
  return "$rc"
}

echo "== Every change since $release (abidiff --leaf-changes-only --harmless, nothing suppressed)"
out="$build_dir/all-changes.txt"
run_abidiff --leaf-changes-only --harmless "$baseline" "$current" || true
if [ -s "$out" ]; then cat "$out"; else echo "(none)"; fi

failed=0
# The whole ABI, allowing what the structs' struct_size and the header's rules make compatible.
out="$build_dir/verdict.txt"
if ! run_abidiff --suppressions "$build_dir/compatible.abignore" "$baseline" "$current"; then
  echo "== INCOMPATIBLE with $release: abidiff with $build_dir/compatible.abignore"
  cat "$out"
  failed=1
fi
# That type suppression hides a versioned struct's whole change: its release members, cut out of
# the current ABI, are compared with none suppressed.
out="$build_dir/verdict-members.txt"
if ! run_abidiff --suppressions "$build_dir/additions.abignore" "$baseline" \
  "$build_dir/libmoejit-prefix.abi"; then
  echo "== INCOMPATIBLE with $release: a member that $release's versioned structs have changed"
  echo "   (abidiff of those members, cut out of the current ABI by tools/abi_versioned_structs.py)"
  cat "$out"
  failed=1
fi
if [ $failed -ne 0 ]; then
  echo "check-abi: libmoejit.so is NOT ABI-compatible with $release (reports above)"
  exit 1
fi
echo "check-abi: libmoejit.so is ABI-compatible with $release ($(basename "$baseline"))"
