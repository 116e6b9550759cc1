// Fuzz target for the entry parser: whatever the bytes, parse_cache_entry must return (no crash,
// no huge allocation, no read out of bounds), and whatever it accepts must re-encode to exactly
// the same bytes. Each input is also tried "resealed" (checksums recomputed) so that mutations
// reach the payload parser instead of stopping at the checksum.
//
// Built two ways: with -fsanitize=fuzzer,address for libFuzzer (MOEJIT_FUZZ=ON with clang), and
// always as a plain executable whose main() (fuzz_driver_main.cpp) feeds it random mutations of
// a valid entry for a bounded time, as a ctest.
#include <cstddef>
#include <cstdint>
#include <cstdlib>
#include <string>

#define XXH_INLINE_ALL
#include <xxhash.h>

#include "cache_entry.h"
#include "entry_samples.h"

namespace {

void check(const std::string& bytes) {
  // The key the entry claims, if any, so that inputs can pass the key check.
  std::string key = moejit::test::sample_key();
  if (bytes.size() >= 48) key.assign(bytes, 16, 32);
  moejit::CompiledModule module;
  std::string why;
  if (!moejit::parse_cache_entry(bytes, key, &module, &why)) {
    if (why.empty()) std::abort();  // every rejection says why
    return;
  }
  if (moejit::encode_cache_entry(key, module) != bytes) std::abort();
}

void put_u64(std::string* b, size_t at, uint64_t v) {
  for (int i = 0; i < 8; ++i) (*b)[at + static_cast<size_t>(i)] = static_cast<char>(v >> (8 * i));
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  std::string bytes(reinterpret_cast<const char*>(data), size);
  check(bytes);
  if (bytes.size() >= moejit::kCacheEntryHeaderBytes) {
    put_u64(&bytes, 48, bytes.size() - moejit::kCacheEntryHeaderBytes);
    put_u64(&bytes, 56, XXH3_64bits(bytes.data() + 72, bytes.size() - 72));
    put_u64(&bytes, 64, XXH3_64bits(bytes.data(), 64));
    check(bytes);
  }
  return 0;
}
