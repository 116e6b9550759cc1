// fork() after the parent used CUDA: the driver forbids CUDA in such a child, and the library must
// answer with a status there, never hang. The child's status and message are printed (the header
// documents them).
#include <cuda_runtime.h>
#include <gtest/gtest.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cstdint>
#include <cstdio>
#include <cstring>
#include <string>

#include "gpu_harness.h"
#include "moejit/moejit.h"

namespace {

TEST(ForkGpu, AChildOfAProcessThatUsedCudaGetsAStatusNotAHang) {
  SKIP_WITHOUT_GPU();
  moejit_test::TokenMajorBf16 b;
  ASSERT_NO_FATAL_FAILURE(moejit_test::allocate(&b, 4, 2, 1024, 4));
  const moejit_combine_args a = b.args();
  setenv("MOEJIT_CACHE_MODE", "disabled", 1);
  ASSERT_EQ(moe_combine(&a, nullptr), MOEJIT_SUCCESS) << moejit_last_error_message();
  CUDA_OK(cudaDeviceSynchronize());
  int fds[2];
  ASSERT_EQ(pipe(fds), 0);
  const pid_t child = fork();
  if (child == 0) {
    alarm(60);
    close(fds[0]);
    const moejit_status status = moe_combine(&a, nullptr);
    const std::string said =
        std::string(moejit_status_name(status)) + ": " + moejit_last_error_message();
    if (write(fds[1], said.data(), said.size()) < 0) _exit(2);
    _exit(0);
  }
  ASSERT_GT(child, 0);
  close(fds[1]);
  std::string said;
  char buf[512];
  for (ssize_t n; (n = read(fds[0], buf, sizeof(buf))) > 0;)
    said.append(buf, static_cast<size_t>(n));
  close(fds[0]);
  int status = 0;
  ASSERT_EQ(waitpid(child, &status, 0), child);
  EXPECT_FALSE(WIFSIGNALED(status))
      << "the child died of signal " << WTERMSIG(status) << " (14, SIGALRM: it hung)";
  std::printf("[ info     ] a forked child's combine: %s\n", said.c_str());
  EXPECT_FALSE(said.empty());
}

}  // namespace
