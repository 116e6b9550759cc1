// NVRTC, loaded with dlopen on first use, as libcuda is (driver.h): the library has no link-time
// dependency on it, so the NVRTC of a Python environment (pip's nvidia-cuda-nvrtc) serves as well
// as a CUDA toolkit's, and a missing NVRTC is a status with a message, never a library that fails
// to load. Types and prototypes come from the toolkit's nvrtc.h; no function of it is linked.
#pragma once

#include <nvrtc.h>

#include <string>
#include <vector>

namespace moejit {

struct NvrtcApi {
  decltype(&::nvrtcGetErrorString) nvrtcGetErrorString;
  decltype(&::nvrtcVersion) nvrtcVersion;
  decltype(&::nvrtcGetNumSupportedArchs) nvrtcGetNumSupportedArchs;
  decltype(&::nvrtcGetSupportedArchs) nvrtcGetSupportedArchs;
  decltype(&::nvrtcCreateProgram) nvrtcCreateProgram;
  decltype(&::nvrtcDestroyProgram) nvrtcDestroyProgram;
  decltype(&::nvrtcAddNameExpression) nvrtcAddNameExpression;
  decltype(&::nvrtcCompileProgram) nvrtcCompileProgram;
  decltype(&::nvrtcGetProgramLogSize) nvrtcGetProgramLogSize;
  decltype(&::nvrtcGetProgramLog) nvrtcGetProgramLog;
  decltype(&::nvrtcGetPTXSize) nvrtcGetPTXSize;
  decltype(&::nvrtcGetPTX) nvrtcGetPTX;
  decltype(&::nvrtcGetCUBINSize) nvrtcGetCUBINSize;
  decltype(&::nvrtcGetCUBIN) nvrtcGetCUBIN;
  decltype(&::nvrtcGetLoweredName) nvrtcGetLoweredName;
  std::string path;    // the file that was loaded
  std::string origin;  // which candidate it was, e.g. "the dynamic loader's search path"
};

// One place NVRTC may be: a path, or a bare file name for the dynamic loader's own search.
struct NvrtcCandidate {
  std::string file;    // "/usr/local/cuda/lib64/libnvrtc.so.13" or "libnvrtc.so.13"
  std::string origin;  // where the candidate comes from, for the log and the error message
};

// Where NVRTC is looked for, first match wins (majors 13 then 12 in each place):
//   1. $MOEJIT_NVRTC_LIBRARY, a path to libnvrtc.so.*: if set, the only candidate, so that a typo
//      is an error and not silently another NVRTC. The Python package sets it to the pip package
//      of the running environment when the variable is unset.
//   2. pip's NVRTC beside this library's directory: <parent>/nvidia/cu13/lib/libnvrtc.so.13 (CUDA
//      13) and <parent>/nvidia/cuda_nvrtc/lib/libnvrtc.so.12 (CUDA 12), where <parent> is the
//      parent of the directory holding libmoejit (in a wheel: site-packages, beside moejit/).
//   3. $CUDA_HOME and $CUDA_PATH: <root>/lib64 and <root>/lib.
//   4. The dynamic loader's search path: LD_LIBRARY_PATH, RUNPATH, ld.so.cache.
//   5. /usr/local/cuda/lib64, the toolkit's default location.
std::vector<NvrtcCandidate> nvrtc_candidates();

// Loads the first candidate that opens and has every function above. Throws
// Error(MOEJIT_ERROR_NVRTC_NOT_FOUND) listing each candidate and why it was not taken.
NvrtcApi load_nvrtc(const std::vector<NvrtcCandidate>& candidates);

// The process's NVRTC: load_nvrtc(nvrtc_candidates()) on first use, the path logged at debug
// level. Thread-safe; never unloaded; a failure is kept and thrown again on every call.
const NvrtcApi& nvrtc();

}  // namespace moejit
