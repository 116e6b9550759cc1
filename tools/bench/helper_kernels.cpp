#include "helper_kernels.h"

#include <chrono>

#include "driver.h"

namespace moejit_bench {
namespace {

// extern "C": no name expressions or lowered names needed. %globaltimer counts nanoseconds, so the
// spin needs no clock rate (cudaDeviceProp::clockRate is gone in CUDA 13). No header is included:
// NVRTC gets no include path, like the combine templates.
constexpr const char* kSource = R"(
extern "C" __global__ void moejit_bench_empty() {}

extern "C" __global__ void moejit_bench_spin(unsigned long long nanoseconds) {
  unsigned long long start, now;
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(start));
  do {
    asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(now));
  } while (now - start < nanoseconds);
}
)";

}  // namespace

HelperKernels::HelperKernels(const moejit::Target& target, bool load) {
  moejit::CompileRequest request;
  request.program_name = "moejit_bench_helpers.cu";
  request.source = kSource;
  request.options = moejit::compile_options(target);
  request.target = target;
  const auto start = std::chrono::steady_clock::now();
  image_ = moejit::compile(request).image;
  compile_ms_ =
      std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - start).count();
  if (!load) return;
  const moejit::DriverApi& d = moejit::driver();
  moejit::check_cuda(d.cuModuleLoadData(&module_, image_.data()), "cuModuleLoadData(helpers)");
  moejit::check_cuda(d.cuModuleGetFunction(&empty_, module_, "moejit_bench_empty"),
                     "cuModuleGetFunction(moejit_bench_empty)");
  moejit::check_cuda(d.cuModuleGetFunction(&spin_, module_, "moejit_bench_spin"),
                     "cuModuleGetFunction(moejit_bench_spin)");
}

HelperKernels::~HelperKernels() {
  if (module_ != nullptr) moejit::driver().cuModuleUnload(module_);
}

void HelperKernels::launch_empty(CUstream stream) const {
  moejit::check_cuda(
      moejit::driver().cuLaunchKernel(empty_, 1, 1, 1, 1, 1, 1, 0, stream, nullptr, nullptr),
      "cuLaunchKernel(moejit_bench_empty)");
}

void HelperKernels::launch_spin(CUstream stream, double microseconds) const {
  unsigned long long nanoseconds = static_cast<unsigned long long>(microseconds * 1e3);
  void* args[] = {&nanoseconds};
  moejit::check_cuda(
      moejit::driver().cuLaunchKernel(spin_, 1, 1, 1, 1, 1, 1, 0, stream, args, nullptr),
      "cuLaunchKernel(moejit_bench_spin)");
}

}  // namespace moejit_bench
