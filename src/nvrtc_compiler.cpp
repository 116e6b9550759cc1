#include "nvrtc_compiler.h"

#include <atomic>
#include <cstdlib>
#include <memory>
#include <mutex>
#include <sstream>
#include <utility>

#include "error.h"
#include "nvrtc_loader.h"

namespace moejit {
namespace {

void check_nvrtc(nvrtcResult result, const char* call) {
  if (result != NVRTC_SUCCESS)
    throw Error(
        result == NVRTC_ERROR_OUT_OF_MEMORY ? MOEJIT_ERROR_OUT_OF_MEMORY : MOEJIT_ERROR_COMPILE,
        std::string(call) + " failed: " + nvrtc().nvrtcGetErrorString(result));
}

// Destroys the program on every path out of compile().
struct ProgramGuard {
  nvrtcProgram program = nullptr;
  ~ProgramGuard() {
    if (program != nullptr) nvrtc().nvrtcDestroyProgram(&program);
  }
};

std::string join(const std::vector<std::string>& items) {
  std::string s;
  for (const std::string& item : items) s += (s.empty() ? "" : " ") + item;
  return s;
}

// NVRTC's (major, minor), asked once.
std::pair<int, int> nvrtc_major_minor() {
  static const std::pair<int, int> version = [] {
    int major = 0, minor = 0;
    check_nvrtc(nvrtc().nvrtcVersion(&major, &minor), "nvrtcVersion");
    return std::make_pair(major, minor);
  }();
  return version;
}

}  // namespace

std::string Target::name() const {
  return (ptx ? "compute_" : "sm_") + std::to_string(sm);
}

// These two are never destroyed (allocated once, leaked): the host's static destructors may still
// call the library at exit, and a shape already loaded must find them.
const std::string& nvrtc_version() {
  static const std::string& version = *new std::string([] {
    const std::pair<int, int> v = nvrtc_major_minor();
    return std::to_string(v.first) + "." + std::to_string(v.second);
  }());
  return version;
}

const std::vector<int>& nvrtc_supported_archs() {
  static const std::vector<int>& archs = *new std::vector<int>([] {
    int count = 0;
    check_nvrtc(nvrtc().nvrtcGetNumSupportedArchs(&count), "nvrtcGetNumSupportedArchs");
    std::vector<int> list(static_cast<size_t>(count));
    if (count > 0)
      check_nvrtc(nvrtc().nvrtcGetSupportedArchs(list.data()), "nvrtcGetSupportedArchs");
    return list;
  }());
  return archs;
}

std::vector<std::string> compile_options(const Target& target) {
  // No fast-math: the combine promises fp32 accumulation with IEEE rounding.
  std::vector<std::string> options = {"--std=c++17", "--gpu-architecture=" + target.name(),
                                      "-DNDEBUG"};
  // NVRTC 12.4+: leave out the runtime API's declarations (texture types, cudaMalloc & co.,
  // device-side launch), which the templates never use (they include no toolkit header): the same
  // cubin, bit for bit, a little sooner per compile. Learned from the option's release note and
  // the FLAMEGPU2 issue that tracked it (#1187).
  if (nvrtc_major_minor() >= std::make_pair(12, 4)) options.push_back("-minimal");
  // Without it, NVRTC looks for a quoted include that is not among the named headers in the
  // process's working directory: bytes that change the binary but are not in the cache key (an
  // edit there served the old cubin). With it, such an include is a compile error.
  options.push_back("-no-source-include");
  return options;
}

Target target_for_device(int sm) {
  const std::vector<int>& archs = nvrtc_supported_archs();
  for (int a : archs)
    if (a == sm) return Target{sm, false};
  if (!archs.empty() && sm > archs.back()) return Target{archs.back(), true};
  std::ostringstream supported;
  for (int a : archs) supported << " sm_" << a;
  throw Error(MOEJIT_ERROR_UNSUPPORTED, "GPU architecture sm_" + std::to_string(sm) +
                                            " is not supported by NVRTC " + nvrtc_version() +
                                            " (it builds for:" + supported.str() + ")");
}

namespace {

// Set once the process has begun to exit, by an atexit handler registered right after NVRTC's first
// compile: handlers run in reverse order of registration, so this one runs before NVRTC's own
// teardown (registered during that compile) and before the destructors of the host's statics
// constructed earlier. A compile after it would run in a torn-down NVRTC (it crashed there, in
// nvrtcCompileProgram, from a static destructor); kernels already built or cached still load.
std::atomic<bool> g_exiting{false};
std::once_flag g_exit_hook;

void note_exit_hook() {
  std::call_once(g_exit_hook, [] { std::atexit([] { g_exiting.store(true); }); });
}

}  // namespace

CompiledModule compile(const CompileRequest& request) {
  if (g_exiting.load())
    throw Error(MOEJIT_ERROR_UNSUPPORTED,
                "cannot compile " + request.program_name + " for " + request.target.name() +
                    ": the process is exiting (NVRTC may already be shut down); only kernels "
                    "already loaded or in the disk cache can run now");
  const NvrtcApi& n = nvrtc();
  std::vector<const char*> header_names, header_bytes;
  for (const auto& [name, bytes] : request.headers) {
    header_names.push_back(name.c_str());
    header_bytes.push_back(bytes.c_str());
  }
  ProgramGuard guard;
  check_nvrtc(n.nvrtcCreateProgram(
                  &guard.program, request.source.c_str(), request.program_name.c_str(),
                  static_cast<int>(header_names.size()), header_bytes.data(), header_names.data()),
              "nvrtcCreateProgram");
  for (const std::string& expr : request.name_expressions)
    check_nvrtc(n.nvrtcAddNameExpression(guard.program, expr.c_str()), "nvrtcAddNameExpression");

  std::vector<const char*> options;
  for (const std::string& o : request.options) options.push_back(o.c_str());
  const nvrtcResult compiled =
      n.nvrtcCompileProgram(guard.program, static_cast<int>(options.size()), options.data());
  note_exit_hook();

  CompiledModule out;
  size_t log_size = 0;
  if (n.nvrtcGetProgramLogSize(guard.program, &log_size) == NVRTC_SUCCESS && log_size > 1) {
    out.log.resize(log_size);
    n.nvrtcGetProgramLog(guard.program, &out.log[0]);
    out.log.resize(log_size - 1);
  }
  if (compiled != NVRTC_SUCCESS)
    throw Error(MOEJIT_ERROR_COMPILE,
                "NVRTC failed to compile " + request.program_name + " for " +
                    request.target.name() + " (" + n.nvrtcGetErrorString(compiled) +
                    ")\noptions: " + join(request.options) + "\nlog:\n" + out.log);

  size_t size = 0;
  if (request.target.ptx) {
    check_nvrtc(n.nvrtcGetPTXSize(guard.program, &size), "nvrtcGetPTXSize");
    out.image.resize(size);
    check_nvrtc(n.nvrtcGetPTX(guard.program, &out.image[0]), "nvrtcGetPTX");
  } else {
    check_nvrtc(n.nvrtcGetCUBINSize(guard.program, &size), "nvrtcGetCUBINSize");
    out.image.resize(size);
    check_nvrtc(n.nvrtcGetCUBIN(guard.program, &out.image[0]), "nvrtcGetCUBIN");
  }
  for (const std::string& expr : request.name_expressions) {
    const char* lowered = nullptr;
    check_nvrtc(n.nvrtcGetLoweredName(guard.program, expr.c_str(), &lowered),
                "nvrtcGetLoweredName");
    out.lowered_names.emplace_back(lowered);
  }
  out.target = request.target;
  out.name_expressions = request.name_expressions;
  out.options = request.options;
  out.nvrtc_version = nvrtc_version();
  return out;
}

}  // namespace moejit
