#include "entry_mac.h"

#include <fcntl.h>
#include <sodium.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <cstdio>
#include <cstring>
#include <stdexcept>

#include "error.h"

namespace moejit {
namespace {

// sodium_init() picks the fastest implementations for this CPU; it is thread-safe and idempotent.
void init_sodium() {
  static const int ready = sodium_init();
  if (ready < 0) throw std::runtime_error("libsodium could not be initialized");
}

std::string octal_mode(mode_t mode) {
  char text[8];
  std::snprintf(text, sizeof(text), "%04o", static_cast<unsigned>(mode & 07777));
  return text;
}

}  // namespace

MacKey::MacKey(std::string bytes, std::string file)
    : bytes_(std::move(bytes)), file_(std::move(file)) {
  init_sodium();
}

MacKey::~MacKey() {
  if (!bytes_.empty()) sodium_memzero(&bytes_[0], bytes_.size());
}

Mac MacKey::mac(std::string_view first, std::string_view second) const {
  crypto_auth_hmacsha256_state state;
  crypto_auth_hmacsha256_init(&state, reinterpret_cast<const unsigned char*>(bytes_.data()),
                              bytes_.size());
  crypto_auth_hmacsha256_update(&state, reinterpret_cast<const unsigned char*>(first.data()),
                                first.size());
  crypto_auth_hmacsha256_update(&state, reinterpret_cast<const unsigned char*>(second.data()),
                                second.size());
  Mac out{};
  crypto_auth_hmacsha256_final(&state, out.data());
  sodium_memzero(&state, sizeof(state));
  return out;
}

bool mac_equal(const unsigned char* a, const unsigned char* b) {
  static_assert(kMacBytes == 32, "crypto_verify_32 compares 32 bytes");
  return crypto_verify_32(a, b) == 0;
}

std::shared_ptr<const MacKey> read_mac_key_file(const std::string& path,
                                                const std::string& setting) {
  const std::string value = "\"" + path + "\"";
  const char* rule =
      "the cache key file must be a regular file owned by this user, with no permission for "
      "group or others (chmod 600), holding 16 to 4096 bytes";
  auto refuse = [&](const std::string& why) {
    invalid_argument(setting, value, why + "; " + rule);
  };
  // O_NONBLOCK: a FIFO named there must not hang the open.
  const int fd = open(path.c_str(), O_RDONLY | O_CLOEXEC | O_NOCTTY | O_NONBLOCK);
  if (fd < 0) refuse(std::string("cannot be opened: ") + std::strerror(errno));
  struct Closer {
    int fd;
    ~Closer() { close(fd); }
  } closer{fd};
  struct stat st {};
  if (fstat(fd, &st) != 0) refuse(std::string("cannot be examined: ") + std::strerror(errno));
  if (!S_ISREG(st.st_mode)) refuse("is not a regular file");
  if (st.st_uid != geteuid())
    refuse("is owned by uid " + std::to_string(st.st_uid) + ", not by this user (uid " +
           std::to_string(geteuid()) + ")");
  if ((st.st_mode & 077) != 0)
    refuse("is accessible to group or others (mode " + octal_mode(st.st_mode) + ")");
  if (st.st_size < static_cast<off_t>(kMacKeyMinBytes) ||
      st.st_size > static_cast<off_t>(kMacKeyMaxBytes))
    refuse("holds " + std::to_string(st.st_size) + " bytes");
  std::string bytes(static_cast<size_t>(st.st_size), '\0');
  size_t got = 0;
  while (got < bytes.size()) {
    const ssize_t n = read(fd, &bytes[got], bytes.size() - got);
    if (n < 0 && errno == EINTR) continue;
    if (n < 0) refuse(std::string("cannot be read: ") + std::strerror(errno));
    if (n == 0) break;
    got += static_cast<size_t>(n);
  }
  if (got != bytes.size()) refuse("changed while it was read");
  auto key = std::make_shared<const MacKey>(std::move(bytes), path);
  return key;
}

}  // namespace moejit
