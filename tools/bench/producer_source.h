// The source of a "producer" kernel for programmatic-dependent-launch measurements and tests: a
// stand-in for the kernel before the combine in a decode step (the experts' down projection). It
// waits for its own predecessor where launched as a dependent, lets its dependents be scheduled at
// once (as PDL-aware kernels do), spins for a while (%globaltimer, nanoseconds), then copies n
// 16-byte words from src to dst (the combine's input rows, from a pristine copy, so the combine's
// result stays checkable). NVRTC source with no includes; the kernel is extern "C"
// moejit_bench_produce. Shared by moejit-bench (--pipeline) and the GPU tests.
#pragma once

namespace moejit_bench {

constexpr const char* kProducerSource = R"(
struct alignas(16) MoejitBenchWord { unsigned x, y, z, w; };
extern "C" __global__ void moejit_bench_produce(const MoejitBenchWord* src, MoejitBenchWord* dst,
                                                unsigned long long n,
                                                unsigned long long nanoseconds) {
#if __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.wait;" ::: "memory");
  asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
#endif
  unsigned long long start, now;
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(start));
  do {
    asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(now));
  } while (now - start < nanoseconds);
  for (unsigned long long i = blockIdx.x * (unsigned long long)blockDim.x + threadIdx.x; i < n;
       i += (unsigned long long)gridDim.x * blockDim.x)
    dst[i] = src[i];
}
)";

}  // namespace moejit_bench
