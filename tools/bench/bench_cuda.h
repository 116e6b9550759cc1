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
// Flushed runs alternate on the H200 when the kernels launched per run (separator plus the timed
// work) are odd in number: every other run then takes 0.6-0.7 us longer (empty kernel 3.36 / 4.08
// us, a 1 MB copy 4.90 / 5.60), whatever the flush writes, and the median falls between the two
// modes. With an even count the runs are alike (3.58, 5.09) and the spread a third as wide
// (tools/bench/NOTES.md, version 38). How many kernels the timed work launches is not always known
// (a copy, a library call), so before its timed runs each flushed measurement tries the separator
// as it is and with one empty kernel added, a few runs each, and keeps the one whose odd and even
// runs differ less.
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

  // Off: the flush alone separates flushed runs (the method before the padding, for comparison).
  void set_flush_padding(bool on) { flush_padding_ = on; }
  bool flush_padding() const { return flush_padding_; }
  // Of the last median_us: median of its odd runs minus median of its even runs, and the empty
  // kernels added after each flush (0 or 1).
  double last_parity_split_us() const { return last_parity_split_us_; }
  int last_padding() const { return last_padding_; }

  cudaStream_t stream() const { return stream_; }

 private:
  void separate(CacheState state, int run, int padding);
  // us of each of `reps` runs, in order.
  std::vector<double> time_runs(const std::function<void()>& enqueue, int reps, CacheState state,
                                int padding);

  cudaStream_t stream_;
  Spin spin_;
  DeviceBuffer flush_;
  std::vector<cudaEvent_t> starts_, stops_;
  bool flush_padding_ = true;
  double last_parity_split_us_ = 0.0;
  int last_padding_ = 0;
};

// Median of the odd-numbered values minus median of the even-numbered ones (0 for fewer than 4).
double parity_split(const std::vector<double>& values);

double median(std::vector<double> values);

}  // namespace moejit_bench
