// One disk cache entry as bytes: encode a compiled module (cubin + everything needed to use it)
// behind a self-checking header, and parse such bytes back, rejecting anything that is not a
// complete entry for the expected key. Pure: no I/O, no logging, never throws.
//
// Layout (little-endian integers):
//   header (112 bytes)
//     0  magic           8 bytes "\x89MOEJIT\n" (binary, and catches text-mode mangling)
//     8  format version  u32, kCacheFormatVersion
//    12  header bytes    u32, 112
//    16  key             32 bytes, the lowercase hex cache key (echoed: a file must never be
//                        served for another key, the failure behind cupy#9830)
//    48  payload bytes   u64, exactly the bytes after the header
//    56  payload hash    u64, XXH3-64 of the payload
//    64  flags           u32, bit 0: authenticated (the MAC below is set); other bits 0
//    68  reserved        u32, 0
//    72  MAC             32 bytes, HMAC-SHA256 under the deployment's key (entry_mac.h) of bytes
//                        0..71 followed by the payload; all zero when not authenticated
//   104  header hash     u64, XXH3-64 of bytes 0..103
//   payload: a sequence of fields, each a u64 length + bytes, or a u32 count + that many fields:
//     target sm (u32 field), target ptx (u32 field), NVRTC version, options, name expressions,
//     lowered names, image, NVRTC log.
// The checksums catch damage; only the MAC proves who wrote the entry.
#pragma once

#include <cstddef>
#include <string>
#include <string_view>

#include "entry_mac.h"
#include "nvrtc_compiler.h"

namespace moejit {

constexpr size_t kCacheEntryHeaderBytes = 112;
// Where the checksums sit (tests reseal damaged entries with them).
constexpr size_t kCacheEntryPayloadHashOffset = 56;
constexpr size_t kCacheEntryHeaderHashOffset = 104;
// No module we build comes near this; a larger length field is corruption, rejected before any
// allocation.
constexpr size_t kCacheEntryMaxBytes = size_t{1} << 30;

// True when key is 32 lowercase hex digits (what cache_key() returns). Keys become file names, so
// anything else is refused before it reaches a path.
bool is_cache_key(std::string_view key);

// The complete entry for module under key (key must satisfy is_cache_key), authenticated under
// mac_key when one is given.
std::string encode_cache_entry(const std::string& key, const CompiledModule& module,
                               int format_version = -1 /* -1: kCacheFormatVersion */,
                               const MacKey* mac_key = nullptr);

// Parses bytes into *module if they are a complete, uncorrupted entry of the current format for
// expected_key and the metadata is self-consistent; otherwise false with the reason in *why. With
// mac_key, the entry must also be authenticated under it (checked before the payload is parsed);
// without, its MAC is not examined.
bool parse_cache_entry(std::string_view bytes, const std::string& expected_key,
                       CompiledModule* module, std::string* why, const MacKey* mac_key = nullptr);

}  // namespace moejit
