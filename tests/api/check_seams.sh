#!/bin/sh
# The seams the library keeps (docs/cache.md, src/moejit_internal.h), checked on the sources and
# the built library:
#  - every environment variable is read in src/settings.cpp, nowhere else in src/;
#  - no test hook that parks a thread ships in libmoejit.so (the cache's writer-parking hook is a
#    function pointer only a test sets: the library neither reads its variable nor calls pause());
#  - the tools reach the library's internals through src/moejit_internal.h only;
#  - the disk cache's interface (disk_cache.*) includes none of its implementation.
# Usage: check_seams.sh <source dir> <libmoejit.so>
set -eu
src=$1
lib=$2
fail=0
readers=$(grep -l -E '\b(std::)?(secure_)?getenv\(' "$src"/src/*.c "$src"/src/*.cpp "$src"/src/*.h 2>/dev/null |
  grep -v '/src/settings\.cpp$' || true)
if [ -n "$readers" ]; then
  echo "environment variables read outside src/settings.cpp:"; echo "$readers"; fail=1
fi
if grep -a -q MOEJIT_TEST_ "$lib"; then
  echo "$lib holds a MOEJIT_TEST_ variable name: a test hook ships in the library"; fail=1
fi
if nm -D --undefined-only "$lib" | awk '{print $2}' | sed 's/@.*//' | grep -q -x pause; then
  echo "$lib calls pause(): a test hook that parks a thread ships in the library"; fail=1
fi
for f in "$src"/tools/*/*.cpp "$src"/tools/*/*.h; do
  for inc in $(sed -n 's/^#include "\([^"]*\)".*/\1/p' "$f"); do
    if [ -e "$src/src/$inc" ] && [ "$inc" != moejit_internal.h ]; then
      echo "$f includes src/$inc: tools include the internals through moejit_internal.h"; fail=1
    fi
  done
done
up=$(grep -l -E '#include "(file_cache|cache_files|cache_admin)\.h"' "$src"/src/disk_cache.* || true)
if [ -n "$up" ]; then
  echo "the disk cache's interface includes its implementation:"; echo "$up"; fail=1
fi
[ $fail -eq 0 ] && echo "OK: environment read in settings.cpp only, no test hook in the library, tools through moejit_internal.h"
exit $fail
