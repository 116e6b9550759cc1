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
  kContextIsDestroyed = 709,
  kNotSupported = 801
};

static int load_result = kSuccess; /* what the next failing loads return */
static int load_failures = 0;      /* how many loads still fail (-1: all of them) */
/* Atomic: tests call the library from several threads at once. */
static _Atomic int load_calls = 0;
static _Atomic int launches = 0;
static int context_storage, function_storage;
/* The current context's id: cuCtxGetId of its handle. fake_cuda_replace_context() destroys the
 * context and creates another under the same handle, as the driver may reuse one. */
static unsigned long long context_id = 1;
/* Modules: each handle records the id of the context it was loaded in. */
#define FAKE_MODULES 256
static unsigned long long module_context[FAKE_MODULES];
static _Atomic int modules_loaded = 0;
static _Atomic int stale_unloads = 0; /* cuModuleUnload calls on a destroyed context's module */
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
/* Destroys the current context (its modules go with it) and creates a new one with the same
 * handle, as the driver may hand out a destroyed context's handle again. */
FAKE_API void fake_cuda_replace_context(void) {
  ++context_id;
}
/* How many times a module of a destroyed context was passed to cuModuleUnload: a handle the driver
 * may since have given to another module (of another library, say), which that call unloads. */
FAKE_API int fake_cuda_stale_unloads(void) {
  return stale_unloads;
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
    case kContextIsDestroyed:
      return "CUDA_ERROR_CONTEXT_IS_DESTROYED";
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
  *id = context == &context_storage ? context_id : 1000;
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
  const int m = modules_loaded++;
  if (m >= FAKE_MODULES) return kOutOfMemory;
  module_context[m] = pushed != NULL ? 1000 : context_id;
  *module = &module_context[m];
  return kSuccess;
}
FAKE_API int cuModuleUnload(void* module) {
  const unsigned long long* m = (const unsigned long long*)module;
  if (*m != 1000 && *m != context_id) {
    ++stale_unloads;
    return kContextIsDestroyed;
  }
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
