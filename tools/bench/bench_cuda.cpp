#include "bench_cuda.h"

#include <algorithm>
#include <cmath>
#include <utility>

namespace moejit_bench {
namespace {

// Larger than the H200's 50 MB L2 several times over, so nothing of the previous run survives.
constexpr size_t kFlushBytes = 256u << 20;
// Longer than the host needs to enqueue one run (two event records, the launches, the next spin).
constexpr double kSpinMicroseconds = 20.0;
// Runs per separator tried before a flushed measurement (Timer): enough that an alternation of
// 0.6 us stands out of the spread of decode-sized runs (0.1-0.3 us between medians of 12).
constexpr int kPaddingTrialRuns = 32;

}  // namespace

void check(cudaError_t status, const char* call) {
  if (status != cudaSuccess)
    throw CudaError(std::string(call) + " failed: " + cudaGetErrorName(status) + " (" +
                    cudaGetErrorString(status) + ")");
}

DeviceBuffer::DeviceBuffer(size_t bytes) : bytes_(bytes) {
  if (bytes > 0) BENCH_CUDA(cudaMalloc(&ptr_, bytes));
}

DeviceBuffer::~DeviceBuffer() {
  if (ptr_ != nullptr) cudaFree(ptr_);  // errors ignored: destructors run during unwinding too
}

DeviceBuffer::DeviceBuffer(DeviceBuffer&& other) noexcept
    : ptr_(std::exchange(other.ptr_, nullptr)), bytes_(std::exchange(other.bytes_, 0)) {}

DeviceBuffer& DeviceBuffer::operator=(DeviceBuffer&& other) noexcept {
  if (this != &other) {
    if (ptr_ != nullptr) cudaFree(ptr_);
    ptr_ = std::exchange(other.ptr_, nullptr);
    bytes_ = std::exchange(other.bytes_, 0);
  }
  return *this;
}

void DeviceBuffer::upload(const void* host, size_t bytes) {
  if (bytes > bytes_) throw CudaError("upload larger than the buffer");
  BENCH_CUDA(cudaMemcpy(ptr_, host, bytes, cudaMemcpyHostToDevice));
}

void DeviceBuffer::download(void* host, size_t bytes) const {
  if (bytes > bytes_) throw CudaError("download larger than the buffer");
  BENCH_CUDA(cudaMemcpy(host, ptr_, bytes, cudaMemcpyDeviceToHost));
}

double median(std::vector<double> values) {
  if (values.empty()) return 0.0;
  const size_t mid = values.size() / 2;
  std::nth_element(values.begin(), values.begin() + static_cast<std::ptrdiff_t>(mid), values.end());
  double m = values[mid];
  if (values.size() % 2 == 0) {
    const double below =
        *std::max_element(values.begin(), values.begin() + static_cast<std::ptrdiff_t>(mid));
    m = 0.5 * (m + below);
  }
  return m;
}

Timer::Timer(cudaStream_t stream, Spin spin)
    : stream_(stream), spin_(std::move(spin)), flush_(kFlushBytes) {}

Timer::~Timer() {
  for (cudaEvent_t e : starts_) cudaEventDestroy(e);
  for (cudaEvent_t e : stops_) cudaEventDestroy(e);
}

void Timer::separate(CacheState state, int run, int padding) {
  if (state == CacheState::kFlushed) {
    // A different byte each run, so no layer can skip a write of unchanged data.
    BENCH_CUDA(cudaMemsetAsync(flush_.get(), run & 0xff, flush_.bytes(), stream_));
    for (int i = 0; i < padding; ++i) spin_(stream_, 0.0);  // an empty kernel (Timer)
  } else {
    spin_(stream_, kSpinMicroseconds);
  }
}

std::vector<double> Timer::time_runs(const std::function<void()>& enqueue, int reps,
                                     CacheState state, int padding) {
  while (starts_.size() < static_cast<size_t>(reps)) {
    cudaEvent_t a = nullptr, b = nullptr;
    BENCH_CUDA(cudaEventCreate(&a));
    starts_.push_back(a);
    BENCH_CUDA(cudaEventCreate(&b));
    stops_.push_back(b);
  }
  // Everything is enqueued first and read once at the end: no host synchronization between runs
  // that could let the GPU drain and start a run cold on the launch path.
  for (int i = 0; i < reps; ++i) {
    separate(state, i, padding);
    BENCH_CUDA(cudaEventRecord(starts_[static_cast<size_t>(i)], stream_));
    enqueue();
    BENCH_CUDA(cudaEventRecord(stops_[static_cast<size_t>(i)], stream_));
  }
  BENCH_CUDA(cudaStreamSynchronize(stream_));
  BENCH_CUDA(cudaGetLastError());
  std::vector<double> us(static_cast<size_t>(reps));
  for (int i = 0; i < reps; ++i) {
    float ms = 0.0f;
    BENCH_CUDA(
        cudaEventElapsedTime(&ms, starts_[static_cast<size_t>(i)], stops_[static_cast<size_t>(i)]));
    us[static_cast<size_t>(i)] = static_cast<double>(ms) * 1e3;
  }
  return us;
}

double Timer::median_us(const std::function<void()>& enqueue, int warmup, int reps,
                        CacheState state) {
  for (int i = 0; i < warmup; ++i) {
    separate(state, i, 0);
    enqueue();
  }
  BENCH_CUDA(cudaStreamSynchronize(stream_));
  int padding = 0;
  if (state == CacheState::kFlushed && flush_padding_) {
    // The separator whose odd and even runs differ less (see the class comment).
    const double as_is = std::abs(parity_split(time_runs(enqueue, kPaddingTrialRuns, state, 0)));
    const double padded = std::abs(parity_split(time_runs(enqueue, kPaddingTrialRuns, state, 1)));
    padding = padded < as_is ? 1 : 0;
  }
  const std::vector<double> us = time_runs(enqueue, reps, state, padding);
  last_parity_split_us_ = parity_split(us);
  last_padding_ = padding;
  return median(us);
}

double parity_split(const std::vector<double>& values) {
  if (values.size() < 4) return 0.0;
  std::vector<double> even, odd;
  for (size_t i = 0; i < values.size(); ++i) (i % 2 == 0 ? even : odd).push_back(values[i]);
  return median(std::move(odd)) - median(std::move(even));
}

}  // namespace moejit_bench
