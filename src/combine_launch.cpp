#include <string>

#include "../kernel_templates/token_index_workspace.h"
#include "combine_plan.h"
#include "driver.h"
#include "error.h"

namespace moejit {

void launch_combine(const CombinePlan& plan, const LoadedKernels& kernels, CUstream stream,
                    Stats& stats) {
  if (plan.nothing_to_do) return;
  const bool chained = plan.list_helpers();
  if (chained && kernels.companion == nullptr)
    throw Error(MOEJIT_ERROR_INTERNAL, "launch_combine: the list helpers' module is missing");
  const DriverApi& d = driver();
  CombineParams params = plan.params;
  // Where the first kernel cannot be launched as a dependent (before sm_90, or a driver without
  // cuLaunchKernelEx) it runs in plain stream order: clearing the flag spares it the routing
  // prefetch and the wait, which would buy nothing there.
  if (!kernels.dependent_launch) params.dependent_launch = 0;
  void* kernel_args[] = {&params};
  // Each kernel after the first of the token-index chain may start while its predecessor drains
  // (programmatic dependent launch): it waits in griddepcontrol.wait before touching memory, so
  // only the launch latency overlaps. The call's first kernel does so only if the caller asked
  // (args->dependent_launch). Where unsupported, plain stream order.
  // cluster: blocks per thread-block cluster (0: none; the module supports them).
  auto launch = [&](const LoadedKernels& module, int kernel, unsigned gx, unsigned gy,
                    unsigned threads, bool dependent, const char* name, unsigned cluster = 0) {
    const bool programmatic = dependent && module.dependent_launch;
    const bool extended = programmatic || cluster > 0;
    const CUresult result =
        extended ? launch_with_attributes(d, module.functions[kernel], gx, gy, threads, stream,
                                          kernel_args, programmatic, cluster)
                 : d.cuLaunchKernel(module.functions[kernel], gx, gy, 1, threads, 1, 1, 0, stream,
                                    kernel_args, nullptr);
    if (result != CUDA_SUCCESS)  // the call's name is built only for the message
      throw_launch_failure(
          d, stream, result,
          std::string(extended ? "cuLaunchKernelEx(" : "cuLaunchKernel(") + name + ")");
    stats.launches.fetch_add(1, std::memory_order_relaxed);
  };
  const unsigned threads = static_cast<unsigned>(plan.spec.block_threads());
  const bool first_dependent = params.dependent_launch != 0;  // the caller asked, and it can
  if (plan.token_scan() || plan.one_token()) {
    launch(kernels, kCombineKernel, plan.combine_grid_x, plan.combine_grid_y, threads,
           first_dependent, kernel_name(plan.spec.kind));
    return;
  }
  if (chained) {
    launch(*kernels.companion, kClearKernel, plan.clear_blocks, 1, kHelperThreads, first_dependent,
           "token_index_clear");
    launch(*kernels.companion, kAssignKernel, plan.assign_blocks, 1, kHelperThreads, true,
           "token_index_assign");
    launch(kernels, heavy_kernel_slot(plan.spec.kind), plan.heavy_blocks, 1, kHeavyThreads, true,
           "token_index_heavy");
  }
  if (plan.cluster_blocks > 0 && !kernels.clusters) {
    // The epilogue's split kernel needs clusters this GPU lacks: its module's one-block kernel.
    launch(kernels, kEpilogueOneBlockKernel, plan.one_block_grid_x, 1, threads,
           chained || first_dependent, "combine_epilogue");
    return;
  }
  launch(kernels, kCombineKernel, plan.combine_grid_x, plan.combine_grid_y, threads,
         chained || first_dependent,
         is_epilogue(plan.spec.kind) ? kernel_name(plan.spec.kind) : "combine",
         plan.cluster_blocks);
}

}  // namespace moejit
