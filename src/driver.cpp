#include "driver.h"

#include <dlfcn.h>

#include <memory>
#include <mutex>

#include "error.h"
#include "logging.h"

namespace moejit {
namespace {

struct LoadedDriver {
  DriverApi api{};
  moejit_status status = MOEJIT_SUCCESS;
  std::string message;
};

template <typename F>
bool resolve(void* handle, const char* name, F* fn) {
  *fn = reinterpret_cast<F>(dlsym(handle, name));
  return *fn != nullptr;
}

LoadedDriver load() {
  LoadedDriver d;
  // Kept open for the life of the process: modules and functions point into it.
  void* handle = dlopen("libcuda.so.1", RTLD_NOW | RTLD_LOCAL);
  if (handle == nullptr) {
    const char* why = dlerror();
    d.status = MOEJIT_ERROR_DRIVER_NOT_FOUND;
    d.message = std::string("the CUDA driver is not available: dlopen(libcuda.so.1) failed: ") +
                (why ? why : "unknown reason") +
                ". Install the NVIDIA driver to run kernels; compiling needs no driver.";
    return d;
  }
  DriverApi& a = d.api;
  bool ok = resolve(handle, "cuInit", &a.cuInit) &&
            resolve(handle, "cuDriverGetVersion", &a.cuDriverGetVersion) &&
            resolve(handle, "cuGetErrorName", &a.cuGetErrorName) &&
            resolve(handle, "cuGetErrorString", &a.cuGetErrorString) &&
            resolve(handle, "cuCtxGetCurrent", &a.cuCtxGetCurrent) &&
            resolve(handle, "cuCtxGetDevice", &a.cuCtxGetDevice) &&
            resolve(handle, "cuCtxPushCurrent_v2", &a.cuCtxPushCurrent) &&
            resolve(handle, "cuCtxPopCurrent_v2", &a.cuCtxPopCurrent) &&
            resolve(handle, "cuDeviceGetCount", &a.cuDeviceGetCount) &&
            resolve(handle, "cuDeviceGet", &a.cuDeviceGet) &&
            resolve(handle, "cuDeviceGetAttribute", &a.cuDeviceGetAttribute) &&
            resolve(handle, "cuModuleLoadData", &a.cuModuleLoadData) &&
            resolve(handle, "cuModuleUnload", &a.cuModuleUnload) &&
            resolve(handle, "cuModuleGetFunction", &a.cuModuleGetFunction) &&
            resolve(handle, "cuLaunchKernel", &a.cuLaunchKernel);
  if (!ok) {
    d.status = MOEJIT_ERROR_DRIVER_NOT_FOUND;
    d.message = "libcuda.so.1 was found but lacks a required function; the driver is too old";
    return d;
  }
  resolve(handle, "cuCtxGetId", &a.cuCtxGetId);              // optional: CUDA 12.0+
  resolve(handle, "cuLaunchKernelEx", &a.cuLaunchKernelEx);  // optional: CUDA 12.0+
  const CUresult init = a.cuInit(0);
  if (init != CUDA_SUCCESS) {
    const char* name = nullptr;
    a.cuGetErrorName(init, &name);
    d.status = init == CUDA_ERROR_NO_DEVICE ? MOEJIT_ERROR_NO_DEVICE : MOEJIT_ERROR_CUDA;
    d.message = std::string("cuInit failed: ") + (name ? name : "unknown CUresult") +
                (init == CUDA_ERROR_NO_DEVICE ? " (no CUDA-capable GPU was found)" : "");
    return d;
  }
  int version = 0;
  a.cuDriverGetVersion(&version);
  logger().debug("loaded libcuda.so.1, driver API version {}", version);
  return d;
}

}  // namespace

const DriverApi& driver() {
  // Thread-safe initialization (C++11), and never destroyed: the host's static destructors may
  // still call the library at exit, and the error message must outlive them.
  static const LoadedDriver& loaded = *new LoadedDriver(load());
  if (loaded.status != MOEJIT_SUCCESS) throw Error(loaded.status, loaded.message);
  return loaded.api;
}

CUresult launch_programmatic(const DriverApi& d, CUfunction f, unsigned grid_x, unsigned grid_y,
                             unsigned threads, CUstream stream, void** args) {
  CUlaunchAttribute attr{};
  attr.id = CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION;
  attr.value.programmaticStreamSerializationAllowed = 1;
  CUlaunchConfig config{};
  config.gridDimX = grid_x;
  config.gridDimY = grid_y;
  config.gridDimZ = 1;
  config.blockDimX = threads;
  config.blockDimY = 1;
  config.blockDimZ = 1;
  config.hStream = stream;
  config.attrs = &attr;
  config.numAttrs = 1;
  return d.cuLaunchKernelEx(&config, f, args, nullptr);
}

std::string describe_cuda_error(const char* call, CUresult result) {
  const char* name = nullptr;
  const char* text = nullptr;
  const DriverApi& a = driver();
  a.cuGetErrorName(result, &name);
  a.cuGetErrorString(result, &text);
  return std::string(call) + " failed: " + (name ? name : "CUresult " + std::to_string(result)) +
         " (" + (text ? text : "no description") + ")";
}

void check_cuda(CUresult result, const char* call) {
  if (result != CUDA_SUCCESS) throw Error(MOEJIT_ERROR_CUDA, describe_cuda_error(call, result));
}

}  // namespace moejit
