#include "runtime.h"

#include <memory>

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
  // unloading modules after the driver has shut down is undefined. A function-local static, not a
  // mutex: every warm moe_combine() passes here, and threads calling it at once would contend on
  // a lock; after the first success this is one acquire load. An initialization that throws (a bad
  // environment) leaves it uninitialized, so the next call tries again, as the C++ standard
  // guarantees ([stmt.dcl]).
  static Runtime* const runtime = new Runtime(resolve_settings(nullptr));
  return *runtime;
}

}  // namespace moejit
