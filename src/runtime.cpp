#include "runtime.h"

#include <memory>
#include <mutex>

#include "combine_plan.h"

namespace moejit {

Runtime::Runtime(const Settings& settings) : store_(settings, stats_), modules_(store_, stats_) {}

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
