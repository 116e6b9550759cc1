// The bench's own kernels, compiled through the library's NVRTC path (src/nvrtc_compiler.h) and
// launched with the library's driver table, exactly as libmoejit builds and launches a combine:
//   empty  the floor of any launch, timed like the combine ("ratio to an empty kernel");
//   spin   keeps the GPU busy for a while without touching memory (separates L2-warm runs);
//   produce  the kernel before the combine in a decode step (--pipeline): allows its dependents
//          at once, spins, then copies the combine's input rows into place.
//   sweep  reads a buffer larger than L2 (--pipeline, routing evicted): what the expert GEMMs'
//          weight stream does to the router's output before the combine.
#pragma once

#include <cuda.h>

#include <cstddef>
#include <string>

#include "moejit_internal.h"

namespace moejit_bench {

class HelperKernels {
 public:
  // Compiles for `target`; loads into the current context only if load is true (no GPU: false).
  HelperKernels(const moejit::Target& target, bool load);
  ~HelperKernels();
  HelperKernels(const HelperKernels&) = delete;
  HelperKernels& operator=(const HelperKernels&) = delete;

  void launch_empty(CUstream stream) const;
  void launch_spin(CUstream stream, double microseconds) const;
  // As a programmatic dependent of the stream's previous kernel if `dependent`, else a plain
  // launch.
  void launch_empty_ex(CUstream stream, bool dependent) const;
  void launch_produce(CUstream stream, const void* src, void* dst, size_t bytes,
                      double microseconds, bool dependent) const;
  // A plain launch reading `bytes` of src (16-byte aligned); sink is written only if the bytes
  // XOR to a value no bench input has.
  void launch_sweep(CUstream stream, const void* src, size_t bytes, void* sink) const;

  double compile_ms() const { return compile_ms_; }
  size_t image_bytes() const { return image_.size(); }

 private:
  std::string image_;
  double compile_ms_ = 0.0;
  CUmodule module_ = nullptr;
  CUfunction empty_ = nullptr;
  CUfunction spin_ = nullptr;
  CUfunction produce_ = nullptr;
  CUfunction sweep_ = nullptr;
};

}  // namespace moejit_bench
