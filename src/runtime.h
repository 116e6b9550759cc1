// A runtime: resolved settings, statistics, the kernel store (disk cache + NVRTC) and the
// per-context module cache. The default runtime is created on first use from the environment, and
// again in a child process after fork() (fork_guard.h).
#pragma once

#include <cuda.h>

#include <cstdint>

#include "kernel_store.h"
#include "module_cache.h"
#include "settings.h"
#include "stats.h"

struct moejit_runtime {};  // the public handle type; Runtime derives from it

namespace moejit {

class Runtime : public moejit_runtime {
 public:
  explicit Runtime(const Settings& settings);

  // Plans, finds (or builds) the kernels in the current context, launches. Throws Error.
  void combine(const moejit_combine_args* args, CUstream stream);

  Stats& stats() { return stats_; }
  KernelStore& store() { return store_; }
  // The fork generation this runtime was created in: in a child process it was its parent's.
  uint64_t fork_generation() const { return fork_generation_; }

 private:
  const uint64_t fork_generation_;
  Stats stats_;
  KernelStore store_;
  ModuleCache modules_;
};

// The default runtime (NULL handle), from the environment. Throws Error if the environment holds
// an invalid setting; later calls then retry.
Runtime& default_runtime();

// An explicit runtime handle, refused (Error MOEJIT_ERROR_INVALID_ARGUMENT) if it was created
// in the parent of this process, before a fork().
Runtime& runtime_of_this_process(moejit_runtime* handle);

}  // namespace moejit
