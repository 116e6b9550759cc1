// A deliberate out-of-bounds write, for the self-check of tools/gpu-sanitize.sh: memcheck must
// catch it, or the script's clean runs prove nothing. Runs only with MOEJIT_SANITIZER_PLANT=1 (the
// script sets it for that check): a real combine whose output buffer is one row shorter than the
// call says, so the library's own kernel writes past the allocation. Nothing in the library
// changes; no argument check can see how large an allocation is.
#include <cuda_runtime.h>
#include <gtest/gtest.h>

#include <cstdint>
#include <cstdlib>
#include <cstring>

#include "gpu_harness.h"
#include "moejit/moejit.h"

namespace {

TEST(SanitizerPlant, AnOutputBufferOneRowShort) {
  const char* plant = std::getenv("MOEJIT_SANITIZER_PLANT");
  if (plant == nullptr || std::strcmp(plant, "1") != 0)
    GTEST_SKIP() << "a deliberate out-of-bounds write for the self-check of "
                    "tools/gpu-sanitize.sh; runs with MOEJIT_SANITIZER_PLANT=1";
  SKIP_WITHOUT_GPU();
  moejit_test::TokenMajorBf16 b;
  ASSERT_NO_FATAL_FAILURE(moejit_test::allocate(&b, 4, 2, 1024, 3));  // out one row short
  moejit_runtime_options o;
  moejit_runtime_options_init(&o);
  o.cache_mode = MOEJIT_CACHE_MODE_DISABLED;
  moejit_runtime_t rt = nullptr;
  ASSERT_EQ(moejit_runtime_create(&o, &rt), MOEJIT_SUCCESS) << moejit_last_error_message();
  const moejit_combine_args a = b.args();
  EXPECT_EQ(moejit_runtime_combine(rt, &a, nullptr), MOEJIT_SUCCESS) << moejit_last_error_message();
  cudaDeviceSynchronize();
  moejit_runtime_destroy(rt);
}

}  // namespace
