#include "helper_kernels.h"

#include <chrono>
#include <stdexcept>

#include "moejit_internal.h"
#include "producer_source.h"

namespace moejit_bench {
namespace {

// extern "C": no name expressions or lowered names needed. %globaltimer counts nanoseconds, so the
// spin needs no clock rate (cudaDeviceProp::clockRate is gone in CUDA 13). No header is included:
// NVRTC gets no include path, like the combine templates.
constexpr const char* kSource = R"(
extern "C" __global__ void moejit_bench_empty() {}

// Reads n 16-byte words and keeps nothing (a word no input holds stops the compiler from dropping
// the loads): stands for the expert GEMMs' weight stream, which leaves little of what was in L2.
extern "C" __global__ void moejit_bench_sweep(const uint4* src, unsigned long long n,
                                              unsigned* sink) {
  unsigned acc = 0;
  for (unsigned long long i = blockIdx.x * (unsigned long long)blockDim.x + threadIdx.x; i < n;
       i += (unsigned long long)gridDim.x * blockDim.x) {
    const uint4 v = src[i];
    acc ^= v.x ^ v.y ^ v.z ^ v.w;
  }
  if (acc == 0x6d6f656au) *sink = acc;
}

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
  request.source = std::string(kSource) + kProducerSource;
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
  moejit::check_cuda(d.cuModuleGetFunction(&produce_, module_, "moejit_bench_produce"),
                     "cuModuleGetFunction(moejit_bench_produce)");
  moejit::check_cuda(d.cuModuleGetFunction(&sweep_, module_, "moejit_bench_sweep"),
                     "cuModuleGetFunction(moejit_bench_sweep)");
}

HelperKernels::~HelperKernels() {
  if (module_ != nullptr) moejit::driver().cuModuleUnload(module_);
}

void HelperKernels::launch_empty(CUstream stream) const {
  moejit::check_cuda(
      moejit::driver().cuLaunchKernel(empty_, 1, 1, 1, 1, 1, 1, 0, stream, nullptr, nullptr),
      "cuLaunchKernel(moejit_bench_empty)");
}

namespace {

// As a programmatic dependent of the stream's previous kernel if `dependent` (the library's own
// launch helper), else a plain launch.
void launch_1d(CUfunction f, unsigned blocks, unsigned threads, CUstream stream, void** args,
               bool dependent, const char* what) {
  const moejit::DriverApi& d = moejit::driver();
  if (dependent && d.cuLaunchKernelEx == nullptr)
    throw std::runtime_error(std::string(what) + ": the driver has no cuLaunchKernelEx");
  moejit::check_cuda(
      dependent ? moejit::launch_programmatic(d, f, blocks, 1, threads, stream, args)
                : d.cuLaunchKernel(f, blocks, 1, 1, threads, 1, 1, 0, stream, args, nullptr),
      what);
}

}  // namespace

void HelperKernels::launch_empty_ex(CUstream stream, bool dependent) const {
  launch_1d(empty_, 1, 1, stream, nullptr, dependent, "launch(moejit_bench_empty)");
}

void HelperKernels::launch_produce(CUstream stream, const void* src, void* dst, size_t bytes,
                                   double microseconds, bool dependent) const {
  if (bytes % 16 != 0) throw std::runtime_error("moejit_bench_produce: bytes must be 16-aligned");
  unsigned long long words = bytes / 16;
  unsigned long long nanoseconds = static_cast<unsigned long long>(microseconds * 1e3);
  void* args[] = {&src, &dst, &words, &nanoseconds};
  launch_1d(produce_, 528, 256, stream, args, dependent, "launch(moejit_bench_produce)");
}

void HelperKernels::launch_sweep(CUstream stream, const void* src, size_t bytes, void* sink) const {
  if (bytes % 16 != 0) throw std::runtime_error("moejit_bench_sweep: bytes must be 16-aligned");
  unsigned long long words = bytes / 16;
  void* args[] = {&src, &words, &sink};
  launch_1d(sweep_, 528, 256, stream, args, false, "launch(moejit_bench_sweep)");
}

void HelperKernels::launch_spin(CUstream stream, double microseconds) const {
  unsigned long long nanoseconds = static_cast<unsigned long long>(microseconds * 1e3);
  void* args[] = {&nanoseconds};
  moejit::check_cuda(
      moejit::driver().cuLaunchKernel(spin_, 1, 1, 1, 1, 1, 1, 0, stream, args, nullptr),
      "cuLaunchKernel(moejit_bench_spin)");
}

}  // namespace moejit_bench
