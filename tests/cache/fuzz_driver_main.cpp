// A main() for the fuzz target when libFuzzer is not used: random mutations (bit flips, byte
// overwrites, truncations, insertions, deletions, overwritten length fields) of a valid entry, for
// a bounded number of iterations or seconds: fuzz_cache_entry [iterations] [seconds] [seed].
// "fuzz_cache_entry --seed FILE" writes the valid entry to FILE, a seed for a libFuzzer corpus.
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <random>
#include <string>

#include "cache_entry.h"
#include "entry_samples.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size);

int main(int argc, char** argv) {
  if (argc == 3 && std::string(argv[1]) == "--seed") {
    const std::string valid =
        moejit::encode_cache_entry(moejit::test::sample_key(), moejit::test::sample_module());
    std::FILE* f = std::fopen(argv[2], "wb");
    if (f == nullptr || std::fwrite(valid.data(), 1, valid.size(), f) != valid.size()) return 1;
    return std::fclose(f) == 0 ? 0 : 1;
  }
  const long iterations = argc > 1 ? std::atol(argv[1]) : 200000;
  const double seconds = argc > 2 ? std::atof(argv[2]) : 20;
  const unsigned seed = argc > 3 ? static_cast<unsigned>(std::atol(argv[3])) : 12345u;
  std::mt19937_64 rng(seed);
  const std::string valid =
      moejit::encode_cache_entry(moejit::test::sample_key(), moejit::test::sample_module());
  auto below = [&](size_t n) { return n == 0 ? size_t{0} : static_cast<size_t>(rng() % n); };
  const auto deadline = std::chrono::steady_clock::now() + std::chrono::duration<double>(seconds);
  long done = 0;
  for (; done < iterations; ++done) {
    if ((done & 1023) == 0 && std::chrono::steady_clock::now() > deadline) break;
    std::string b = valid;
    const int edits = 1 + static_cast<int>(rng() % 4);
    for (int e = 0; e < edits; ++e) {
      switch (rng() % 7) {
        case 0:
          b[below(b.size())] ^= static_cast<char>(1u << (rng() % 8));
          break;
        case 1:
          b[below(b.size())] = static_cast<char>(rng());
          break;
        case 2:
          b.resize(below(b.size() + 1));
          break;
        case 3:
          b.insert(below(b.size() + 1), below(16) + 1, static_cast<char>(rng()));
          break;
        case 4:
          b.erase(below(b.size()), below(16) + 1);
          break;
        case 5: {  // a length or count field somewhere in the payload: small, huge or off by one
          if (b.size() < moejit::kCacheEntryHeaderBytes + 16) break;
          const size_t at =
              moejit::kCacheEntryHeaderBytes + below(b.size() - moejit::kCacheEntryHeaderBytes - 8);
          const uint64_t v = (rng() % 3 == 0)   ? rng()
                             : (rng() % 3 == 1) ? ~0ull >> below(64)
                                                : below(b.size());
          for (int i = 0; i < 8; ++i)
            b[at + static_cast<size_t>(i)] = static_cast<char>(v >> (8 * i));
          break;
        }
        default:
          b.append(below(32), static_cast<char>(rng()));
          break;
      }
      if (b.empty()) break;
    }
    LLVMFuzzerTestOneInput(reinterpret_cast<const uint8_t*>(b.data()), b.size());
  }
  // The untouched entry must still parse.
  moejit::CompiledModule m;
  std::string why;
  if (!moejit::parse_cache_entry(valid, moejit::test::sample_key(), &m, &why)) {
    std::fprintf(stderr, "valid entry rejected: %s\n", why.c_str());
    return 1;
  }
  std::printf("fuzz_cache_entry: %ld mutated entries parsed without fault\n", done);
  return 0;
}
