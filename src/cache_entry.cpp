#include "cache_entry.h"

#include <algorithm>
#include <cstdint>
#include <cstring>

#define XXH_INLINE_ALL
#include <xxhash.h>

#include "cache_key.h"

namespace moejit {
namespace {

constexpr char kMagic[8] = {'\x89', 'M', 'O', 'E', 'J', 'I', 'T', '\n'};
constexpr size_t kKeyBytes = 32;
constexpr size_t kKeyOffset = 16, kPayloadBytesOffset = 48,
                 kPayloadHashOffset = kCacheEntryPayloadHashOffset, kFlagsOffset = 64,
                 kReservedOffset = 68, kMacOffset = 72,
                 kHeaderHashOffset = kCacheEntryHeaderHashOffset;
static_assert(kMacOffset + kMacBytes == kHeaderHashOffset, "header layout");
static_assert(kHeaderHashOffset + 8 == kCacheEntryHeaderBytes, "header layout");
constexpr uint32_t kFlagAuthenticated = 1;

void put_u32(std::string* out, uint32_t v) {
  for (int i = 0; i < 4; ++i) out->push_back(static_cast<char>((v >> (8 * i)) & 0xffu));
}
void put_u64(std::string* out, uint64_t v) {
  for (int i = 0; i < 8; ++i) out->push_back(static_cast<char>((v >> (8 * i)) & 0xffu));
}
uint64_t get_le(const char* p, int bytes) {
  uint64_t v = 0;
  for (int i = bytes - 1; i >= 0; --i) v = (v << 8) | static_cast<unsigned char>(p[i]);
  return v;
}
void put_field(std::string* out, std::string_view s) {
  put_u64(out, s.size());
  out->append(s.data(), s.size());
}
void put_list(std::string* out, const std::vector<std::string>& items) {
  put_u32(out, static_cast<uint32_t>(items.size()));
  for (const std::string& s : items) put_field(out, s);
}

// Bounds-checked reader over the payload: every length is compared with what is left before
// anything is allocated, so a huge or garbage length field is a clean rejection.
class Reader {
 public:
  explicit Reader(std::string_view bytes) : rest_(bytes) {}
  bool u32(uint32_t* v) {
    if (rest_.size() < 4) return false;
    *v = static_cast<uint32_t>(get_le(rest_.data(), 4));
    rest_.remove_prefix(4);
    return true;
  }
  bool field(std::string* s) {
    if (rest_.size() < 8) return false;
    const uint64_t n = get_le(rest_.data(), 8);
    rest_.remove_prefix(8);
    if (n > rest_.size()) return false;
    s->assign(rest_.data(), static_cast<size_t>(n));
    rest_.remove_prefix(static_cast<size_t>(n));
    return true;
  }
  bool list(std::vector<std::string>* items) {
    uint32_t n = 0;
    // Each item needs at least its 8-byte length: bounds the count before reserving.
    if (!u32(&n) || n > rest_.size() / 8) return false;
    items->resize(n);
    for (std::string& s : *items)
      if (!field(&s)) return false;
    return true;
  }
  bool done() const { return rest_.empty(); }

 private:
  std::string_view rest_;
};

bool fail(std::string* why, const std::string& reason) {
  if (why != nullptr) *why = reason;
  return false;
}

}  // namespace

bool is_cache_key(std::string_view key) {
  if (key.size() != kKeyBytes) return false;
  for (char c : key)
    if (!((c >= '0' && c <= '9') || (c >= 'a' && c <= 'f'))) return false;
  return true;
}

std::string encode_cache_entry(const std::string& key, const CompiledModule& module,
                               int format_version, const MacKey* mac_key) {
  std::string payload;
  payload.reserve(module.image.size() + module.log.size() + 1024);
  put_u32(&payload, static_cast<uint32_t>(module.target.sm));
  put_u32(&payload, module.target.ptx ? 1u : 0u);
  put_field(&payload, module.nvrtc_version);
  put_list(&payload, module.options);
  put_list(&payload, module.name_expressions);
  put_list(&payload, module.lowered_names);
  put_field(&payload, module.image);
  put_field(&payload, module.log);

  std::string out;
  out.reserve(kCacheEntryHeaderBytes + payload.size());
  out.append(kMagic, sizeof(kMagic));
  put_u32(&out, static_cast<uint32_t>(format_version < 0 ? kCacheFormatVersion : format_version));
  put_u32(&out, static_cast<uint32_t>(kCacheEntryHeaderBytes));
  std::string echoed = key;
  echoed.resize(kKeyBytes, '\0');
  out += echoed;
  put_u64(&out, payload.size());
  put_u64(&out, XXH3_64bits(payload.data(), payload.size()));
  put_u32(&out, mac_key != nullptr ? kFlagAuthenticated : 0u);
  put_u32(&out, 0);
  Mac mac{};
  if (mac_key != nullptr) mac = mac_key->mac(out, payload);
  out.append(reinterpret_cast<const char*>(mac.data()), mac.size());
  put_u64(&out, XXH3_64bits(out.data(), out.size()));
  out += payload;
  return out;
}

bool parse_cache_entry(std::string_view bytes, const std::string& expected_key,
                       CompiledModule* module, std::string* why, const MacKey* mac_key) {
  if (bytes.empty()) return fail(why, "empty file");
  if (bytes.size() < kCacheEntryHeaderBytes)
    return fail(why, "truncated header (" + std::to_string(bytes.size()) + " bytes)");
  const char* h = bytes.data();
  if (std::memcmp(h, kMagic, sizeof(kMagic)) != 0) return fail(why, "not a moejit cache entry");
  if (XXH3_64bits(h, kHeaderHashOffset) != get_le(h + kHeaderHashOffset, 8))
    return fail(why, "header checksum mismatch");
  const uint64_t version = get_le(h + 8, 4);
  if (version != static_cast<uint64_t>(kCacheFormatVersion))
    return fail(why, "format version " + std::to_string(version) + ", this library reads " +
                         std::to_string(kCacheFormatVersion));
  if (get_le(h + 12, 4) != kCacheEntryHeaderBytes) return fail(why, "unexpected header size");
  const std::string_view key(h + kKeyOffset, kKeyBytes);
  if (key != expected_key) return fail(why, "entry is for key " + std::string(key));
  const uint64_t payload_bytes = get_le(h + kPayloadBytesOffset, 8);
  const std::string_view payload = bytes.substr(kCacheEntryHeaderBytes);
  // The rename-only publish makes a short file impossible unless something else truncated it;
  // this check is what keeps such a file from reaching cuModuleLoadData (pytorch#156010).
  if (payload_bytes != payload.size())
    return fail(why, "payload is " + std::to_string(payload.size()) + " bytes, header says " +
                         std::to_string(payload_bytes));
  if (XXH3_64bits(payload.data(), payload.size()) != get_le(h + kPayloadHashOffset, 8))
    return fail(why, "payload checksum mismatch");
  const uint64_t flags = get_le(h + kFlagsOffset, 4);
  const unsigned char* mac = reinterpret_cast<const unsigned char*>(h + kMacOffset);
  if ((flags & ~uint64_t{kFlagAuthenticated}) != 0 || get_le(h + kReservedOffset, 4) != 0)
    return fail(why, "unknown header flags");
  if ((flags & kFlagAuthenticated) == 0 &&
      !std::all_of(mac, mac + kMacBytes, [](unsigned char c) { return c == 0; }))
    return fail(why, "a MAC without the flag that says it is set");
  // Authenticated before the payload is parsed: with a key, nothing a forger wrote is looked at.
  if (mac_key != nullptr) {
    if ((flags & kFlagAuthenticated) == 0)
      return fail(why, "it carries no MAC (written without a cache key), and a cache key is set");
    const Mac expected = mac_key->mac(bytes.substr(0, kMacOffset), payload);
    if (!mac_equal(expected.data(), mac))
      return fail(why, "its MAC does not match the cache key in " + mac_key->file() +
                           " (written with another key, or modified)");
  }

  CompiledModule m;
  Reader r(payload);
  uint32_t sm = 0, ptx = 0;
  if (!r.u32(&sm) || !r.u32(&ptx) || !r.field(&m.nvrtc_version) || !r.list(&m.options) ||
      !r.list(&m.name_expressions) || !r.list(&m.lowered_names) || !r.field(&m.image) ||
      !r.field(&m.log) || !r.done())
    return fail(why, "malformed payload");
  // Sanity of the metadata: a checksum only proves the writer's bytes arrived intact.
  if (sm == 0 || sm > 10000 || ptx > 1) return fail(why, "implausible target");
  m.target = Target{static_cast<int>(sm), ptx == 1};
  if (m.name_expressions.empty() || m.lowered_names.size() != m.name_expressions.size())
    return fail(why, "name expressions and lowered names do not match");
  for (const std::string& n : m.lowered_names)
    if (n.empty()) return fail(why, "empty lowered name");
  if (m.image.empty()) return fail(why, "empty image");
  if (m.target.ptx ? m.image.back() != '\0'
                   : m.image.compare(0, 4,
                                     "\x7f"
                                     "ELF") != 0)
    return fail(why, m.target.ptx ? "PTX image is not NUL-terminated" : "cubin is not ELF");
  bool arch_option = false;
  for (const std::string& o : m.options)
    if (o == "--gpu-architecture=" + m.target.name()) arch_option = true;
  if (!arch_option) return fail(why, "options do not build for " + m.target.name());
  if (module != nullptr) *module = std::move(m);
  return true;
}

}  // namespace moejit
