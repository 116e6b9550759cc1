#include "runtime.h"

#include <memory>
#include <mutex>

#include "combine_plan.h"
#include "logging.h"

namespace moejit {

Runtime::Runtime(const Settings& settings) : store_(settings, stats_), modules_(store_, stats_) {
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

Runtime& default_runtime() {
  // Leaked on purpose: kernels may still be launched from other static destructors at exit, and
  // unloading modules after the driver has shut down is undefined.
  static std::mutex mutex;
  static Runtime* runtime = nullptr;
  std::lock_guard<std::mutex> lock(mutex);
  if (runtime == nullptr) runtime = new Runtime(resolve_settings(nullptr));
  return *runtime;
}

}  // namespace moejit
