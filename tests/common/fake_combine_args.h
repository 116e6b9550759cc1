// A gather-map combine (bf16 rows and output, int32 map, no gates) on fake device addresses, for
// tests that stop before a launch (argument checks, no driver) or run on the stand-in driver
// (tests/cache/fake_cuda.c), which never dereferences them. Each buffer has a region of its own
// (the library refuses buffers that overlap), aligned for any vector width; gates, where a test
// wants them, go to kFakeGates. Only the public C API.
#pragma once

#include <dlfcn.h>

#include <cstdint>
#include <cstring>

#include "moejit/moejit.h"

namespace moejit_test {

constexpr uintptr_t kFakeExpert = 0x7f0000000000;
constexpr uintptr_t kFakeGates = 0x7f0010000000;
constexpr uintptr_t kFakeIndices = 0x7f0020000000;
constexpr uintptr_t kFakeOut = 0x7f0030000000;

inline void* fake_address(uintptr_t address) {
  return reinterpret_cast<void*>(address);
}

inline moejit_combine_args fake_gather_map_args(int64_t tokens, int64_t top_k, int64_t hidden) {
  moejit_combine_args a;
  moejit_combine_args_init(&a);
  a.layout = MOEJIT_LAYOUT_GATHER_MAP;
  a.num_tokens = tokens;
  a.top_k = top_k;
  a.num_rows = tokens * top_k;
  a.hidden_dim = hidden;
  a.expert_hidden = fake_address(kFakeExpert);
  a.expert_dtype = MOEJIT_DTYPE_BFLOAT16;
  a.indices = fake_address(kFakeIndices);
  a.index_type = MOEJIT_INDEX_INT32;
  a.out = fake_address(kFakeOut);
  a.out_dtype = MOEJIT_DTYPE_BFLOAT16;
  return a;
}

// Stores any int in an enum-typed field, as a C caller can. (Not by returning the enum: in C++
// an enum holding a value outside its enumerators' bit range may not even be loaded; the library
// reads such fields as ints, src/c_enum.h. The sanitizer build checks both.)
template <typename E>
void set_c_enum(E& field, int value) {
  static_assert(sizeof(E) == sizeof(int), "C enums are int-sized here");
  std::memcpy(&field, &value, sizeof(field));
}

// Whether libcuda.so.1 loads here: a call on these fake pointers must then not reach a launch.
inline bool driver_present() {
  void* h = dlopen("libcuda.so.1", RTLD_NOW | RTLD_LOCAL);
  if (h != nullptr) dlclose(h);
  return h != nullptr;
}

}  // namespace moejit_test
