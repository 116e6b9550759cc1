// The C boundary when host memory runs out: a failing call returns its status and leaves a
// message, and no exception leaves the library, not even while it reports the failure (a C caller
// cannot catch one: it would terminate the process). Allocations are made to fail on one thread
// by replacing the global operator new of this program, which the library's allocations go
// through (it links the C++ runtime dynamically).
#include <gtest/gtest.h>

#include <cstdlib>
#include <new>
#include <string>
#include <thread>

#include "moejit/moejit.h"

namespace {

thread_local bool t_allocations_fail = false;
thread_local long t_allocations = 0;  // this thread's calls of operator new

// Whether an allocation the library makes on this thread reaches this program's operator new: a
// refused argument builds its message on the heap. Where it does not (a toolchain that binds the
// library's allocations elsewhere), failing allocations here cannot reach the library either.
bool library_allocations_are_seen() {
  // Once first, here: the first failure in a process also creates the logger, whose allocations
  // (inside libspdlog) reach this operator new even where the library's own do not.
  moejit_combine_args_init_sized(nullptr, sizeof(moejit_combine_args));
  bool seen = false;
  std::thread([&] {
    const long before = t_allocations;
    moejit_combine_args_init_sized(nullptr, sizeof(moejit_combine_args));
    seen = t_allocations > before;
  }).join();
  return seen;
}

#define SKIP_UNLESS_LIBRARY_ALLOCATIONS_ARE_SEEN()                                             \
  if (!library_allocations_are_seen())                                                         \
  GTEST_SKIP() << "the library's allocations do not reach this program's operator new (built " \
                  "with "                                                                      \
               << __VERSION__ << ")"

// Runs call on a fresh thread (no message stored yet) with every allocation of that thread
// failing; what call returns, or "threw" if an exception escaped the library.
template <typename Call>
std::string without_memory(Call call) {
  std::string result;
  std::thread([&] {
    std::string got;
    t_allocations_fail = true;
    try {
      got = call();  // short texts only: they fit in the string itself, no allocation
    } catch (...) {
      t_allocations_fail = false;
      got = "threw";
    }
    t_allocations_fail = false;
    result = got;
  }).join();
  return result;
}

}  // namespace

void* operator new(std::size_t size) {
  ++t_allocations;
  if (t_allocations_fail) throw std::bad_alloc();
  if (void* p = std::malloc(size != 0 ? size : 1)) return p;
  throw std::bad_alloc();
}
void operator delete(void* p) noexcept {
  std::free(p);
}
void operator delete(void* p, std::size_t) noexcept {
  std::free(p);
}

// A call refused for its argument, whose message cannot even be built: the status says host
// memory ran out, and so does the message (the status's description), read without allocating.
TEST(OutOfMemory, AFailingCallReportsItWithoutThrowing) {
  SKIP_UNLESS_LIBRARY_ALLOCATIONS_ARE_SEEN();
  const char* message = nullptr;
  const std::string status = without_memory([&] {
    const moejit_status s = moejit_combine_args_init_sized(nullptr, sizeof(moejit_combine_args));
    message = moejit_last_error_message();
    // Only a static text may outlive the thread (a stored message is freed at its exit).
    if (message != moejit_status_description(MOEJIT_ERROR_OUT_OF_MEMORY)) message = nullptr;
    return std::string(s == MOEJIT_ERROR_OUT_OF_MEMORY ? "out of memory" : "other status");
  });
  EXPECT_EQ(status, "out of memory");
  EXPECT_NE(message, nullptr) << "the message is not the status's description";
}

// Asking for the message before any failure allocates nothing either.
TEST(OutOfMemory, TheLastErrorMessageNeverThrows) {
  SKIP_UNLESS_LIBRARY_ALLOCATIONS_ARE_SEEN();
  const char* message = nullptr;
  const std::string outcome = without_memory([&] {
    message = moejit_last_error_message();
    return std::string("returned");
  });
  EXPECT_EQ(outcome, "returned");
  ASSERT_NE(message, nullptr);
  EXPECT_STREQ(message, "");
}

// Once memory is back, a failure stores its full message again.
TEST(OutOfMemory, AFullMessageAgainOnceMemoryIsBack) {
  SKIP_UNLESS_LIBRARY_ALLOCATIONS_ARE_SEEN();
  std::string message;
  std::thread([&] {
    t_allocations_fail = true;
    moejit_combine_args_init_sized(nullptr, sizeof(moejit_combine_args));
    t_allocations_fail = false;
    EXPECT_EQ(moejit_combine_args_init_sized(nullptr, sizeof(moejit_combine_args)),
              MOEJIT_ERROR_INVALID_ARGUMENT);
    message = moejit_last_error_message();
  }).join();
  EXPECT_NE(message.find("invalid argument args = NULL"), std::string::npos) << message;
}
