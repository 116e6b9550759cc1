// Whether this process can use a CUDA GPU, and if not the one true reason, asked of the driver
// (libcuda.so.1) itself. Header-only, so that the library's driver loader (driver.cpp), the tools
// and the GPU tests, which link only the public C API, all give the same words for a missing GPU:
// the CUDA runtime would call a missing driver an "insufficient" one.
#pragma once

#include <cuda.h>
#include <dlfcn.h>

#include <string>

#include "moejit/moejit.h"

namespace moejit {

struct DriverProbe {
  void* handle = nullptr;  // libcuda.so.1, kept open; null if it could not be loaded
  moejit_status status = MOEJIT_SUCCESS;
  std::string message;  // why no GPU can be used; empty on success
  int device_count = 0;
};

// dlopen("libcuda.so.1"), cuInit(0), cuDeviceGetCount. status: MOEJIT_SUCCESS with at least one
// device; MOEJIT_ERROR_DRIVER_NOT_FOUND (no driver, or one too old to have these functions);
// MOEJIT_ERROR_NO_DEVICE; MOEJIT_ERROR_CUDA (cuInit failed otherwise). Thread-safe; cheap after
// the first call (the driver is initialized once per process).
inline DriverProbe probe_driver() {
  DriverProbe p;
  p.handle = dlopen("libcuda.so.1", RTLD_NOW | RTLD_LOCAL);
  if (p.handle == nullptr) {
    const char* why = dlerror();
    p.status = MOEJIT_ERROR_DRIVER_NOT_FOUND;
    p.message = std::string("the CUDA driver is not available: dlopen(libcuda.so.1) failed: ") +
                (why ? why : "unknown reason") +
                ". Install the NVIDIA driver to run kernels; compiling needs no driver.";
    return p;
  }
  using InitFn = CUresult (*)(unsigned int);
  using ErrorNameFn = CUresult (*)(CUresult, const char**);
  using CountFn = CUresult (*)(int*);
  const auto init = reinterpret_cast<InitFn>(dlsym(p.handle, "cuInit"));
  const auto error_name = reinterpret_cast<ErrorNameFn>(dlsym(p.handle, "cuGetErrorName"));
  const auto count = reinterpret_cast<CountFn>(dlsym(p.handle, "cuDeviceGetCount"));
  if (init == nullptr || error_name == nullptr || count == nullptr) {
    p.status = MOEJIT_ERROR_DRIVER_NOT_FOUND;
    p.message = "libcuda.so.1 was found but lacks a required function; the driver is too old";
    return p;
  }
  const char* call = "cuInit";
  CUresult result = init(0);
  if (result == CUDA_SUCCESS) {
    call = "cuDeviceGetCount";
    result = count(&p.device_count);
  }
  if (result != CUDA_SUCCESS) {
    const char* name = nullptr;
    error_name(result, &name);
    p.status = result == CUDA_ERROR_NO_DEVICE ? MOEJIT_ERROR_NO_DEVICE : MOEJIT_ERROR_CUDA;
    p.message = std::string(call) + " failed: " + (name ? name : "unknown CUresult") +
                (result == CUDA_ERROR_NO_DEVICE ? " (no CUDA-capable GPU was found)" : "");
    return p;
  }
  if (p.device_count == 0) {
    p.status = MOEJIT_ERROR_NO_DEVICE;
    p.message = "no CUDA-capable GPU was found (the driver reports 0 devices)";
  }
  return p;
}

}  // namespace moejit
