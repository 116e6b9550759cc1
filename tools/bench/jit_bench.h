// The JIT figures (--jit): what the run-time compilation costs a caller, measured on the library's
// own internals so each cost is isolated:
//   cold compiles  KernelStore::obtain() with the disk cache disabled: the first NVRTC compile in
//                  the process (NVRTC's own start-up included), then later, different ones; each
//                  spec is compiled again a few times (fresh stores: nothing is reused), in
//                  rounds over all specs so that a drift in the host's speed hits each alike, and
//                  the median and the minimum of those later compiles are reported too: the
//                  median is what a caller waits, the minimum what the compile costs on this
//                  host unloaded (the H200's host varied by up to 60% between runs);
//   module pair    the token index's list-path combine and its list helpers, built one after the
//                  other and built concurrently (what a first list-path call does), fresh stores;
//   disk-cache hit a fresh KernelStore on a directory another store has just filled (read +
//                  validate), plus cuModuleLoadData of the image; reported as unavailable, not as
//                  a number, when the build has no disk cache or the store did not hit;
//   first call     a fresh runtime's first moejit_runtime_combine (compile + load + launch): a
//                  gather-map decode call (one module), and a token-index call on the list path,
//                  which needs two modules (the combine and the list helpers, built concurrently);
//   host overhead  CPU time per warm moe_combine() enqueue vs a bare cuLaunchKernel of the same
//                  kernel with the same parameters.
#pragma once

#include <cuda_runtime.h>

#include <string>
#include <vector>

#include "moejit_internal.h"

namespace moejit_bench {

struct CompileFigure {
  std::string spec;              // KernelSpec::describe()
  double ms = 0.0;               // its first compile (for the first spec: the process's first)
  double later_median_ms = 0.0;  // median of kLaterCompiles more compiles of the same spec
  double later_min_ms = 0.0;     // and the fastest of them
  // The process's CPU time in those compiles, median: next to the wall time it says whether a
  // slow run waited for a CPU (wall well above CPU: other load on the host) or ran slower on one.
  double later_cpu_median_ms = 0.0;
  size_t image_bytes = 0;
};

constexpr int kLaterCompiles = 5;

struct JitFigures {
  std::string target;  // "sm_90"
  std::string nvrtc_version;
  // NVRTC keeps compiled programs in the CUDA compute cache (~/.nv/ComputeCache) unless
  // CUDA_CACHE_DISABLE=1: a compile of a program any earlier process compiled is then a cache hit
  // (about 40 ms instead of 130-280 ms on the H200 host), not a cold compile. What held here.
  std::string compute_cache;
  std::vector<CompileFigure> cold;  // in order: the first is the first compile of the process
  std::string pair_spec;            // the list-path combine built together with its helpers
  double pair_serial_ms = 0.0;      // median: combine, then helpers, on one thread
  double pair_concurrent_ms = 0.0;  // median: helpers on a second thread meanwhile

  bool disk_available = false;
  std::string disk_note;              // why it is unavailable, or what was measured
  double disk_hit_ms = 0.0;           // median obtain() on a fresh store (read + validate)
  bool module_load_measured = false;  // false without a GPU: module_load_ms means nothing
  double module_load_ms = 0.0;        // median cuModuleLoadData + cuModuleGetFunction

  double first_call_ms = 0.0;   // fresh runtime, cache disabled: first call + synchronize
  double second_call_us = 0.0;  // the same runtime's next call + synchronize
  std::string first_call_token_index_case;  // a list-path shape
  double first_call_token_index_ms = 0.0;   // its first call on another fresh runtime

  std::string host_case;  // the shape and layout timed for host overhead
  int host_calls = 0;
  double moe_combine_host_us = 0.0;  // per call
  double bare_launch_host_us = 0.0;  // per call
};

// Call first in main, before anything loads CUDA or NVRTC: unless CUDA_CACHE_DISABLE is already
// set, sets it to 1 so that the compiles measured are cold, and records which held.
void disable_compute_cache_for_jit(JitFigures* figures);

// Cold compiles: needs no GPU. Call before anything else compiles, so the first is really the
// first compile of the process.
void measure_cold_compiles(const moejit::Target& target, JitFigures* figures);

// Disk cache (read + validate needs no GPU; the module load is measured only if gpu).
void measure_disk_cache(const moejit::Target& target, bool gpu, JitFigures* figures);

// First call on a fresh runtime, and the host overhead of warm calls. Needs a GPU.
void measure_calls(cudaStream_t stream, JitFigures* figures);

void print_jit(const JitFigures& figures);

}  // namespace moejit_bench
