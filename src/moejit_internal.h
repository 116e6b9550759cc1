// The library's internals that its own tools (moejit-precompile, moejit-bench, moejit-demo) build
// on, in one header: a tool includes this and the public header, and nothing else from src/. Not
// installed: the C API (include/moejit/moejit.h) is the only stable interface.
#pragma once

#include "cache_admin.h"
#include "cache_files.h"
#include "cache_key.h"
#include "combine_dispatch.h"
#include "combine_plan.h"
#include "driver.h"
#include "driver_probe.h"
#include "error.h"
#include "file_cache.h"
#include "kernel_sources.h"
#include "kernel_spec.h"
#include "kernel_store.h"
#include "module_cache.h"
#include "nvrtc_compiler.h"
#include "settings.h"
#include "stats.h"
