// The cache key changes when any single input of the compile changes and is stable otherwise: a
// hit must never return a binary built from another source, header, option, arch or compiler
// (cupy#9830).
#include <gtest/gtest.h>

#include <cstdio>

#define XXH_INLINE_ALL
#include <xxhash.h>

#include "cache_key.h"
#include "cache_test_util.h"
#include "kernel_store.h"
#include "moejit/moejit.h"

namespace moejit {
namespace {

class CacheKey : public ::testing::Test {
 protected:
  CacheKey() : store_(test::cache_settings("", MOEJIT_CACHE_MODE_DISABLED), stats_) {
    request_ = store_.request_for(test::small_spec(0), test::test_target());
    base_ = cache_key(request_, "13.0", kCacheFormatVersion);
  }
  std::string key(const CompileRequest& r) const {
    return cache_key(r, "13.0", kCacheFormatVersion);
  }
  Stats stats_;
  KernelStore store_;
  CompileRequest request_;
  std::string base_;
};

TEST_F(CacheKey, IsStableAndWellFormed) {
  EXPECT_EQ(base_.size(), 32u);
  EXPECT_EQ(base_.find_first_not_of("0123456789abcdef"), std::string::npos);
  EXPECT_EQ(key(store_.request_for(test::small_spec(0), test::test_target())), base_);
  Stats other_stats;
  KernelStore other(test::cache_settings("", MOEJIT_CACHE_MODE_DISABLED), other_stats);
  EXPECT_EQ(key(other.request_for(test::small_spec(0), test::test_target())), base_);
  EXPECT_EQ(cache_key(request_), cache_key(request_));
}

TEST_F(CacheKey, ChangesWithEveryTemplateByte) {
  ASSERT_FALSE(request_.headers.empty());
  for (auto& [name, bytes] : request_.headers) {
    ASSERT_FALSE(bytes.empty()) << name;
    for (size_t at : {size_t{0}, bytes.size() / 2, bytes.size() - 1}) {
      CompileRequest r = request_;
      r.headers[name][at] = static_cast<char>(r.headers[name][at] ^ 1);
      EXPECT_NE(key(r), base_) << name << " byte " << at;
    }
    CompileRequest appended = request_;
    appended.headers[name] += "\n";
    EXPECT_NE(key(appended), base_) << name;
  }
  CompileRequest renamed = request_;
  auto node = renamed.headers.extract(renamed.headers.begin());
  node.key() += "x";
  renamed.headers.insert(std::move(node));
  EXPECT_NE(key(renamed), base_);
  CompileRequest extra = request_;
  extra.headers["extra.cuh"] = "";
  EXPECT_NE(key(extra), base_);
}

TEST_F(CacheKey, ChangesWithSourceOptionsTargetAndNames) {
  CompileRequest r = request_;
  r.source[r.source.size() / 2] = static_cast<char>(r.source[r.source.size() / 2] ^ 1);
  EXPECT_NE(key(r), base_) << "source byte";

  r = request_;
  r.options.push_back("-lineinfo");
  EXPECT_NE(key(r), base_) << "extra option";
  r = request_;
  r.options.back() += "x";
  EXPECT_NE(key(r), base_) << "changed option";
  r = request_;
  std::swap(r.options.front(), r.options.back());
  EXPECT_NE(key(r), base_) << "option order";

  r = request_;
  r.target.sm = 89;
  EXPECT_NE(key(r), base_) << "arch";
  r = request_;
  r.target.ptx = true;
  EXPECT_NE(key(r), base_) << "PTX instead of cubin";
  EXPECT_NE(key(store_.request_for(test::small_spec(0), Target{80, false})), base_);

  r = request_;
  ASSERT_FALSE(r.name_expressions.empty());
  r.name_expressions[0] += " ";
  EXPECT_NE(key(r), base_) << "name expression";
  r = request_;
  r.name_expressions.push_back("other");
  EXPECT_NE(key(r), base_) << "extra name expression";

  EXPECT_NE(key(store_.request_for(test::small_spec(1), test::test_target())), base_) << "spec";
}

TEST_F(CacheKey, ChangesWithCompilerAndFormatVersion) {
  EXPECT_NE(cache_key(request_, "13.1", kCacheFormatVersion), base_);
  EXPECT_NE(cache_key(request_, "12.9", kCacheFormatVersion), base_);
  EXPECT_NE(cache_key(request_, "13.0", kCacheFormatVersion + 1), base_);
  EXPECT_EQ(cache_key(request_), cache_key(request_, nvrtc_version(), kCacheFormatVersion));
}

// The key is the XXH3-128 of its fields, each length-prefixed, in a fixed order (cache_key.h),
// all 128 bits in hex. Recomputed here from that description: the one way a test can see that the
// library version is among the fields (a test cannot change it), and that no bit of the hash is
// dropped or repeated.
TEST_F(CacheKey, IsTheHashOfEveryDocumentedField) {
  auto expected = [](const CompileRequest& r, const std::string& nvrtc, int format) {
    XXH3_state_t* state = XXH3_createState();
    XXH3_128bits_reset(state);
    auto add = [&](const std::string& field) {
      const unsigned long long n = field.size();
      XXH3_128bits_update(state, &n, sizeof(n));
      XXH3_128bits_update(state, field.data(), field.size());
    };
    add("libmoejit-cache-key");
    add(std::to_string(format));
    add(moejit_version_string());
    add(nvrtc);
    add(r.target.name());
    add(std::to_string(r.options.size()));
    for (const std::string& o : r.options) add(o);
    add(std::to_string(r.name_expressions.size()));
    for (const std::string& e : r.name_expressions) add(e);
    add(r.source);
    add(std::to_string(r.headers.size()));
    for (const auto& [name, bytes] : r.headers) {
      add(name);
      add(bytes);
    }
    const XXH128_hash_t h = XXH3_128bits_digest(state);
    XXH3_freeState(state);
    char hex[33];
    std::snprintf(hex, sizeof(hex), "%016llx%016llx", static_cast<unsigned long long>(h.high64),
                  static_cast<unsigned long long>(h.low64));
    return std::string(hex);
  };
  EXPECT_EQ(base_, expected(request_, "13.0", kCacheFormatVersion));
  EXPECT_EQ(key(store_.request_for(test::small_spec(1), Target{80, true})),
            expected(store_.request_for(test::small_spec(1), Target{80, true}), "13.0",
                     kCacheFormatVersion));
  EXPECT_NE(base_.substr(0, 16), base_.substr(16));
}

TEST_F(CacheKey, FieldBoundariesMatter) {
  // Moving a byte from the end of one field to the start of the next must change the key.
  CompileRequest a = request_, b = request_;
  a.options = {"ab", "c"};
  b.options = {"a", "bc"};
  EXPECT_NE(key(a), key(b));
  a = request_;
  b = request_;
  a.name_expressions.push_back("");
  EXPECT_NE(key(a), key(b));
}

}  // namespace
}  // namespace moejit
