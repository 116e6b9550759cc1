// Calls into the library from a static destructor, after main has returned, on the stand-in
// libcuda.so.1 (fake_cuda.c): a failing call and its message, a combine of a shape loaded during
// main (it runs), and one of a new shape (refused with a clear error: NVRTC may already be shut
// down; it crashed inside nvrtcCompileProgram before). Prints "exit-time: ok" last when every
// check held; ctest looks for that line (and AddressSanitizer, in the sanitizer build, for
// use-after-free of the library's statics).
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>

#include "fake_combine_args.h"
#include "moejit/moejit.h"

namespace {

moejit_combine_args shape(int64_t hidden) {
  return moejit_test::fake_gather_map_args(4, 2, hidden);
}

bool check(bool ok, const char* what) {
  std::printf("%s: %s (last error: %s)\n", ok ? "ok" : "FAILED", what, moejit_last_error_message());
  return ok;
}

struct CallsAtExit {
  ~CallsAtExit() {
    bool all = true;
    all &= check(moe_combine(nullptr, nullptr) == MOEJIT_ERROR_INVALID_ARGUMENT &&
                     std::strstr(moejit_last_error_message(), "args = NULL") != nullptr,
                 "a failing call at exit, and its message");
    const moejit_combine_args loaded = shape(256);
    all &= check(moe_combine(&loaded, nullptr) == MOEJIT_SUCCESS,
                 "a shape loaded during main runs at exit");
    const moejit_combine_args fresh = shape(384);
    all &= check(moe_combine(&fresh, nullptr) == MOEJIT_ERROR_UNSUPPORTED &&
                     std::strstr(moejit_last_error_message(), "the process is exiting") != nullptr,
                 "a new shape at exit is refused, not compiled");
    if (all) std::printf("exit-time: ok\n");
    std::fflush(stdout);
  }
};
CallsAtExit calls_at_exit;  // constructed before main, so destroyed after main returns

}  // namespace

int main() {
  if (std::getenv("MOEJIT_TEST_FAKE_DRIVER") == nullptr) {
    std::printf("needs the fake driver (run through ctest)\n");
    return 1;
  }
  // A failure first: the message then lives in the main thread's storage.
  if (moe_combine(nullptr, nullptr) != MOEJIT_ERROR_INVALID_ARGUMENT) return 1;
  const moejit_combine_args a = shape(256);
  const moejit_status s = moe_combine(&a, nullptr);
  std::printf("in main: %s %s\n", moejit_status_name(s), moejit_last_error_message());
  return s == MOEJIT_SUCCESS ? 0 : 1;
}
