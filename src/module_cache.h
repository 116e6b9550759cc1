// Loaded kernels per (CUDA context, KernelSpec). Modules belong to a context, so the same spec is
// loaded once in each context that uses it (jitify2 keys its cache the same way). The warm path
// is one shared-lock lookup; a miss loads (compiling through the KernelStore if needed) exactly
// once, other threads missing the same key wait for that load and share its result, a failure
// included (a later call tries again). The entries of a context the
// caller destroyed are forgotten when the next new context is first used, so that a process that
// creates and destroys contexts does not collect them for the runtime's lifetime.
#pragma once

#include <cuda.h>

#include <atomic>
#include <cstdint>
#include <exception>
#include <memory>
#include <mutex>
#include <shared_mutex>
#include <unordered_map>

#include "kernel_spec.h"
#include "kernel_store.h"
#include "stats.h"

namespace moejit {

struct LoadedKernels {
  CUmodule module = nullptr;
  CUfunction functions[kMaxKernels] = {};
  // The device (compute capability 9.0+) and driver can start a kernel of the token-index chain
  // while its predecessor drains (programmatic dependent launch, cuLaunchKernelEx).
  bool dependent_launch = false;
  // The device (sm_90+) and driver launch thread-block clusters (the epilogue's cluster kernel).
  bool clusters = false;
  // The module a call of this spec launches first (companion_module(): the token index's list
  // helpers), loaded together with it, so a warm call finds both in one lookup. Null for most.
  const LoadedKernels* companion = nullptr;
};

class ModuleCache {
 public:
  ModuleCache(KernelStore& store, Stats& stats) : store_(store), stats_(stats) {}
  ~ModuleCache();  // unloads the modules of every context that still exists (errors ignored)
  ModuleCache(const ModuleCache&) = delete;
  ModuleCache& operator=(const ModuleCache&) = delete;

  // The kernels of spec in the calling thread's current context (with its companion module, if
  // it has one). Throws Error.
  const LoadedKernels& get(const KernelSpec& spec);

 private:
  struct Key {
    unsigned long long context;  // cuCtxGetId (unique for the process), else the handle
    KernelSpec spec;
    bool operator==(const Key& o) const { return context == o.context && spec == o.spec; }
  };
  struct KeyHash {
    size_t operator()(const Key& k) const {
      return k.spec.hash() ^ (k.context * 0x9e3779b97f4a7c15ull);
    }
  };
  struct Entry {
    std::mutex load_mutex;           // held while loading: one loader per key
    std::atomic<bool> ready{false};  // set once kernels is complete; never cleared
    LoadedKernels kernels;
    // Failed loads so far, and the last one's error (guarded by load_mutex): the threads that
    // waited on a load that failed share its error instead of each compiling again.
    std::atomic<uint64_t> failures{0};
    std::exception_ptr failure;
  };

  void load(const KernelSpec& spec, CUcontext context, Entry& entry);
  // Called with mutex_ held exclusively, when a context is seen for the first time: forgets the
  // entries of every context that has been destroyed since it was seen.
  void forget_destroyed_contexts();

  KernelStore& store_;
  Stats& stats_;
  std::shared_mutex mutex_;  // guards entries_ (the map, not the entries' contents)
  std::unordered_map<Key, std::unique_ptr<Entry>, KeyHash> entries_;
  // Every context with entries (each entry's Key::context is here): its id and its handle, which
  // context_destroyed() checks.
  std::unordered_map<unsigned long long, CUcontext> contexts_;
};

}  // namespace moejit
