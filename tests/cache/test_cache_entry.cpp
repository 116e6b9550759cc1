// The entry parser on its own: a round trip, and every kind of damage rejected. Truncated files
// must never parse (pytorch#156010), nor an entry for another key (cupy#9830).
#include <gtest/gtest.h>

#include <cstring>

#include "cache_entry.h"
#include "cache_key.h"
#include "entry_samples.h"

namespace moejit {
namespace {

using test::put_u64;
using test::reseal;
using test::sample_key;
using test::sample_module;
constexpr size_t kHeader = kCacheEntryHeaderBytes;
bool parses(const std::string& bytes, std::string* why = nullptr) {
  CompiledModule m;
  std::string ignored;
  return parse_cache_entry(bytes, sample_key(), &m, why != nullptr ? why : &ignored);
}

TEST(CacheEntry, RoundTrips) {
  const CompiledModule in = sample_module();
  const std::string bytes = encode_cache_entry(sample_key(), in);
  CompiledModule out;
  std::string why;
  ASSERT_TRUE(parse_cache_entry(bytes, sample_key(), &out, &why)) << why;
  EXPECT_EQ(out.target, in.target);
  EXPECT_EQ(out.image, in.image);
  EXPECT_EQ(out.name_expressions, in.name_expressions);
  EXPECT_EQ(out.lowered_names, in.lowered_names);
  EXPECT_EQ(out.options, in.options);
  EXPECT_EQ(out.nvrtc_version, in.nvrtc_version);
  EXPECT_EQ(out.log, in.log);
  EXPECT_EQ(bytes.compare(0, 8, "\x89MOEJIT\n"), 0);
}

TEST(CacheEntry, PtxRoundTrips) {
  CompiledModule in = sample_module();
  in.target = Target{120, true};
  in.options[1] = "--gpu-architecture=compute_120";
  in.image = std::string(".version 9.0\n.target sm_120\n") + '\0';
  CompiledModule out;
  std::string why;
  ASSERT_TRUE(parse_cache_entry(encode_cache_entry(sample_key(), in), sample_key(), &out, &why))
      << why;
  EXPECT_TRUE(out.target.ptx);
}

TEST(CacheEntry, EveryTruncationIsRejected) {
  const std::string bytes = encode_cache_entry(sample_key(), sample_module());
  for (size_t n = 0; n < bytes.size(); ++n)
    EXPECT_FALSE(parses(bytes.substr(0, n))) << "truncated to " << n << " bytes";
}

TEST(CacheEntry, EverySingleByteFlipIsRejected) {
  const std::string bytes = encode_cache_entry(sample_key(), sample_module());
  for (size_t at = 0; at < bytes.size(); ++at) {
    std::string damaged = bytes;
    damaged[at] = static_cast<char>(damaged[at] ^ 0x20);
    EXPECT_FALSE(parses(damaged)) << "byte " << at;
  }
}

TEST(CacheEntry, EmptyGarbageAndTrailingBytesAreRejected) {
  std::string why;
  EXPECT_FALSE(parses("", &why));
  EXPECT_EQ(why, "empty file");
  EXPECT_FALSE(parses(std::string(4096, '\0')));
  std::string garbage;
  for (int i = 0; i < 5000; ++i) garbage.push_back(static_cast<char>(i * 131 + 7));
  EXPECT_FALSE(parses(garbage));
  EXPECT_FALSE(parses(encode_cache_entry(sample_key(), sample_module()) + "x"));
}

TEST(CacheEntry, HugeLengthFieldsAreRejectedWithoutAllocating) {
  const std::string good = encode_cache_entry(sample_key(), sample_module());
  std::string huge = good;
  put_u64(&huge, 48, ~0ull >> 1);  // payload length
  reseal(&huge);
  std::string why;
  EXPECT_FALSE(parses(huge, &why));
  EXPECT_NE(why.find("header says"), std::string::npos) << why;

  // A field length inside the payload (the NVRTC version's, after sm and ptx): a consistent
  // header and checksum, so only the bounds check stands between it and a huge allocation.
  std::string field = good;
  put_u64(&field, kHeader + 8, ~0ull);
  reseal(&field);
  EXPECT_FALSE(parses(field, &why));
  EXPECT_EQ(why, "malformed payload");
  // A huge list count.
  std::string count = good;
  const size_t options_at = kHeader + 8 + 8 + sample_module().nvrtc_version.size();
  for (int i = 0; i < 4; ++i) count[options_at + static_cast<size_t>(i)] = '\xff';
  reseal(&count);
  EXPECT_FALSE(parses(count, &why));
}

TEST(CacheEntry, WrongKeyIsRejected) {
  const std::string other = "fedcba9876543210fedcba9876543210";
  std::string why;
  EXPECT_FALSE(parses(encode_cache_entry(other, sample_module()), &why));
  EXPECT_NE(why.find(other), std::string::npos) << why;
}

TEST(CacheEntry, OtherFormatVersionsAreRejected) {
  std::string why;
  EXPECT_FALSE(
      parses(encode_cache_entry(sample_key(), sample_module(), kCacheFormatVersion + 1), &why));
  EXPECT_NE(why.find("format version"), std::string::npos) << why;
  EXPECT_FALSE(parses(encode_cache_entry(sample_key(), sample_module(), 0)));
}

TEST(CacheEntry, InconsistentMetadataIsRejected) {
  auto rejects = [](CompiledModule m, const char* what) {
    EXPECT_FALSE(parses(encode_cache_entry(sample_key(), m))) << what;
  };
  CompiledModule m = sample_module();
  m.lowered_names.pop_back();
  rejects(m, "fewer lowered names than name expressions");
  m = sample_module();
  m.name_expressions.clear();
  m.lowered_names.clear();
  rejects(m, "no kernels");
  m = sample_module();
  m.lowered_names[0].clear();
  rejects(m, "empty lowered name");
  m = sample_module();
  m.image.clear();
  rejects(m, "empty image");
  m = sample_module();
  m.image[0] = 'x';
  rejects(m, "cubin without ELF magic");
  m = sample_module();
  m.target.ptx = true;
  rejects(m, "PTX without NUL and options for sm_90");
  m = sample_module();
  m.target.sm = 80;
  rejects(m, "options build for another arch");
  m = sample_module();
  m.target.sm = 0;
  rejects(m, "no arch");
}

// Each check stands on its own: an entry whose checksums are right (a foreign writer, or one with
// a bug) but whose content is wrong in one way only is rejected, for that reason. (Damage that
// also breaks a checksum is rejected by the checksum first: the tests above.)
TEST(CacheEntry, EachCheckRejectsOnItsOwn) {
  const std::string good = encode_cache_entry(sample_key(), sample_module());
  auto reason = [](const std::string& bytes) {
    std::string why;
    EXPECT_FALSE(parses(bytes, &why));
    return why;
  };
  std::string e = good;
  e[1] = 'X';  // magic "\x89XOEJIT\n"
  reseal(&e);
  EXPECT_EQ(reason(e), "not a moejit cache entry");
  e = good;
  e[12] = 80;  // header size
  reseal(&e);
  EXPECT_EQ(reason(e), "unexpected header size");
  e = good + "x";  // a byte past the last field, inside the payload the header declares
  put_u64(&e, 48, e.size() - kHeader);
  reseal(&e);
  EXPECT_EQ(reason(e), "malformed payload");
  e = good;
  e[kHeader + 4] = 2;  // the ptx flag: 0 or 1
  reseal(&e);
  EXPECT_EQ(reason(e), "implausible target");

  auto rejected_for = [&](const CompiledModule& m) {
    return reason(encode_cache_entry(sample_key(), m));
  };
  CompiledModule m = sample_module();  // an arch of 0, with options that build for it
  m.target.sm = 0;
  m.options[1] = "--gpu-architecture=sm_0";
  EXPECT_EQ(rejected_for(m), "implausible target");
  m.target.sm = 100000;
  m.options[1] = "--gpu-architecture=sm_100000";
  EXPECT_EQ(rejected_for(m), "implausible target");
  m = sample_module();  // PTX for the arch its options name, without the terminating NUL
  m.target.ptx = true;
  m.options[1] = "--gpu-architecture=compute_90";
  m.image = ".version 9.0\n.target sm_90\n";
  EXPECT_EQ(rejected_for(m), "PTX image is not NUL-terminated");
  m.image.clear();
  EXPECT_EQ(rejected_for(m), "empty image");
  m = sample_module();
  m.image.clear();
  EXPECT_EQ(rejected_for(m), "empty image");
  m = sample_module();
  m.image =
      "\x7f"
      "EL";
  EXPECT_EQ(rejected_for(m), "cubin is not ELF");
  m = sample_module();
  m.options[1] = "--gpu-architecture=sm_900";
  EXPECT_EQ(rejected_for(m), "options do not build for sm_90");
  m = sample_module();
  m.lowered_names[1].clear();
  EXPECT_EQ(rejected_for(m), "empty lowered name");
}

// Authenticated entries (a cache key configured): the MAC covers the header and the payload, so
// that whoever can write the cache but lacks the key cannot make an entry the runtime serves, even
// with both checksums recomputed (they are unkeyed, and only catch damage).
TEST(CacheEntry, AuthenticatedRoundTrips) {
  const auto key = test::sample_mac_key();
  const std::string bytes = encode_cache_entry(sample_key(), sample_module(), -1, key.get());
  CompiledModule out;
  std::string why;
  ASSERT_TRUE(parse_cache_entry(bytes, sample_key(), &out, &why, key.get())) << why;
  EXPECT_EQ(out.image, sample_module().image);
  // Without a key the MAC is not examined: the entry serves as any other.
  EXPECT_TRUE(parse_cache_entry(bytes, sample_key(), &out, &why)) << why;
  // Deterministic: the same module and key give the same bytes (a rebuild writes the same file).
  EXPECT_EQ(encode_cache_entry(sample_key(), sample_module(), -1, key.get()), bytes);
}

TEST(CacheEntry, WithAKeyOnlyEntriesAuthenticatedUnderItAreAccepted) {
  const auto key = test::sample_mac_key('k'), other = test::sample_mac_key('o');
  CompiledModule out;
  std::string why;
  const std::string plain = encode_cache_entry(sample_key(), sample_module());
  EXPECT_FALSE(parse_cache_entry(plain, sample_key(), &out, &why, key.get()));
  EXPECT_NE(why.find("carries no MAC"), std::string::npos) << why;
  const std::string foreign = encode_cache_entry(sample_key(), sample_module(), -1, other.get());
  EXPECT_FALSE(parse_cache_entry(foreign, sample_key(), &out, &why, key.get()));
  EXPECT_NE(why.find("MAC does not match the cache key in test-key"), std::string::npos) << why;
}

// The forgery of the audit: another cubin in a valid entry, both checksums recomputed. Without a
// key it is served (the checksums cannot tell); with one it never is, whichever byte was changed.
TEST(CacheEntry, AForgedEntryIsRejectedWhateverByteChanged) {
  const auto key = test::sample_mac_key();
  const std::string good = encode_cache_entry(sample_key(), sample_module(), -1, key.get());
  std::string forged = good;
  const size_t image = good.find(
      "\x7f"
      "ELF");
  ASSERT_NE(image, std::string::npos);
  forged[image + 10] = static_cast<char>(forged[image + 10] ^ 0x40);  // another cubin
  reseal(&forged);
  CompiledModule out;
  std::string why;
  EXPECT_TRUE(parse_cache_entry(forged, sample_key(), &out, &why)) << why;
  EXPECT_FALSE(parse_cache_entry(forged, sample_key(), &out, &why, key.get()));
  EXPECT_NE(why.find("MAC does not match"), std::string::npos) << why;
  for (size_t at = 0; at < good.size(); ++at) {
    // The checksums themselves: resealing writes them back.
    if ((at >= kCacheEntryPayloadHashOffset && at < kCacheEntryPayloadHashOffset + 8) ||
        (at >= kCacheEntryHeaderHashOffset && at < kCacheEntryHeaderBytes))
      continue;
    std::string damaged = good;
    damaged[at] = static_cast<char>(damaged[at] ^ 0x20);
    reseal(&damaged);
    EXPECT_FALSE(parse_cache_entry(damaged, sample_key(), &out, &why, key.get())) << "byte " << at;
  }
}

TEST(CacheEntry, UnknownFlagsAndAStrayMacAreRejected) {
  const std::string good = encode_cache_entry(sample_key(), sample_module());
  std::string why;
  std::string e = good;
  e[64] = 2;  // a flag no version defines
  reseal(&e);
  EXPECT_FALSE(parses(e, &why));
  EXPECT_EQ(why, "unknown header flags");
  e = good;
  e[68] = 1;  // reserved
  reseal(&e);
  EXPECT_FALSE(parses(e, &why));
  EXPECT_EQ(why, "unknown header flags");
  e = good;
  e[80] = 1;  // MAC bytes, but no flag saying they are set
  reseal(&e);
  EXPECT_FALSE(parses(e, &why));
  EXPECT_EQ(why, "a MAC without the flag that says it is set");
}

TEST(CacheEntry, KeysAreHexOnly) {
  EXPECT_TRUE(is_cache_key(sample_key()));
  EXPECT_FALSE(is_cache_key(""));
  EXPECT_FALSE(is_cache_key("../../../../etc/passwd0123456789a"));
  EXPECT_FALSE(is_cache_key("0123456789ABCDEF0123456789abcdef"));
  EXPECT_FALSE(is_cache_key(sample_key() + "0"));
}

}  // namespace
}  // namespace moejit
