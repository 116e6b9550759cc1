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
  CUresult (*cuStreamGetCtx)(CUstream, CUcontext*);  // may be null; only a failed launch asks
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

// The loaded driver, initialized (cuInit) once through probe_driver() (driver_probe.h), whose
// message it throws: Error(MOEJIT_ERROR_DRIVER_NOT_FOUND) if libcuda.so.1 cannot be loaded or lacks
// a function, Error(MOEJIT_ERROR_NO_DEVICE) if there is no device. Thread-safe; the result is
// cached (including failure).
const DriverApi& driver();

// Launches f on a grid_x x grid_y grid of `threads`-thread blocks as a programmatic dependent of
// the stream's previous kernel (cuLaunchKernelEx with programmatic stream serialization): its
// blocks may start while that kernel drains, so f must wait (griddepcontrol.wait) before it
// touches memory. d.cuLaunchKernelEx must be non-null (driver 12.0+).
CUresult launch_programmatic(const DriverApi& d, CUfunction f, unsigned grid_x, unsigned grid_y,
                             unsigned threads, CUstream stream, void** args);

// cuLaunchKernelEx with the attributes asked for: a programmatic dependent (as above) and/or
// thread-block clusters of cluster_x blocks along x (0: none; sm_90+, grid_x a multiple of it).
// d.cuLaunchKernelEx must be non-null.
CUresult launch_with_attributes(const DriverApi& d, CUfunction f, unsigned grid_x, unsigned grid_y,
                                unsigned threads, CUstream stream, void** args, bool programmatic,
                                unsigned cluster_x);

// After a launch on `stream` failed with `result`: the caller's stream may belong to another
// context than the calling thread's current one, whose modules the launch used (the driver then
// says only CUDA_ERROR_INVALID_HANDLE). If so, throws Error(MOEJIT_ERROR_INVALID_ARGUMENT) naming
// the stream, both devices and the fix; otherwise throws Error(MOEJIT_ERROR_CUDA) with the
// driver's result for `call`. Never returns.
[[noreturn]] void throw_launch_failure(const DriverApi& d, CUstream stream, CUresult result,
                                       const std::string& call);

// "cuLaunchKernel failed: CUDA_ERROR_INVALID_VALUE (invalid argument)"
std::string describe_cuda_error(const char* call, CUresult result);

// Throws Error(MOEJIT_ERROR_CUDA, describe_cuda_error(call, result)) unless result is success.
void check_cuda(CUresult result, const char* call);

}  // namespace moejit
