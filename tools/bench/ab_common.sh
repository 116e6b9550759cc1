# What tools/bench/ab-dispatch.sh and ab-skew.sh share; sourced, not run. The sourcing script sets
# `repo` (the checkout), `out` (its log folder), `work` (its build folder), `steps` and AB_NAME (its
# name, for messages). Gives: note, fail (the first failure's status stays in `status`), has_step,
# the CMake flags for this checkout's dependencies (`cfg`), the builds' folders (base_src,
# base_build, new_build), ab_export, ab_tree_line and ab_build.
status=0
note() { printf '\n== %s\n' "$*"; }
fail() {  # fail STATUS MESSAGE: remember the first failure, say what failed
  echo "$AB_NAME: $2" >&2
  [ "$status" -ne 0 ] || status=$1
}
has_step() { [[ " $steps " == *" $1 "* ]]; }
base_src="$work/base-src" base_build="$work/base-build" new_build="$work/new-build"

cfg=(-G Ninja -DCMAKE_BUILD_TYPE=Release)
if [ -e "$repo/.deps/include/xxhash.h" ] && [ ! -e /usr/include/xxhash.h ]; then
  cfg+=("-DXXHASH_INCLUDE_DIR=$repo/.deps/include")
fi
# The exported revision has no .deps/ of its own: point it at the checkout's libsodium.
if [ -e "$repo/.deps/lib/libsodium.a" ] && [ ! -e /usr/include/sodium.h ]; then
  cfg+=("-DSODIUM_ROOT=$repo/.deps")
fi

# ab_export REV DIR: REV's files (git archive) into a fresh DIR, its commit into base_sha. On
# failure says why (fail 2) and returns 1.
ab_export() {
  base_sha=$(git -C "$repo" rev-parse --verify "$1^{commit}" 2>"$out/base-export.log")
  if [ -z "$base_sha" ]; then
    fail 2 "revision '$1' is not in this repository's history (log: $out/base-export.log)"
    return 1
  fi
  if ! { rm -rf "$2" && mkdir -p "$2" && git -C "$repo" archive "$base_sha" | tar -x -C "$2"; }; then
    fail 2 "could not export $1 ($base_sha) into $2"
    return 1
  fi
}

# The working tree's commit, and whether it has uncommitted changes.
ab_tree_line() {
  echo "$(git -C "$repo" rev-parse HEAD)$(git -C "$repo" diff --quiet HEAD ||
    echo ' + uncommitted changes')"
}

# ab_build REV "BASE_TARGETS" "NEW_TARGETS" [BASE_CMAKE_FLAG...]: REV exported and built without
# tests into base_build (build-base.log), the working tree with tests into new_build
# (build-new.log; every target where NEW_TARGETS is empty); revisions.txt names both (A, B).
ab_build() {
  local rev=$1 base_targets=$2 new_targets=$3
  shift 3
  note "build: $rev -> $base_build, working tree -> $new_build (logs in $out)"
  if ab_export "$rev" "$base_src"; then
    echo "A: $rev = $base_sha" | tee "$out/revisions.txt"
    # shellcheck disable=SC2086  # the targets are words
    { cmake -S "$base_src" -B "$base_build" "${cfg[@]}" -DMOEJIT_BUILD_TESTS=OFF "$@" &&
      cmake --build "$base_build" --target $base_targets; } \
      >"$out/build-base.log" 2>&1 || fail 1 "the $rev build failed (log: $out/build-base.log)"
  fi
  echo "B: working tree = $(ab_tree_line)" | tee -a "$out/revisions.txt"
  # shellcheck disable=SC2086
  { cmake -S "$repo" -B "$new_build" "${cfg[@]}" -DMOEJIT_BUILD_TESTS=ON &&
    cmake --build "$new_build" ${new_targets:+--target $new_targets}; } \
    >"$out/build-new.log" 2>&1 || fail 1 "the working tree's build failed (log: $out/build-new.log)"
  tail -n 2 "$out/build-base.log" "$out/build-new.log" 2>/dev/null
}
