// Counter-based randomness: every draw is a pure function of its coordinates (seed, unit, tensor,
// element, step, ...), never of a generator's history, so results do not depend on how work is
// split or ordered.
#pragma once

#include <cmath>
#include <cstdint>
#include <initializer_list>
#include <string_view>

namespace zinf::gpt::detail {

// splitmix64's finaliser: a bijection of 64-bit words with good avalanche.
inline uint64_t mix64(uint64_t x) {
  x += 0x9e3779b97f4a7c15ull;
  x = (x ^ (x >> 30)) * 0xbf58476d1ce4e5b9ull;
  x = (x ^ (x >> 27)) * 0x94d049bb133111ebull;
  return x ^ (x >> 31);
}

inline uint64_t hash_words(std::initializer_list<uint64_t> words) {
  uint64_t h = 0x243f6a8885a308d3ull;
  for (uint64_t w : words) h = mix64(h ^ w);
  return h;
}

// FNV-1a of a name, to key draws by tensor name.
inline uint64_t hash_name(std::string_view s) {
  uint64_t h = 0xcbf29ce484222325ull;
  for (unsigned char c : s) h = (h ^ c) * 0x100000001b3ull;
  return h;
}

// Uniform in (0, 1) from the top 53 bits.
inline double unit_interval(uint64_t h) { return (static_cast<double>(h >> 11) + 0.5) * 0x1p-53; }

// A standard normal from one hash (Box-Muller, cosine branch).
inline double normal_from_hash(uint64_t h) {
  const double u1 = unit_interval(h);
  const double u2 = unit_interval(mix64(h));
  return std::sqrt(-2.0 * std::log(u1)) * std::cos(6.283185307179586 * u2);
}

}  // namespace zinf::gpt::detail
