#include "bench_cuda.h"

#include <algorithm>
#include <utility>

namespace moejit_bench {
namespace {

// Larger than the H200's 50 MB L2 several times over, so nothing of the previous run survives.
constexpr size_t kFlushBytes = 256u << 20;
// Longer than the host needs to enqueue one run (two event records, the launches, the next spin).
constexpr double kSpinMicroseconds = 20.0;

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
  if (bytes == 0) return;  // an empty input (token-index-only cases have no token-major rows)
  BENCH_CUDA(cudaMemcpy(ptr_, host, bytes, cudaMemcpyHostToDevice));
  // Complete on return: from pageable memory cudaMemcpy may return before its DMA ends, on the
  // legacy stream, which the benchmark's non-blocking stream does not wait for.
  BENCH_CUDA(cudaDeviceSynchronize());
}

void DeviceBuffer::download(void* host, size_t bytes) const {
  if (bytes > bytes_) throw CudaError("download larger than the buffer");
  if (bytes == 0) return;
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

void Timer::separate(CacheState state, int run) {
  if (state == CacheState::kFlushed) {
    // A different byte each run, so no layer can skip a write of unchanged data.
    BENCH_CUDA(cudaMemsetAsync(flush_.get(), run & 0xff, flush_.bytes(), stream_));
  } else {
    spin_(stream_, kSpinMicroseconds);
  }
}

double Timer::median_us(const std::function<void()>& enqueue, int warmup, int reps,
                        CacheState state) {
  while (starts_.size() < static_cast<size_t>(reps)) {
    cudaEvent_t a = nullptr, b = nullptr;
    BENCH_CUDA(cudaEventCreate(&a));
    starts_.push_back(a);
    BENCH_CUDA(cudaEventCreate(&b));
    stops_.push_back(b);
  }
  for (int i = 0; i < warmup; ++i) {
    separate(state, i);
    enqueue();
  }
  BENCH_CUDA(cudaStreamSynchronize(stream_));
  // Everything is enqueued first and read once at the end: no host synchronization between runs
  // that could let the GPU drain and start a run cold on the launch path.
  for (int i = 0; i < reps; ++i) {
    separate(state, i);
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
  last_parity_split_us_ = parity_split(us);
  return median(std::move(us));
}

double parity_split(const std::vector<double>& values) {
  if (values.size() < 4) return 0.0;
  std::vector<double> even, odd;
  for (size_t i = 0; i < values.size(); ++i) (i % 2 == 0 ? even : odd).push_back(values[i]);
  return median(std::move(odd)) - median(std::move(even));
}

}  // namespace moejit_bench
