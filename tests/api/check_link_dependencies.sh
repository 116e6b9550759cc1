#!/bin/sh
# Fails if any of the given binaries records a link dependency beyond the C and C++ runtimes (libc,
# libm, libdl, libpthread, librt, the dynamic loader, libstdc++, libgcc_s): libmoejit loads the CUDA
# driver (libcuda.so.1) and NVRTC with dlopen, and uses spdlog/fmt header-only, so that it loads on
# machines without a driver or a toolkit and a wheel of it needs nothing else.
set -eu
# (and the sanitizers' runtimes, in a tools/sanitize.sh build)
allowed='^(libc|libm|libdl|libpthread|librt|libstdc\+\+|libgcc_s|libasan|libubsan|libtsan)\.so\.[0-9]+$'
allowed="$allowed|^ld-linux[-a-z0-9_.]*\.so\.[0-9]+\$"
status=0
for f in "$@"; do
  needed=$(readelf -d "$f" | sed -n 's/.*(NEEDED).*\[\(.*\)\]/\1/p')
  extra=$(printf '%s\n' "$needed" | grep -Ev "$allowed" || true)
  if [ -n "$extra" ]; then
    echo "$f depends on more than the C and C++ runtimes:"
    printf '  %s\n' $extra
    status=1
  else
    echo "OK: $f needs only" $needed
  fi
done
exit $status
