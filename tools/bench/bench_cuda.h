// CUDA runtime plumbing for moejit-bench: checked calls, owned device buffers, and the one timing
// method every figure of the tool uses (events around each run, warm-up, median; L2 flushed, or
// kept warm, between runs). The library itself never uses the runtime API; the bench does, for
// allocations, copies and events, through the static cudart.
#pragma once

#include <cuda_runtime.h>

#include <cstddef>
#include <functional>
#include <stdexcept>
#include <string>
#include <vector>

namespace moejit_bench {

// Throws CudaError("<call> failed: cudaErrorX (text)") unless status is cudaSuccess.
struct CudaError : std::runtime_error {
  using std::runtime_error::runtime_error;
};
void check(cudaError_t status, const char* call);
#define BENCH_CUDA(call) ::moejit_bench::check((call), #call)

// Device memory, freed on destruction. Move-only.
class DeviceBuffer {
 public:
  DeviceBuffer() = default;
  explicit DeviceBuffer(size_t bytes);
  ~DeviceBuffer();
  DeviceBuffer(DeviceBuffer&& other) noexcept;
  DeviceBuffer& operator=(DeviceBuffer&& other) noexcept;
  DeviceBuffer(const DeviceBuffer&) = delete;
  DeviceBuffer& operator=(const DeviceBuffer&) = delete;

  void* get() const { return ptr_; }
  size_t bytes() const { return bytes_; }
  void upload(const void* host, size_t bytes);    // synchronous
  void download(void* host, size_t bytes) const;  // synchronous

 private:
  void* ptr_ = nullptr;
  size_t bytes_ = 0;
};

// How repeated runs are separated.
enum class CacheState {
  kFlushed,  // a 256 MB cudaMemsetAsync before each run: inputs come from HBM (pessimistic)
  kWarm,     // a GPU-side spin before each run: inputs stay in L2 if they fit (like serving, where
             // the expert GEMM has just written them)
};

// Times enqueue() on one stream. Each timed run is bracketed by its own pair of events; what
// separates runs (the flush, the spin) is enqueued before the start event, outside the interval.
// Both separators keep the GPU busy long enough that the host enqueues the next run before the GPU
// reaches it, so host launch overhead does not leak into the interval as idle GPU time.
//
// Flushed runs alternate on the H200: every other run takes 0.6-0.75 us longer, whatever the flush
// writes, so at decode sizes the median falls in a two-mode distribution and moves by 0.1-0.3 us
// between measurements of the same kernel (tools/bench/NOTES.md, version 38). Each measurement
// reports how far its odd runs land from its even ones (last_parity_split_us); comparisons that
// must resolve less than that run their contenders interleaved (tools/bench/peers.py, paired).
// An empty kernel after the flush stopped the alternation in peers.py's torch harness for most
// one-kernel runs but not here, nor for multi-kernel runs: the median stays the method.
class Timer {
 public:
  // spin(stream, microseconds) enqueues a kernel that keeps the GPU busy and touches no memory.
  using Spin = std::function<void(cudaStream_t, double)>;
  Timer(cudaStream_t stream, Spin spin);
  ~Timer();
  Timer(const Timer&) = delete;
  Timer& operator=(const Timer&) = delete;

  // Median microseconds of `reps` runs after `warmup` untimed ones. enqueue() must only enqueue
  // work on the stream (and may throw).
  double median_us(const std::function<void()>& enqueue, int warmup, int reps, CacheState state);

  // Of the last median_us: median of its odd runs minus median of its even runs.
  double last_parity_split_us() const { return last_parity_split_us_; }

  cudaStream_t stream() const { return stream_; }

 private:
  void separate(CacheState state, int run);

  cudaStream_t stream_;
  Spin spin_;
  DeviceBuffer flush_;
  std::vector<cudaEvent_t> starts_, stops_;
  double last_parity_split_us_ = 0.0;
};

// Median of the odd-numbered values minus median of the even-numbered ones (0 for fewer than 4).
double parity_split(const std::vector<double>& values);

double median(std::vector<double> values);

}  // namespace moejit_bench
