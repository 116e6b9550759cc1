#include "nvrtc_loader.h"

#include <dlfcn.h>
#include <link.h>
#include <sys/stat.h>

#include <algorithm>
#include <cerrno>
#include <cstdlib>
#include <cstring>
#include <utility>

#include "error.h"
#include "logging.h"
#include "settings.h"

namespace moejit {
namespace {

// NVRTC majors whose API this library uses unchanged, newest first.
constexpr int kMajors[] = {13, 12};

std::string soname(int major) {
  return "libnvrtc.so." + std::to_string(major);
}

// pip's layout of NVRTC per CUDA major: nvidia-cuda-nvrtc (13) and nvidia-cuda-nvrtc-cu12.
std::string pip_lib_dir(int major) {
  return major >= 13 ? "nvidia/cu" + std::to_string(major) + "/lib" : "nvidia/cuda_nvrtc/lib";
}

// The directory of the file holding this code: libmoejit.so, or a program linking it statically.
std::string own_directory() {
  Dl_info info{};
  if (dladdr(reinterpret_cast<void*>(&nvrtc_candidates), &info) == 0 || info.dli_fname == nullptr)
    return "";
  std::string path = info.dli_fname;
  const size_t slash = path.rfind('/');
  return slash == std::string::npos ? "." : path.substr(0, slash);
}

// The parent directory, by name: "/a/b" -> "/a", "/a" -> "/", "b" -> "b/..".
std::string parent_of(const std::string& dir) {
  const size_t slash = dir.rfind('/');
  if (slash == std::string::npos) return dir + "/..";
  return slash == 0 ? "/" : dir.substr(0, slash);
}

template <typename F>
bool resolve(void* handle, const char* name, F* fn, std::string* missing) {
  *fn = reinterpret_cast<F>(dlsym(handle, name));
  if (*fn == nullptr && missing->empty()) *missing = name;
  return *fn != nullptr;
}

// The path the dynamic loader actually opened (a bare name resolves to a file somewhere).
std::string loaded_path(void* handle, const std::string& fallback) {
  link_map* map = nullptr;
  if (dlinfo(handle, RTLD_DI_LINKMAP, &map) == 0 && map != nullptr && map->l_name != nullptr &&
      *map->l_name != '\0')
    return map->l_name;
  return fallback;
}

// NVRTC opens libnvrtc-builtins.so.MAJOR.MINOR by name at its first compile, and pip's
// libnvrtc.so has no RUNPATH to its own directory: without a toolkit on the loader's path that
// compile fails ("failed to open libnvrtc-builtins"). The one next to the loaded libnvrtc is
// opened here by its path first, so the name NVRTC asks for is already loaded (glibc matches it
// by soname). Kept open, like libnvrtc; where there is none, NVRTC searches as it would.
void preload_builtins(const NvrtcApi& api) {
  int major = 0, minor = 0;
  if (api.nvrtcVersion(&major, &minor) != NVRTC_SUCCESS) return;
  const size_t slash = api.path.rfind('/');
  if (slash == std::string::npos) return;
  const std::string file = api.path.substr(0, slash) + "/libnvrtc-builtins.so." +
                           std::to_string(major) + "." + std::to_string(minor);
  struct stat st {};
  if (stat(file.c_str(), &st) != 0) return;
  if (dlopen(file.c_str(), RTLD_NOW | RTLD_LOCAL) == nullptr) {
    const char* error = dlerror();
    logger().debug("could not preload {}: {}", file, error != nullptr ? error : "dlopen failed");
  }
}

// Opens one candidate; on failure says why in *why and returns false.
bool try_load(const NvrtcCandidate& c, NvrtcApi* api, std::string* why) {
  if (c.file.find('/') != std::string::npos) {
    struct stat st {};
    if (stat(c.file.c_str(), &st) != 0) {
      *why = std::strerror(errno);
      return false;
    }
  }
  // Kept open for the life of the process, like the driver: compiles may run until exit.
  void* handle = dlopen(c.file.c_str(), RTLD_NOW | RTLD_LOCAL);
  if (handle == nullptr) {
    const char* error = dlerror();
    *why = error != nullptr ? error : "dlopen failed";
    return false;
  }
  NvrtcApi& a = *api;
  std::string missing;
  resolve(handle, "nvrtcGetErrorString", &a.nvrtcGetErrorString, &missing);
  resolve(handle, "nvrtcVersion", &a.nvrtcVersion, &missing);
  resolve(handle, "nvrtcGetNumSupportedArchs", &a.nvrtcGetNumSupportedArchs, &missing);
  resolve(handle, "nvrtcGetSupportedArchs", &a.nvrtcGetSupportedArchs, &missing);
  resolve(handle, "nvrtcCreateProgram", &a.nvrtcCreateProgram, &missing);
  resolve(handle, "nvrtcDestroyProgram", &a.nvrtcDestroyProgram, &missing);
  resolve(handle, "nvrtcAddNameExpression", &a.nvrtcAddNameExpression, &missing);
  resolve(handle, "nvrtcCompileProgram", &a.nvrtcCompileProgram, &missing);
  resolve(handle, "nvrtcGetProgramLogSize", &a.nvrtcGetProgramLogSize, &missing);
  resolve(handle, "nvrtcGetProgramLog", &a.nvrtcGetProgramLog, &missing);
  resolve(handle, "nvrtcGetPTXSize", &a.nvrtcGetPTXSize, &missing);
  resolve(handle, "nvrtcGetPTX", &a.nvrtcGetPTX, &missing);
  resolve(handle, "nvrtcGetCUBINSize", &a.nvrtcGetCUBINSize, &missing);
  resolve(handle, "nvrtcGetCUBIN", &a.nvrtcGetCUBIN, &missing);
  resolve(handle, "nvrtcGetLoweredName", &a.nvrtcGetLoweredName, &missing);
  if (!missing.empty()) {
    *why = "loaded, but it lacks " + missing + " (an NVRTC older than 11.1)";
    dlclose(handle);
    return false;
  }
  a.path = loaded_path(handle, c.file);
  a.origin = c.origin;
  preload_builtins(a);
  return true;
}

struct LoadedNvrtc {
  NvrtcApi api{};
  std::string error;  // empty: loaded
};

}  // namespace

std::vector<NvrtcCandidate> nvrtc_candidates() {
  const NvrtcEnvironment environment = nvrtc_environment();
  if (environment.library != nullptr) return {{environment.library, "$MOEJIT_NVRTC_LIBRARY"}};
  std::vector<NvrtcCandidate> list;
  auto add = [&list](const std::string& file, const std::string& origin) {
    const bool seen = std::any_of(list.begin(), list.end(),
                                  [&](const NvrtcCandidate& c) { return c.file == file; });
    if (!seen) list.push_back({file, origin});
  };
  const std::string own = own_directory();
  if (!own.empty())
    for (int major : kMajors)
      add(parent_of(own) + "/" + pip_lib_dir(major) + "/" + soname(major),
          "pip's NVRTC package next to libmoejit");
  const std::pair<const char*, const char*> roots[] = {{environment.cuda_home, "$CUDA_HOME"},
                                                       {environment.cuda_path, "$CUDA_PATH"}};
  for (const auto& [root, var] : roots)
    if (root != nullptr)
      for (const char* lib : {"/lib64/", "/lib/"})
        for (int major : kMajors) add(root + std::string(lib) + soname(major), var);
  for (int major : kMajors)
    add(soname(major), "the dynamic loader: LD_LIBRARY_PATH, RUNPATH, ld.so.cache");
  for (int major : kMajors)
    add("/usr/local/cuda/lib64/" + soname(major), "the CUDA toolkit's default location");
  return list;
}

NvrtcApi load_nvrtc(const std::vector<NvrtcCandidate>& candidates) {
  std::string searched;
  for (const NvrtcCandidate& c : candidates) {
    NvrtcApi api{};
    std::string why;
    if (try_load(c, &api, &why)) return api;
    searched += "\n  " + c.file + " (" + c.origin + "): " + why;
  }
  const bool from_env = candidates.size() == 1 && candidates[0].origin == "$MOEJIT_NVRTC_LIBRARY";
  throw Error(MOEJIT_ERROR_NVRTC_NOT_FOUND,
              "NVRTC (libnvrtc.so) could not be loaded, so no kernel can be compiled or looked up "
              "in the cache (its keys name the NVRTC version). Searched:" +
                  searched +
                  (from_env ? "\nMOEJIT_NVRTC_LIBRARY names the only place searched: point it at "
                              "libnvrtc.so.13 (or .12), or unset it to search the usual places."
                            : "\nInstall NVRTC: in a Python environment `pip install "
                              "nvidia-cuda-nvrtc` (CUDA 13), or the CUDA toolkit's NVRTC "
                              "(Debian/Ubuntu: cuda-nvrtc-13-0); or set MOEJIT_NVRTC_LIBRARY to "
                              "its libnvrtc.so."));
}

const NvrtcApi& nvrtc() {
  // Never destroyed: the host's static destructors may still compile or ask for the version.
  static const LoadedNvrtc& loaded = *new LoadedNvrtc([] {
    LoadedNvrtc l;
    try {
      l.api = load_nvrtc(nvrtc_candidates());
      int major = 0, minor = 0;
      l.api.nvrtcVersion(&major, &minor);
      logger().debug("loaded NVRTC {}.{} from {} ({})", major, minor, l.api.path, l.api.origin);
    } catch (const Error& e) {
      l.error = e.what();
      logger().debug("{}", l.error);
    }
    return l;
  }());
  if (!loaded.error.empty()) throw Error(MOEJIT_ERROR_NVRTC_NOT_FOUND, loaded.error);
  return loaded.api;
}

}  // namespace moejit
