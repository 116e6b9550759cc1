#include "runtime.h"

#include <atomic>
#include <cstdio>
#include <memory>
#include <mutex>

#include "combine_plan.h"
#include "error.h"
#include "fork_guard.h"
#include "logging.h"

namespace moejit {
namespace {

std::string hex_pointer(const void* p) {
  char text[32];
  std::snprintf(text, sizeof(text), "%p", p);
  return text;
}

}  // namespace

Runtime::Runtime(const Settings& settings)
    : fork_generation_(moejit::fork_generation()),
      store_(settings, stats_),
      modules_(store_, stats_) {
  // The logger reads MOEJIT_LOG_LEVEL when first used: use it now, so a malformed value is
  // reported as the runtime is created, not at the first message, which at the default level may
  // never come.
  logger();
}

void Runtime::combine(const moejit_combine_args* args, CUstream stream) {
  const CombinePlan plan = plan_combine(args);
  if (plan.nothing_to_do) return;
  launch_combine(plan, modules_.get(plan.spec), stream, stats_);
}

namespace {

// The default runtime of this process (of its fork generation). Leaked on purpose: kernels may
// still be launched from other static destructors at exit, and unloading modules after the driver
// has shut down is undefined.
std::atomic<Runtime*> g_default{nullptr};
std::mutex g_default_mutex;  // held only inside a fork gate scope, so never across a fork

}  // namespace

Runtime& default_runtime() {
  // Every warm moe_combine() passes here: one acquire load and two plain ones, no lock.
  Runtime* runtime = g_default.load(std::memory_order_acquire);
  if (runtime != nullptr && runtime->fork_generation() == fork_generation()) return *runtime;
  ForkGateScope gate;
  std::lock_guard<std::mutex> lock(g_default_mutex);
  runtime = g_default.load(std::memory_order_relaxed);
  // In a child process, the parent's default runtime is left as it is (never used, never freed):
  // its locks and pending results belong to threads that do not exist here. A creation that
  // throws (a bad environment) leaves none, and the next call tries again.
  if (runtime == nullptr || runtime->fork_generation() != fork_generation()) {
    runtime = new Runtime(resolve_settings(nullptr));
    g_default.store(runtime, std::memory_order_release);
  }
  return *runtime;
}

Runtime& runtime_of_this_process(moejit_runtime* handle) {
  auto* runtime = static_cast<Runtime*>(handle);
  if (runtime->fork_generation() != fork_generation())
    invalid_argument("runtime", hex_pointer(handle),
                     "was created before this process was forked from its parent, and belongs to "
                     "the parent: create a runtime in this process (moejit_runtime_create()), or "
                     "use the default runtime (NULL), which a forked child starts afresh");
  return *runtime;
}

}  // namespace moejit
