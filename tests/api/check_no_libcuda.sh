#!/bin/sh
# Fails if any of the given binaries records libcuda (the CUDA driver or the toolkit's stub of it)
# as a dependency: libmoejit loads the driver with dlopen at its first combine, so that linking and
# loading it works on machines without a GPU driver.
set -eu
status=0
for f in "$@"; do
  dynamic=$(readelf -d "$f")
  if printf '%s\n' "$dynamic" | grep -E 'NEEDED.*\[libcuda\.so' >/dev/null; then
    echo "$f depends on libcuda:"; printf '%s\n' "$dynamic" | grep NEEDED; status=1
  fi
done
[ $status -ne 0 ] || echo "OK: no libcuda dependency in $*"
exit $status
