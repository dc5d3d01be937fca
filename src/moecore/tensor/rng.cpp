#include "moecore/tensor/rng.h"

#include <cmath>
#include <numbers>

namespace moecore {

uint64_t stream_key(const std::string_view name) {
  uint64_t hash = 14695981039346656037ull;
  for (const char c : name) {
    hash ^= static_cast<uint8_t>(c);
    hash *= 1099511628211ull;
  }
  return hash;
}

std::array<uint32_t, 4> philox4x32(const uint64_t seed, const uint64_t key, const uint64_t counter) {
  constexpr uint32_t kMul0 = 0xD2511F53u, kMul1 = 0xCD9E8D57u;
  constexpr uint32_t kWeyl0 = 0x9E3779B9u, kWeyl1 = 0xBB67AE85u;
  std::array<uint32_t, 4> ctr = {static_cast<uint32_t>(counter), static_cast<uint32_t>(counter >> 32),
                                 static_cast<uint32_t>(key), static_cast<uint32_t>(key >> 32)};
  uint32_t k0 = static_cast<uint32_t>(seed), k1 = static_cast<uint32_t>(seed >> 32);
  for (int round = 0; round < 10; ++round) {
    const uint64_t p0 = static_cast<uint64_t>(kMul0) * ctr[0];
    const uint64_t p1 = static_cast<uint64_t>(kMul1) * ctr[2];
    ctr = {static_cast<uint32_t>(p1 >> 32) ^ ctr[1] ^ k0, static_cast<uint32_t>(p1),
           static_cast<uint32_t>(p0 >> 32) ^ ctr[3] ^ k1, static_cast<uint32_t>(p0)};
    k0 += kWeyl0;
    k1 += kWeyl1;
  }
  return ctr;
}

float CounterRng::uniform(const uint64_t index) const {
  return static_cast<float>(philox4x32(seed_, key_, index)[0] >> 8) * (1.0f / 16777216.0f);
}

double CounterRng::normal(const uint64_t index) const {
  const auto words = philox4x32(seed_, key_, index);
  const uint64_t a = (static_cast<uint64_t>(words[0]) << 21) | (words[1] >> 11);
  const double u1 = (static_cast<double>(a & ((1ull << 53) - 1)) + 1.0) / 9007199254740993.0;  // (0, 1]
  const double u2 = static_cast<double>(words[2]) / 4294967296.0;
  return std::sqrt(-2.0 * std::log(u1)) * std::cos(2.0 * std::numbers::pi * u2);
}

}  // namespace moecore
