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
#include <string_view>

#include "cache_entry.h"
#include "entry_samples.h"

namespace {

const moejit::MacKey& fuzz_key() {
  static const auto key = moejit::test::sample_mac_key();
  return *key;
}

// With the key, whatever parses must re-encode (authenticated under it) to exactly the same bytes;
// without, the same once the entry's own MAC field is put back (the parser does not examine it).
void check(const std::string& bytes) {
  // The key the entry claims, if any, so that inputs can pass the key check.
  std::string key = moejit::test::sample_key();
  if (bytes.size() >= 48) key.assign(bytes, 16, 32);
  for (const moejit::MacKey* mac_key : {&fuzz_key(), static_cast<const moejit::MacKey*>(nullptr)}) {
    moejit::CompiledModule module;
    std::string why;
    if (!moejit::parse_cache_entry(bytes, key, &module, &why, mac_key)) {
      if (why.empty()) std::abort();  // every rejection says why
      continue;
    }
    std::string again = moejit::encode_cache_entry(key, module, -1, mac_key);
    if (mac_key == nullptr) {
      again.replace(64, moejit::kCacheEntryHeaderHashOffset - 64, bytes, 64,
                    moejit::kCacheEntryHeaderHashOffset - 64);  // flags, reserved, MAC
      moejit::test::reseal(&again);
    }
    if (again != bytes) std::abort();
  }
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  std::string bytes(reinterpret_cast<const char*>(data), size);
  check(bytes);
  if (bytes.size() >= moejit::kCacheEntryHeaderBytes) {
    moejit::test::put_u64(&bytes, 48, bytes.size() - moejit::kCacheEntryHeaderBytes);
    moejit::test::reseal(&bytes);
    check(bytes);
    // Authenticated under the fuzz key as well, so that mutations reach the payload parser on the
    // keyed path too.
    bytes[64] = 1;
    for (size_t i = 65; i < 72; ++i) bytes[i] = 0;
    const std::string_view header(bytes.data(), 72);
    const std::string_view payload(bytes.data() + moejit::kCacheEntryHeaderBytes,
                                   bytes.size() - moejit::kCacheEntryHeaderBytes);
    const moejit::Mac mac = fuzz_key().mac(header, payload);
    bytes.replace(72, mac.size(), reinterpret_cast<const char*>(mac.data()), mac.size());
    moejit::test::reseal(&bytes);
    check(bytes);
  }
  return 0;
}
