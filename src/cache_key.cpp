#include "cache_key.h"

#include <cstdio>

#define XXH_INLINE_ALL
#include <xxhash.h>

#include "moejit/moejit.h"

namespace moejit {
namespace {

// Length-prefixed fields: "ab"+"c" and "a"+"bc" must hash differently.
class KeyBuilder {
 public:
  KeyBuilder() : state_(XXH3_createState()) { XXH3_128bits_reset(state_); }
  ~KeyBuilder() { XXH3_freeState(state_); }
  KeyBuilder(const KeyBuilder&) = delete;
  KeyBuilder& operator=(const KeyBuilder&) = delete;

  void add(const std::string& field) {
    const unsigned long long n = field.size();
    XXH3_128bits_update(state_, &n, sizeof(n));
    XXH3_128bits_update(state_, field.data(), field.size());
  }
  std::string hex() const {
    const XXH128_hash_t h = XXH3_128bits_digest(state_);
    char buf[33];
    std::snprintf(buf, sizeof(buf), "%016llx%016llx", static_cast<unsigned long long>(h.high64),
                  static_cast<unsigned long long>(h.low64));
    return buf;
  }

 private:
  XXH3_state_t* state_;
};

}  // namespace

std::string cache_key(const CompileRequest& request, const std::string& nvrtc_version,
                      int format_version) {
  KeyBuilder k;
  k.add("libmoejit-cache-key");
  k.add(std::to_string(format_version));
  k.add(moejit_version_string());
  k.add(nvrtc_version);
  k.add(request.target.name());
  k.add(std::to_string(request.options.size()));
  for (const std::string& o : request.options) k.add(o);
  k.add(std::to_string(request.name_expressions.size()));
  for (const std::string& e : request.name_expressions) k.add(e);
  k.add(request.source);
  k.add(std::to_string(request.headers.size()));
  for (const auto& [name, bytes] : request.headers) {
    k.add(name);
    k.add(bytes);
  }
  return k.hex();
}

std::string cache_key(const CompileRequest& request) {
  return cache_key(request, nvrtc_version(), kCacheFormatVersion);
}

}  // namespace moejit
