// The C boundary: validate, call into C++, catch everything, map to a status and keep the message
// for moejit_last_error_message(). No exception ever crosses it.
#include <cstring>
#include <exception>
#include <new>
#include <string>

#include "c_enum.h"
#include "combine_plan.h"
#include "error.h"
#include "fork_guard.h"
#include "logging.h"
#include "moejit/moejit.h"
#include "runtime.h"
#include "settings.h"

namespace {

// The calling thread's last error message. A pointer, not a thread_local std::string: a thread's
// non-trivial thread_locals are destroyed before it finishes exiting, and the main thread's before
// the host's static destructors run, which may still call the library (and read the message).
// The owner frees the string at thread exit; a call after that (exit-time static destructors)
// allocates one that is never freed, once per such thread.
thread_local std::string* t_last_error = nullptr;
thread_local bool t_last_error_owner_gone = false;
// Set instead of the string when a failure's message could not be stored (host memory ran out):
// the status's static description, so that reporting a failure never throws.
thread_local const char* t_last_error_static = nullptr;
struct LastErrorOwner {
  ~LastErrorOwner() {
    delete t_last_error;
    t_last_error = nullptr;
    t_last_error_owner_gone = true;
  }
};
thread_local LastErrorOwner t_last_error_owner;

// Keeps prefix + message as the thread's last error and returns status. Never throws: it runs in
// guarded()'s handlers, outside their try, so an exception here (std::bad_alloc, when the host is
// out of memory and the handler was reporting just that) would leave through the C boundary and
// terminate a C caller.
moejit_status fail(moejit_status status, const char* message, const char* prefix = "") noexcept {
  try {
    if (t_last_error == nullptr) {
      t_last_error = new std::string;
      if (!t_last_error_owner_gone) (void)&t_last_error_owner;  // registers its destructor
    }
    t_last_error->assign(prefix).append(message);
    t_last_error_static = nullptr;
  } catch (...) {
    t_last_error_static = moejit_status_description(status);
  }
  try {
    moejit::logger().debug("{}: {}{}", moejit_status_name(status), prefix, message);
  } catch (...) {
  }
  return status;
}

// Runs body; turns every exception into a status and a per-thread message.
template <typename Body>
moejit_status guarded(Body&& body) {
  try {
    body();
    return MOEJIT_SUCCESS;
  } catch (const moejit::Error& e) {
    return fail(e.status(), e.what());
  } catch (const std::bad_alloc&) {
    return fail(MOEJIT_ERROR_OUT_OF_MEMORY, "host memory allocation failed");
  } catch (const std::exception& e) {
    return fail(MOEJIT_ERROR_INTERNAL, e.what(), "internal error: ");
  } catch (...) {
    return fail(MOEJIT_ERROR_INTERNAL, "internal error: unknown exception");
  }
}

// For a combine: a runtime of this process (fork_guard.h), else the default runtime.
moejit::Runtime& runtime_or_default(moejit_runtime_t runtime) {
  return runtime != nullptr ? moejit::runtime_of_this_process(runtime) : moejit::default_runtime();
}

}  // namespace

extern "C" {

int moejit_version(void) {
  return MOEJIT_VERSION_NUMBER;
}

const char* moejit_version_string(void) {
#define MOEJIT_STR2_(x) #x
#define MOEJIT_STR_(x) MOEJIT_STR2_(x)
  return MOEJIT_STR_(MOEJIT_VERSION_MAJOR) "." MOEJIT_STR_(MOEJIT_VERSION_MINOR) "." MOEJIT_STR_(
      MOEJIT_VERSION_PATCH);
}

const char* moejit_status_name(moejit_status status) {
  switch (moejit::c_enum_value(status)) {  // any int from C (src/c_enum.h)
#define MOEJIT_NAME_CASE_(name, value, description) \
  case name:                                        \
    return #name;
    MOEJIT_STATUS_TABLE(MOEJIT_NAME_CASE_)
#undef MOEJIT_NAME_CASE_
  }
  return "MOEJIT_STATUS_UNKNOWN";
}

const char* moejit_status_description(moejit_status status) {
  switch (moejit::c_enum_value(status)) {
#define MOEJIT_DESCRIPTION_CASE_(name, value, description) \
  case name:                                               \
    return description;
    MOEJIT_STATUS_TABLE(MOEJIT_DESCRIPTION_CASE_)
#undef MOEJIT_DESCRIPTION_CASE_
  }
  return "unknown status code";
}

// Allocates nothing: "" until this thread's first failure.
const char* moejit_last_error_message(void) {
  if (t_last_error_static != nullptr) return t_last_error_static;
  return t_last_error != nullptr ? t_last_error->c_str() : "";
}

// Writes the defaults into the caller's struct, never past its size: a caller built against an
// older header has a shorter struct (0.1's ended before dependent_launch).
moejit_status moejit_combine_args_init_sized(moejit_combine_args* args, size_t struct_size) {
  return guarded([&] {
    if (args == nullptr)
      moejit::invalid_argument("args", "NULL", "must point to a moejit_combine_args");
    if (!moejit::known_combine_args_size(struct_size))
      moejit::invalid_argument(
          "struct_size", std::to_string(struct_size),
          "must be sizeof(moejit_combine_args) of a libmoejit header no newer than this library (" +
              std::to_string(sizeof(moejit_combine_args)) + " for " + moejit_version_string() +
              ", " + std::to_string(moejit::kCombineArgsSizeV02) + " for 0.2, " +
              std::to_string(moejit::kCombineArgsSizeV01) + " for 0.1)");
    moejit_combine_args defaults = MOEJIT_COMBINE_ARGS_INIT;
    defaults.struct_size = struct_size;
    std::memcpy(args, &defaults, struct_size);
  });
}

// The 0.1 entry point (the header's moejit_combine_args_init is now a macro over the sized form):
// binaries built against the 0.1 header call it with a struct of the 0.1 size.
moejit_status(moejit_combine_args_init)(moejit_combine_args* args) {
  return moejit_combine_args_init_sized(args, moejit::kCombineArgsSizeV01);
}

moejit_status moejit_combine_workspace_size(const moejit_combine_args* args, size_t* bytes) {
  return guarded([&] {
    if (bytes == nullptr) moejit::invalid_argument("bytes", "NULL", "must point to a size_t");
    *bytes = moejit::combine_workspace_bytes(args);
  });
}

// Writes the defaults into the caller's struct, never past its size: a caller built against an
// older header has a shorter struct (0.1's and 0.2's ended before cache_key_file).
moejit_status moejit_runtime_options_init_sized(moejit_runtime_options* options,
                                                size_t struct_size) {
  return guarded([&] {
    if (options == nullptr)
      moejit::invalid_argument("options", "NULL", "must point to a moejit_runtime_options");
    if (struct_size != sizeof(moejit_runtime_options) &&
        struct_size != moejit::kRuntimeOptionsSizeV02)
      moejit::invalid_argument(
          "struct_size", std::to_string(struct_size),
          "must be sizeof(moejit_runtime_options) of a libmoejit header no newer than this "
          "library (" +
              std::to_string(sizeof(moejit_runtime_options)) + " for " + moejit_version_string() +
              ", " + std::to_string(moejit::kRuntimeOptionsSizeV02) + " for 0.1 and 0.2)");
    moejit_runtime_options defaults;
    std::memset(&defaults, 0, sizeof(defaults));
    defaults.struct_size = struct_size;
    defaults.cache_mode = MOEJIT_CACHE_MODE_DEFAULT;
    defaults.log_level = MOEJIT_LOG_DEFAULT;
    std::memcpy(options, &defaults, struct_size);
  });
}

// The 0.1 entry point (the header's name is now a macro over the sized form): binaries built
// against the 0.1 or 0.2 header call it with a struct of that size.
moejit_status(moejit_runtime_options_init)(moejit_runtime_options* options) {
  return moejit_runtime_options_init_sized(options, moejit::kRuntimeOptionsSizeV02);
}

moejit_status moejit_runtime_create(const moejit_runtime_options* options,
                                    moejit_runtime_t* runtime) {
  return guarded([&] {
    if (runtime == nullptr)
      moejit::invalid_argument("runtime", "NULL", "must point to a moejit_runtime_t");
    *runtime = nullptr;
    const moejit::Settings settings = moejit::resolve_settings(options);
    auto* created = new moejit::Runtime(settings);
    // Only now: a create that fails leaves the logger, which every runtime shares, as it was.
    moejit::apply_log_level(settings);
    *runtime = created;
  });
}

moejit_status moejit_runtime_destroy(moejit_runtime_t runtime) {
  return guarded([&] {
    auto* r = static_cast<moejit::Runtime*>(runtime);
    // A runtime of the parent process (before a fork) is left alone: its locks may be held by
    // threads that do not exist in this one, and its modules belong to the parent's contexts.
    if (r != nullptr && r->fork_generation() == moejit::fork_generation()) delete r;
  });
}

moejit_status moejit_runtime_combine(moejit_runtime_t runtime, const moejit_combine_args* args,
                                     moejit_stream_t stream) {
  return guarded([&] { runtime_or_default(runtime).combine(args, stream); });
}

moejit_status moe_combine(const moejit_combine_args* args, moejit_stream_t stream) {
  return moejit_runtime_combine(nullptr, args, stream);
}

moejit_status moejit_runtime_get_stats(moejit_runtime_t runtime, moejit_stats* stats) {
  return guarded([&] {
    if (stats == nullptr) moejit::invalid_argument("stats", "NULL", "must point to a moejit_stats");
    if (stats->struct_size < sizeof(size_t) + sizeof(uint64_t))
      moejit::invalid_argument(
          "stats->struct_size", std::to_string(stats->struct_size),
          "must be at least " + std::to_string(sizeof(size_t) + sizeof(uint64_t)) +
              " (struct_size and one counter; sizeof(moejit_stats) = " +
              std::to_string(sizeof(moejit_stats)) + " for this library version)");
    // A parent's runtime too (after a fork): its counters are plain atomics, safe to read.
    (runtime != nullptr ? *static_cast<moejit::Runtime*>(runtime) : moejit::default_runtime())
        .stats()
        .copy_to(stats);
  });
}

}  // extern "C"
