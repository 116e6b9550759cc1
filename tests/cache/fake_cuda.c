/* A stand-in libcuda.so.1 for host-only tests of how the library handles driver results (no GPU,
 * no NVIDIA driver): just the functions src/driver.cpp resolves, one device of compute capability
 * 9.0 with a current context, module loads whose result a test sets, launches that only count.
 * Types are the plain C ones behind the driver's handles and enums (pointers and ints), so this
 * needs no CUDA header. Tests reach the controls below through dlopen("libcuda.so.1"), which
 * returns this same library once the library under test has loaded it. */
#include <stddef.h>
#include <string.h>

#define FAKE_API __attribute__((visibility("default")))

enum {
  kSuccess = 0,
  kInvalidValue = 1,
  kOutOfMemory = 2,
  kInvalidImage = 200,
  kNoBinaryForGpu = 209,
  kInvalidHandle = 400,
  kIllegalAddress = 700,
  kNotSupported = 801
};

static int load_result = kSuccess; /* what the next failing loads return */
static int load_failures = 0;      /* how many loads still fail (-1: all of them) */
static int load_calls = 0;
static int launches = 0;
static int context_storage, module_storage, function_storage;
/* A second context, on device 1: the one caller-created streams belong to in
 * fake_cuda_refuse_stream_launches(1) (launches on them are then refused, as the real driver
 * does). */
static int other_context_storage;
static int refused_streams = 0;
/* The context pushed over the current one, if any; per thread, as the driver keeps it. */
static _Thread_local void* pushed = NULL;

/* ---- controls, for the tests ---- */

/* The next `times` calls of cuModuleLoadData return `result` (times -1: every call). */
FAKE_API void fake_cuda_fail_module_loads(int result, int times) {
  load_result = result;
  load_failures = times;
}
FAKE_API int fake_cuda_module_load_calls(void) {
  return load_calls;
}
FAKE_API int fake_cuda_launches(void) {
  return launches;
}
/* Launches on every stream but the special ones (NULL, legacy, per-thread) fail with
 * CUDA_ERROR_INVALID_HANDLE: mode 1, those streams belong to another context, on device 1;
 * mode 2, they belong to the current one (a failure with another cause); 0, launches succeed. */
FAKE_API void fake_cuda_refuse_stream_launches(int mode) {
  refused_streams = mode;
}

/* ---- the driver API subset ---- */

FAKE_API int cuInit(unsigned flags) {
  (void)flags;
  return kSuccess;
}
/* NVRTC itself opens libcuda.so.1 when one can be found and asks it for its internal tables:
 * refuse (and never leave it a missing symbol to call). */
FAKE_API int cuGetExportTable(const void** table, const void* id) {
  (void)id;
  *table = NULL;
  return kNotSupported;
}
FAKE_API int cuDriverGetVersion(int* version) {
  *version = 13000;
  return kSuccess;
}

static const char* error_name(int result) {
  switch (result) {
    case kSuccess:
      return "CUDA_SUCCESS";
    case kInvalidValue:
      return "CUDA_ERROR_INVALID_VALUE";
    case kOutOfMemory:
      return "CUDA_ERROR_OUT_OF_MEMORY";
    case kInvalidImage:
      return "CUDA_ERROR_INVALID_IMAGE";
    case kNoBinaryForGpu:
      return "CUDA_ERROR_NO_BINARY_FOR_GPU";
    case kInvalidHandle:
      return "CUDA_ERROR_INVALID_HANDLE";
    case kIllegalAddress:
      return "CUDA_ERROR_ILLEGAL_ADDRESS";
    default:
      return NULL;
  }
}
FAKE_API int cuGetErrorName(int result, const char** name) {
  *name = error_name(result);
  return *name != NULL ? kSuccess : kInvalidValue;
}
FAKE_API int cuGetErrorString(int result, const char** text) {
  *text = error_name(result) != NULL ? "fake driver result" : NULL;
  return *text != NULL ? kSuccess : kInvalidValue;
}

FAKE_API int cuCtxGetCurrent(void** context) {
  *context = pushed != NULL ? pushed : &context_storage;
  return kSuccess;
}
FAKE_API int cuCtxGetDevice(int* device) {
  *device = pushed == &other_context_storage ? 1 : 0;
  return kSuccess;
}
FAKE_API int cuCtxGetId(void* context, unsigned long long* id) {
  (void)context;
  *id = 1;
  return kSuccess;
}
FAKE_API int cuCtxPushCurrent_v2(void* context) {
  pushed = context; /* one level deep is all the library needs */
  return kSuccess;
}
FAKE_API int cuCtxPopCurrent_v2(void** context) {
  if (context != NULL) *context = pushed != NULL ? pushed : &context_storage;
  pushed = NULL;
  return kSuccess;
}
static int special_stream(const void* stream) {
  return stream == NULL || stream == (void*)1 || stream == (void*)2;
}
FAKE_API int cuStreamGetCtx(void* stream, void** context) {
  *context = refused_streams == 1 && !special_stream(stream) ? (void*)&other_context_storage
                                                             : (void*)&context_storage;
  return kSuccess;
}
FAKE_API int cuDeviceGetCount(int* count) {
  *count = 1;
  return kSuccess;
}
FAKE_API int cuDeviceGet(int* device, int ordinal) {
  *device = ordinal;
  return ordinal == 0 ? kSuccess : kInvalidValue;
}
/* CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR = 75, _MINOR = 76: sm_90. */
FAKE_API int cuDeviceGetAttribute(int* value, int attribute, int device) {
  (void)device;
  *value = attribute == 75 ? 9 : attribute == 76 ? 0 : 1;
  return kSuccess;
}

FAKE_API int cuModuleLoadData(void** module, const void* image) {
  ++load_calls;
  if (load_failures != 0) {
    if (load_failures > 0) --load_failures;
    return load_result;
  }
  /* What the real driver checks first: an ELF image (a cubin). */
  if (image == NULL || memcmp(image, "\177ELF", 4) != 0) return kInvalidImage;
  *module = &module_storage;
  return kSuccess;
}
FAKE_API int cuModuleUnload(void* module) {
  (void)module;
  return kSuccess;
}
FAKE_API int cuModuleGetFunction(void** function, void* module, const char* name) {
  (void)module;
  (void)name;
  *function = &function_storage;
  return kSuccess;
}
FAKE_API int cuLaunchKernel(void* f, unsigned gx, unsigned gy, unsigned gz, unsigned bx,
                            unsigned by, unsigned bz, unsigned shared, void* stream, void** params,
                            void** extra) {
  (void)f, (void)gx, (void)gy, (void)gz, (void)bx, (void)by, (void)bz, (void)shared;
  (void)params, (void)extra;
  if (refused_streams != 0 && !special_stream(stream)) return kInvalidHandle;
  ++launches;
  return kSuccess;
}
