#include "module_cache.h"

#include <algorithm>
#include <future>
#include <iterator>
#include <system_error>
#include <unordered_set>

#include "combine_dispatch.h"
#include "driver.h"
#include "error.h"
#include "logging.h"
#include "nvrtc_compiler.h"

namespace moejit {
namespace {

CUcontext current_context(unsigned long long* id) {
  const DriverApi& d = driver();
  CUcontext ctx = nullptr;
  check_cuda(d.cuCtxGetCurrent(&ctx), "cuCtxGetCurrent");
  if (ctx == nullptr)
    throw Error(MOEJIT_ERROR_NO_DEVICE,
                "the calling thread has no current CUDA context: select a device first (e.g. "
                "cudaSetDevice() or torch.cuda.set_device()) or push a context "
                "(cuCtxPushCurrent)");
  *id = reinterpret_cast<unsigned long long>(ctx);
  // Context handles can be reused after a context is destroyed; ids cannot.
  if (d.cuCtxGetId != nullptr) check_cuda(d.cuCtxGetId(ctx, id), "cuCtxGetId");
  return ctx;
}

// cuModuleLoadData results that say the image itself is unusable (not a cubin, or none for this
// GPU): only those make a disk-cache entry suspect. Any other failure is the process's state, not
// the entry's: out of memory, or a context an earlier fault left broken (every call then fails
// the same way). Dropping the entry there would unlink a good shared file (or, in a read-only or
// no-compile cache, refuse it for the rest of the run) and report a rebuild instead of the
// driver's error.
bool image_refused(CUresult result) {
  return result == CUDA_ERROR_INVALID_IMAGE || result == CUDA_ERROR_NO_BINARY_FOR_GPU ||
         result == CUDA_ERROR_INVALID_PTX || result == CUDA_ERROR_UNSUPPORTED_PTX_VERSION ||
         result == CUDA_ERROR_INVALID_SOURCE;
}

// Whether the context that had `id` when the runtime saw it as `handle` has since been destroyed:
// cuCtxGetId of a destroyed context fails, and a context created since under the same handle has
// another id. Without cuCtxGetId (driver < 12.0) nothing tells: false.
bool context_destroyed(CUcontext handle, unsigned long long id) {
  const DriverApi& d = driver();
  unsigned long long now = 0;
  return d.cuCtxGetId != nullptr && (d.cuCtxGetId(handle, &now) != CUDA_SUCCESS || now != id);
}

}  // namespace

// Modules of every context are unloaded from whatever context is current. The documentation
// says cuModuleUnload works on the current context, but a module handle names its own: on the
// H200 (driver 580) a module of another context, or with no context current, unloaded with
// CUDA_SUCCESS, and one whose context the caller had destroyed returned
// CUDA_ERROR_CONTEXT_IS_DESTROYED (its memory went with the context). Results are ignored.
// A module of a destroyed context is not passed at all: its handle is no longer ours, and the
// driver may have given it to a module loaded since (it reuses context handles; the GPU test
// AModuleOfADestroyedContextIsNeverServedAgain prints when), which the unload would destroy under
// its owner (context_destroyed() tells).
ModuleCache::~ModuleCache() {
  if (entries_.empty()) return;
  const DriverApi& d = driver();
  std::unordered_set<unsigned long long> destroyed;
  for (const auto& [id, handle] : contexts_)
    if (context_destroyed(handle, id)) destroyed.insert(id);
  for (auto& [key, entry] : entries_)
    if (entry->ready.load() && entry->kernels.module != nullptr && !destroyed.count(key.context))
      d.cuModuleUnload(entry->kernels.module);
}

const LoadedKernels& ModuleCache::get(const KernelSpec& spec) {
  unsigned long long id = 0;
  const CUcontext ctx = current_context(&id);
  const Key key{id, spec};
  Entry* entry = nullptr;
  {
    std::shared_lock<std::shared_mutex> lock(mutex_);
    auto it = entries_.find(key);
    if (it != entries_.end()) entry = it->second.get();
  }
  if (entry != nullptr && entry->ready.load(std::memory_order_acquire)) {
    stats_.memory_hits.fetch_add(1, std::memory_order_relaxed);
    return entry->kernels;
  }
  if (entry == nullptr) {
    std::unique_lock<std::shared_mutex> lock(mutex_);
    if (contexts_.emplace(id, ctx).second) forget_destroyed_contexts();
    auto& slot = entries_[key];
    if (!slot) slot = std::make_unique<Entry>();
    // Entries are removed only once their context is destroyed, and the caller's context is
    // current: it may not be destroyed while this call uses it. The pointer stays valid.
    entry = slot.get();
  }
  // Failures seen before waiting: one more when the lock comes means the load this thread waited
  // for failed, and its error is this call's too.
  const uint64_t failures_before = entry->failures.load(std::memory_order_acquire);
  std::lock_guard<std::mutex> load_lock(entry->load_mutex);
  if (!entry->ready.load(std::memory_order_acquire)) {
    if (entry->failures.load(std::memory_order_relaxed) != failures_before)
      std::rethrow_exception(entry->failure);
    try {
      load(spec, ctx, *entry);
    } catch (...) {
      entry->failure = std::current_exception();
      entry->failures.fetch_add(1, std::memory_order_release);
      throw;
    }
    entry->ready.store(true, std::memory_order_release);
  } else {
    stats_.memory_hits.fetch_add(1, std::memory_order_relaxed);
  }
  return entry->kernels;
}

// A destroyed context's modules went with it (they are not unloaded: see the destructor); what
// is left here is their records, about 200 bytes per spec. They are dropped when a context is
// first seen, which is when a process that destroys contexts creates the next one, so the records
// kept are those of live contexts and of the ones destroyed since the last new context (without
// cuCtxGetId, of every context: nothing tells a destroyed one). An entry still locked is being
// loaded (by a caller whose context was destroyed under it, which the caller may not do): it stays.
void ModuleCache::forget_destroyed_contexts() {
  for (auto c = contexts_.begin(); c != contexts_.end();) {
    if (!context_destroyed(c->second, c->first)) {
      ++c;
      continue;
    }
    bool all_forgotten = true;
    for (auto e = entries_.begin(); e != entries_.end();) {
      Entry& entry = *e->second;
      if (e->first.context != c->first) {
        ++e;
        continue;
      }
      if (!entry.load_mutex.try_lock()) {
        all_forgotten = false;
        ++e;
        continue;
      }
      entry.load_mutex.unlock();
      if (entry.ready.load(std::memory_order_acquire) && entry.kernels.module != nullptr)
        stats_.loaded_modules.fetch_sub(1, std::memory_order_relaxed);
      e = entries_.erase(e);
    }
    logger().debug("forgot the modules of destroyed context {}", static_cast<void*>(c->second));
    c = all_forgotten ? contexts_.erase(c) : std::next(c);
  }
}

void ModuleCache::load(const KernelSpec& spec, CUcontext context, Entry& entry) {
  const DriverApi& d = driver();
  CUdevice device = 0;
  check_cuda(d.cuCtxGetDevice(&device), "cuCtxGetDevice");
  int major = 0, minor = 0;
  check_cuda(d.cuDeviceGetAttribute(&major, CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR, device),
             "cuDeviceGetAttribute(COMPUTE_CAPABILITY_MAJOR)");
  check_cuda(d.cuDeviceGetAttribute(&minor, CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MINOR, device),
             "cuDeviceGetAttribute(COMPUTE_CAPABILITY_MINOR)");
  const Target target = target_for_device(major * 10 + minor);
  // A module with a companion (the list path's helpers): build that on another thread while this
  // one builds spec, so a first call that compiles both waits for the longer compile, not for
  // their sum (NVRTC compiles concurrently; the store builds each module once, and the
  // helpers' get() below takes the result). Only the build moves: CUDA calls stay on this thread,
  // in its context. A failure there resurfaces from that get(). No thread to be had: that get()
  // builds it afterwards, as before.
  const std::optional<KernelSpec> companion = companion_module(spec);
  std::future<void> helpers_ahead;
  if (companion) {
    try {
      helpers_ahead = std::async(std::launch::async, [this, &companion, &target] {
        try {
          store_.obtain(*companion, target);
        } catch (...) {
        }
      });
    } catch (const std::system_error&) {
    }
  }
  KernelStore::Source source;
  std::shared_ptr<const CompiledModule> module = store_.obtain(spec, target, &source);
  if (helpers_ahead.valid()) helpers_ahead.wait();

  LoadedKernels k;
  // The companion first: a failure there leaves nothing of this entry loaded. Its entry is
  // another key (its own lock) and never needs this one, so the nested get cannot deadlock.
  if (companion) k.companion = &get(*companion);
  // The store validated the image (a disk entry is checked before it gets here): a truncated or
  // foreign binary never reaches cuModuleLoadData. If the driver still refuses the image of an
  // entry that came from the disk cache, it is a miss: forget it, rebuild, and try once more.
  CUresult loaded = d.cuModuleLoadData(&k.module, module->image.data());
  if (image_refused(loaded) && source != KernelStore::Source::kCompiled) {
    logger().warn("{} for cached {} ({}); rebuilding it",
                  describe_cuda_error("cuModuleLoadData", loaded), spec.describe(), target.name());
    stats_.disk_errors.fetch_add(1, std::memory_order_relaxed);
    store_.invalidate(spec, target);
    module = store_.obtain(spec, target, &source);
    loaded = d.cuModuleLoadData(&k.module, module->image.data());
  }
  if (loaded != CUDA_SUCCESS)
    throw Error(MOEJIT_ERROR_CUDA, describe_cuda_error("cuModuleLoadData", loaded) + " for " +
                                       spec.describe() + " (" + target.name() + ")");
  for (size_t i = 0; i < module->lowered_names.size() && i < kMaxKernels; ++i) {
    const CUresult got =
        d.cuModuleGetFunction(&k.functions[i], k.module, module->lowered_names[i].c_str());
    if (got != CUDA_SUCCESS) {
      d.cuModuleUnload(k.module);
      throw Error(MOEJIT_ERROR_CUDA, describe_cuda_error("cuModuleGetFunction", got) + " for " +
                                         module->lowered_names[i]);
    }
  }
  // The kernels compile griddepcontrol.wait in only for an sm_90+ target: a module built for
  // an older target (PTX JIT-compiled on a newer device) must never be launched as a
  // programmatic dependent, or it would read what its predecessor is still writing.
  k.dependent_launch = major >= 9 && target.sm >= 90 && d.cuLaunchKernelEx != nullptr;
  // The cluster kernel's barriers and distributed shared memory, likewise: sm_90+ code only.
  k.clusters = k.dependent_launch;
  entry.kernels = k;
  stats_.loaded_modules.fetch_add(1, std::memory_order_relaxed);
  logger().debug("loaded {} ({}) in context {}", spec.describe(), target.name(),
                 static_cast<void*>(context));
}

}  // namespace moejit
