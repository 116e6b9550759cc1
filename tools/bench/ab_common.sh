# What tools/bench/ab-dispatch.sh and ab-skew.sh share; sourced, not run. The sourcing script sets
# `repo` (the checkout), `out` (its log folder), `steps` and AB_NAME (its name, for messages).
# Gives: note, fail (the first failure's status stays in `status`), has_step, the CMake flags for
# this checkout's dependencies (`cfg`), ab_export and ab_tree_line.
status=0
note() { printf '\n== %s\n' "$*"; }
fail() {  # fail STATUS MESSAGE: remember the first failure, say what failed
  echo "$AB_NAME: $2" >&2
  [ "$status" -ne 0 ] || status=$1
}
has_step() { [[ " $steps " == *" $1 "* ]]; }

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
