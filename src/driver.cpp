#include "driver.h"

#include <dlfcn.h>

#include <atomic>
#include <memory>
#include <mutex>

#include "driver_probe.h"
#include "error.h"
#include "fork_guard.h"
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
  // The same probe the tools and the GPU tests ask, so all of them explain a missing GPU alike.
  // Its handle is kept open for the life of the process: modules and functions point into it.
  DriverProbe probe = probe_driver();
  if (probe.status != MOEJIT_SUCCESS) {
    d.status = probe.status;
    d.message = probe.message;
    return d;
  }
  void* handle = probe.handle;
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
  resolve(handle, "cuStreamGetCtx", &a.cuStreamGetCtx);      // optional: CUDA 9.2+
  int version = 0;
  a.cuDriverGetVersion(&version);
  logger().debug("loaded libcuda.so.1, driver API version {}", version);
  return d;
}

}  // namespace

const DriverApi& driver() {
  // Thread-safe initialization (C++11), and never destroyed: the host's static destructors may
  // still call the library at exit, and the error message must outlive them. The first load runs
  // inside the fork gate, so that no fork copies its half-done initialization (fork_guard.h).
  static std::atomic<const LoadedDriver*> ready{nullptr};
  const LoadedDriver* d = ready.load(std::memory_order_acquire);
  if (d == nullptr) {
    ForkGateScope gate;
    static const LoadedDriver& loaded = *new LoadedDriver(load());
    d = &loaded;
    ready.store(d, std::memory_order_release);
  }
  if (d->status != MOEJIT_SUCCESS) throw Error(d->status, d->message);
  return d->api;
}

CUresult launch_programmatic(const DriverApi& d, CUfunction f, unsigned grid_x, unsigned grid_y,
                             unsigned threads, CUstream stream, void** args) {
  return launch_with_attributes(d, f, grid_x, grid_y, threads, stream, args, true, 0);
}

CUresult launch_with_attributes(const DriverApi& d, CUfunction f, unsigned grid_x, unsigned grid_y,
                                unsigned threads, CUstream stream, void** args, bool programmatic,
                                unsigned cluster_x) {
  CUlaunchAttribute attrs[2] = {};
  unsigned count = 0;
  if (programmatic) {
    attrs[count].id = CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION;
    attrs[count++].value.programmaticStreamSerializationAllowed = 1;
  }
  if (cluster_x > 0) {
    attrs[count].id = CU_LAUNCH_ATTRIBUTE_CLUSTER_DIMENSION;
    attrs[count].value.clusterDim.x = cluster_x;
    attrs[count].value.clusterDim.y = 1;
    attrs[count++].value.clusterDim.z = 1;
  }
  CUlaunchConfig config{};
  config.gridDimX = grid_x;
  config.gridDimY = grid_y;
  config.gridDimZ = 1;
  config.blockDimX = threads;
  config.blockDimY = 1;
  config.blockDimZ = 1;
  config.hStream = stream;
  config.attrs = attrs;
  config.numAttrs = count;
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

namespace {

// The ordinal of ctx's device, or -1 if the driver cannot say (ctx destroyed, say).
int device_of(const DriverApi& d, CUcontext ctx) {
  if (d.cuCtxPushCurrent(ctx) != CUDA_SUCCESS) return -1;
  CUdevice device = -1;
  if (d.cuCtxGetDevice(&device) != CUDA_SUCCESS) device = -1;
  CUcontext popped = nullptr;
  d.cuCtxPopCurrent(&popped);
  return static_cast<int>(device);
}

std::string device_text(int device) {
  return device >= 0 ? "device " + std::to_string(device) : "an unknown device";
}

}  // namespace

void throw_launch_failure(const DriverApi& d, CUstream stream, CUresult result,
                          const std::string& call) {
  const std::string driver_said = describe_cuda_error(call.c_str(), result);
  // The legacy and per-thread default streams (NULL, CU_STREAM_LEGACY, CU_STREAM_PER_THREAD) are
  // always the current context's. Asked only here, so a warm call pays nothing for the check.
  const bool special =
      stream == nullptr || stream == CU_STREAM_LEGACY || stream == CU_STREAM_PER_THREAD;
  CUcontext stream_ctx = nullptr, current = nullptr;
  if (!special && d.cuStreamGetCtx != nullptr &&
      d.cuStreamGetCtx(stream, &stream_ctx) == CUDA_SUCCESS &&
      d.cuCtxGetCurrent(&current) == CUDA_SUCCESS && stream_ctx != nullptr &&
      stream_ctx != current) {
    const int stream_device = device_of(d, stream_ctx), current_device = device_of(d, current);
    std::string fix = "launch on a stream of the current device";
    if (stream_device >= 0 && stream_device != current_device)
      fix += ", or make the stream's device current first (cudaSetDevice(" +
             std::to_string(stream_device) + "), torch.cuda.set_device(" +
             std::to_string(stream_device) + ") or cuCtxPushCurrent)";
    else
      fix += ", or push the stream's context first (cuCtxPushCurrent)";
    throw Error(MOEJIT_ERROR_INVALID_ARGUMENT,
                "stream belongs to a CUDA context other than the calling thread's current one "
                "(the stream's: " +
                    device_text(stream_device) + "; current: " + device_text(current_device) +
                    "), and the kernels run in the current context: " + fix +
                    ". The driver refused the launch: " + driver_said);
  }
  throw Error(MOEJIT_ERROR_CUDA, driver_said);
}

void check_cuda(CUresult result, const char* call) {
  if (result != CUDA_SUCCESS) throw Error(MOEJIT_ERROR_CUDA, describe_cuda_error(call, result));
}

}  // namespace moejit
