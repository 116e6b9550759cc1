#!/bin/sh
# Fails if libmoejit.so exports any symbol other than the C API (moejit_* and moe_combine), or if
# it lacks its versioned SONAME.
set -eu
lib=$1
exported=$(nm -D --defined-only "$lib" | awk '{print $3}' | sed 's/@.*//' | sort -u)
unexpected=$(printf '%s\n' "$exported" | grep -v -E '^(moejit_[a-z_]+|moe_combine|MOEJIT_0)$' || true)
if [ -n "$unexpected" ]; then
  echo "unexpected exported symbols:"; printf '%s\n' "$unexpected"; exit 1
fi
count=$(printf '%s\n' "$exported" | grep -c -E '^(moejit_|moe_combine)')
readelf -d "$lib" | grep -q 'SONAME.*libmoejit\.so\.0' || { echo "missing SONAME libmoejit.so.0"; exit 1; }
echo "OK: $count C API symbols exported, nothing else; SONAME libmoejit.so.0"
