// The CUDA Driver API, loaded with dlopen("libcuda.so.1") on first use: the library has no
// link-time dependency on the driver, so it loads (and compiles kernels) on machines without one.
// Types come from the toolkit's cuda.h; no function of it is linked.
#pragma once

#include <cuda.h>

#include <string>

namespace moejit {

struct DriverApi {
  CUresult (*cuInit)(unsigned int);
  CUresult (*cuDriverGetVersion)(int*);
  CUresult (*cuGetErrorName)(CUresult, const char**);
  CUresult (*cuGetErrorString)(CUresult, const char**);
  CUresult (*cuCtxGetCurrent)(CUcontext*);
  CUresult (*cuCtxGetDevice)(CUdevice*);
  CUresult (*cuCtxGetId)(CUcontext, unsigned long long*);  // may be null (driver < 12.0)
  CUresult (*cuCtxPushCurrent)(CUcontext);
  CUresult (*cuCtxPopCurrent)(CUcontext*);
  // Device enumeration: tools (moejit-precompile) ask which GPU is present without a context.
  CUresult (*cuDeviceGetCount)(int*);
  CUresult (*cuDeviceGet)(CUdevice*, int);
  CUresult (*cuDeviceGetAttribute)(int*, CUdevice_attribute, CUdevice);
  CUresult (*cuModuleLoadData)(CUmodule*, const void*);
  CUresult (*cuModuleUnload)(CUmodule);
  CUresult (*cuModuleGetFunction)(CUfunction*, CUmodule, const char*);
  CUresult (*cuLaunchKernel)(CUfunction, unsigned, unsigned, unsigned, unsigned, unsigned, unsigned,
                             unsigned, CUstream, void**, void**);
  // Launch with attributes (programmatic dependent launch); may be null (driver < 12.0).
  CUresult (*cuLaunchKernelEx)(const CUlaunchConfig*, CUfunction, void**, void**);
};

// The loaded driver, initialized (cuInit) once. Throws Error(MOEJIT_ERROR_DRIVER_NOT_FOUND) if
// libcuda.so.1 cannot be loaded or lacks a function, Error(MOEJIT_ERROR_NO_DEVICE) if cuInit
// reports no device. Thread-safe; the result is cached (including failure).
const DriverApi& driver();

// Launches f on a grid_x x grid_y grid of `threads`-thread blocks as a programmatic dependent of
// the stream's previous kernel (cuLaunchKernelEx with programmatic stream serialization): its
// blocks may start while that kernel drains, so f must wait (griddepcontrol.wait) before it
// touches memory. d.cuLaunchKernelEx must be non-null (driver 12.0+).
CUresult launch_programmatic(const DriverApi& d, CUfunction f, unsigned grid_x, unsigned grid_y,
                             unsigned threads, CUstream stream, void** args);

// "cuLaunchKernel failed: CUDA_ERROR_INVALID_VALUE (invalid argument)"
std::string describe_cuda_error(const char* call, CUresult result);

// Throws Error(MOEJIT_ERROR_CUDA, describe_cuda_error(call, result)) unless result is success.
void check_cuda(CUresult result, const char* call);

}  // namespace moejit
