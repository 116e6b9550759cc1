// libmoejit from C++, built with find_package(moejit CONFIG): the gather-map layout.
//
// A decode-sized step of a top-2 MoE: 33 tokens, hidden size 4096, bf16. The expert outputs sit in
// an expert-sorted buffer; gather_map[t][k] says which row holds slot k of token t (-1: dropped by
// capacity). The result is scaled by a routed scaling factor and checked against a CPU reference.
//
// Exit status: 0 PASS, 1 FAIL, 77 SKIP (no CUDA GPU on this machine).
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <memory>
#include <numeric>
#include <random>
#include <stdexcept>
#include <string>
#include <vector>

#include <cuda_runtime_api.h>
#include <moejit/moejit.h>

namespace {

constexpr int kTokens = 33, kTopK = 2, kHidden = 4096, kRows = kTokens * kTopK;
constexpr float kScale = 2.5f;  // e.g. DeepSeek-V3's routed_scaling_factor
constexpr int kExitSkip = 77;

// bf16 is the top half of an fp32; encode with round-to-nearest-even (inputs here are finite).
uint16_t to_bf16(float f) {
  uint32_t bits;
  std::memcpy(&bits, &f, sizeof(bits));
  bits += 0x7FFFu + ((bits >> 16) & 1u);
  return static_cast<uint16_t>(bits >> 16);
}

float from_bf16(uint16_t h) {
  const uint32_t bits = static_cast<uint32_t>(h) << 16;
  float f;
  std::memcpy(&f, &bits, sizeof(f));
  return f;
}

void check_cuda(cudaError_t err, const char* what) {
  if (err != cudaSuccess)
    throw std::runtime_error(std::string(what) + ": " + cudaGetErrorString(err));
}

// Device memory owned by a unique_ptr, so every early exit frees it.
struct CudaFree {
  void operator()(void* p) const { cudaFree(p); }
};
using DeviceBuffer = std::unique_ptr<void, CudaFree>;

template <typename T>
DeviceBuffer upload(const std::vector<T>& host) {
  void* p = nullptr;
  check_cuda(cudaMalloc(&p, host.size() * sizeof(T)), "cudaMalloc");
  DeviceBuffer buffer(p);
  check_cuda(cudaMemcpy(p, host.data(), host.size() * sizeof(T), cudaMemcpyHostToDevice),
             "cudaMemcpy");
  return buffer;
}

int run() {
  std::mt19937 rng(2024);
  std::uniform_real_distribution<float> value(-2.f, 2.f), weight(0.f, 1.f);

  // Expert-sorted rows: row perm[t*K + k] holds slot k of token t; one slot in ten is dropped.
  std::vector<uint16_t> hidden(static_cast<size_t>(kRows) * kHidden);
  for (auto& x : hidden) x = to_bf16(value(rng));
  std::vector<int32_t> perm(kRows);
  std::iota(perm.begin(), perm.end(), 0);
  std::shuffle(perm.begin(), perm.end(), rng);
  std::vector<int32_t> gather_map(kRows);
  std::vector<float> gates(kRows);
  for (int i = 0; i < kRows; ++i) {
    gather_map[i] = (rng() % 10 == 0) ? -1 : perm[i];
    gates[i] = weight(rng);
  }

  cudaStream_t stream = nullptr;
  check_cuda(cudaStreamCreate(&stream), "cudaStreamCreate");
  std::unique_ptr<CUstream_st, decltype(&cudaStreamDestroy)> stream_owner(stream,
                                                                          cudaStreamDestroy);
  DeviceBuffer d_hidden = upload(hidden), d_map = upload(gather_map), d_gates = upload(gates);
  // Poisoned (bf16 0xFFFF is a NaN) so an element the kernel does not write cannot pass.
  DeviceBuffer d_out =
      upload(std::vector<uint16_t>(static_cast<size_t>(kTokens) * kHidden, 0xFFFF));

  moejit_combine_args args = MOEJIT_COMBINE_ARGS_INIT;
  args.layout = MOEJIT_LAYOUT_GATHER_MAP;
  args.num_tokens = kTokens;
  args.top_k = kTopK;
  args.num_rows = kRows;
  args.hidden_dim = kHidden;
  args.expert_hidden = d_hidden.get();
  args.expert_dtype = MOEJIT_DTYPE_BFLOAT16;
  args.gates = static_cast<const float*>(d_gates.get());
  args.indices = d_map.get();
  args.index_type = MOEJIT_INDEX_INT32;
  args.out = d_out.get();
  args.out_dtype = MOEJIT_DTYPE_BFLOAT16;
  args.scale = kScale;

  const moejit_status st = moe_combine(&args, stream);
  if (st != MOEJIT_SUCCESS) {
    std::fprintf(stderr, "FAIL: moe_combine: %s: %s\n", moejit_status_name(st),
                 moejit_last_error_message());
    return 1;
  }
  check_cuda(cudaStreamSynchronize(stream), "cudaStreamSynchronize");
  std::vector<uint16_t> out(static_cast<size_t>(kTokens) * kHidden);
  check_cuda(
      cudaMemcpy(out.data(), d_out.get(), out.size() * sizeof(uint16_t), cudaMemcpyDeviceToHost),
      "cudaMemcpy");

  // CPU reference in double. The library sums in fp32 and rounds to bf16 once: allow one bf16
  // rounding (2^-8 relative, doubled for margin) plus fp32 summation error.
  int bad = 0;
  double worst = 0;
  for (int t = 0; t < kTokens; ++t) {
    for (int h = 0; h < kHidden; ++h) {
      double ref = 0;
      for (int k = 0; k < kTopK; ++k) {
        const int32_t row = gather_map[t * kTopK + k];
        if (row >= 0)
          ref += double(gates[t * kTopK + k]) * from_bf16(hidden[size_t(row) * kHidden + h]);
      }
      ref *= kScale;
      const double got = from_bf16(out[size_t(t) * kHidden + h]);
      const double err = std::fabs(got - ref);
      if (!(err <= std::fabs(ref) / 128 + 1e-3) && bad++ < 5)
        std::fprintf(stderr, "mismatch out[%d][%d] = %g, expected %g\n", t, h, got, ref);
      worst = std::max(worst, err);
    }
  }

  moejit_stats stats{};
  stats.struct_size = sizeof(stats);
  const moejit_status stats_status = moejit_runtime_get_stats(nullptr, &stats);
  if (stats_status != MOEJIT_SUCCESS) {
    std::fprintf(stderr, "FAIL: moejit_runtime_get_stats: %s: %s\n",
                 moejit_status_name(stats_status), moejit_last_error_message());
    return 1;
  }
  std::printf(
      "%s: gather-map combine, T=%d K=%d H=%d bf16, scale %.1f, max abs error %.3g "
      "(libmoejit %s; %llu compiles, %llu disk hits)\n",
      bad ? "FAIL" : "PASS", kTokens, kTopK, kHidden, double(kScale), worst,
      moejit_version_string(), static_cast<unsigned long long>(stats.compiles),
      static_cast<unsigned long long>(stats.disk_hits));
  return bad ? 1 : 0;
}

}  // namespace

int main() {
  int devices = 0;
  const cudaError_t probe = cudaGetDeviceCount(&devices);
  if (probe != cudaSuccess || devices == 0) {
    // With no NVIDIA driver installed at all, the runtime reports an insufficient driver.
    std::printf("SKIP: no CUDA GPU found (%s); libmoejit %s linked fine\n",
                probe == cudaErrorInsufficientDriver ? "no NVIDIA driver, or one too old"
                : probe != cudaSuccess               ? cudaGetErrorString(probe)
                                                     : "0 devices",
                moejit_version_string());
    return kExitSkip;
  }
  try {
    return run();
  } catch (const std::exception& e) {
    std::fprintf(stderr, "FAIL: %s\n", e.what());
    return 1;
  }
}
