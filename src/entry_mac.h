// Authenticated cache entries: the deployment's secret key and HMAC-SHA256 under it (libsodium).
// A cache that others can write (a shared volume, an image layer) is only as trustworthy as its
// least trusted writer; with a key, an entry is served only if it was written by a holder of the
// key (docs/cache.md states the threat model).
//
// The key file rule (MOEJIT_CACHE_KEY_FILE, options->cache_key_file, moejit-precompile
// --cache-key-file): a regular file (a symlink to one is followed), owned by the user the process
// runs as (its effective uid), with no permission bit for group or others (mode 0600 or 0400),
// holding 16 to 4096 bytes, all of which are the key.
#pragma once

#include <array>
#include <cstddef>
#include <memory>
#include <string>
#include <string_view>

namespace moejit {

constexpr size_t kMacBytes = 32;
constexpr size_t kMacKeyMinBytes = 16;
constexpr size_t kMacKeyMaxBytes = 4096;

using Mac = std::array<unsigned char, kMacBytes>;

class MacKey {
 public:
  // bytes: the key itself; file: where it came from, for messages.
  MacKey(std::string bytes, std::string file);
  ~MacKey();  // wipes the key from memory
  MacKey(const MacKey&) = delete;
  MacKey& operator=(const MacKey&) = delete;

  // HMAC-SHA256 of first followed by second.
  Mac mac(std::string_view first, std::string_view second) const;
  const std::string& file() const { return file_; }

 private:
  std::string bytes_;
  std::string file_;
};

// Constant-time comparison (a forger learns nothing from how long a rejection took).
bool mac_equal(const unsigned char* a, const unsigned char* b);

// Reads the key file at path under the rule above. Throws Error(MOEJIT_ERROR_INVALID_ARGUMENT)
// naming `setting` (the option or variable that gave the path), the path and the rule broken.
std::shared_ptr<const MacKey> read_mac_key_file(const std::string& path,
                                                const std::string& setting);

}  // namespace moejit
