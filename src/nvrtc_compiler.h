// NVRTC: source + named headers + options + name expressions -> cubin (or PTX) + lowered names
// + log. Value in, value out; knows nothing about combine, caches or the driver. Thread-safe.
#pragma once

#include <string>
#include <vector>

#include "kernel_sources.h"

namespace moejit {

// What to build for: a real cubin for sm_XX, or PTX for compute_XX when the GPU is newer than
// this NVRTC knows (the driver then compiles the PTX at load).
struct Target {
  int sm = 0;                // 90 for sm_90
  bool ptx = false;          // true: compute_XX PTX instead of an sm_XX cubin
  std::string name() const;  // "sm_90" or "compute_90"
  bool operator==(const Target& o) const { return sm == o.sm && ptx == o.ptx; }
};

struct CompileRequest {
  std::string program_name;  // shown in NVRTC messages
  std::string source;
  TemplateSet headers;               // every template, passed by name: NVRTC searches no directory
  std::vector<std::string> options;  // canonical order, the target arch included
  std::vector<std::string> name_expressions;
  Target target;
};

struct CompiledModule {
  Target target;
  std::string image;  // cubin bytes, or NUL-terminated PTX text
  std::vector<std::string> name_expressions;
  std::vector<std::string> lowered_names;  // same order as name_expressions
  std::vector<std::string> options;
  std::string nvrtc_version;  // "13.0"
  std::string log;            // NVRTC's log (warnings), possibly empty
};

// NVRTC is loaded on first use (nvrtc_loader.h): every function below that calls it throws
// Error(MOEJIT_ERROR_NVRTC_NOT_FOUND) when it cannot be loaded.

// "13.0" (major.minor of the loaded NVRTC).
const std::string& nvrtc_version();
// Every SM this NVRTC can build real cubins for (e.g. 75 80 86 ... 121), ascending.
const std::vector<int>& nvrtc_supported_archs();

// The options a request for `target` uses (the same list for the runtime and the precompile tool).
std::vector<std::string> compile_options(const Target& target);

// The target for a GPU of compute capability `sm` (e.g. 90): its own cubin if NVRTC supports it,
// PTX of the newest supported arch if the GPU is newer than NVRTC; Error(MOEJIT_ERROR_UNSUPPORTED)
// if the GPU is older than every arch NVRTC supports.
Target target_for_device(int sm);

// Compiles; throws Error(MOEJIT_ERROR_COMPILE) with the options and the full log on failure.
CompiledModule compile(const CompileRequest& request);

}  // namespace moejit
