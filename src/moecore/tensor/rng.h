// Counter-based RNG (Philox-4x32-10). A value depends only on (seed, stream key, counter), never on call
// order, so a parameter shard initialised on any rank equals the same slice of the one-process tensor,
// and dropout masks can be regenerated in backward instead of stored.
#pragma once

#include <array>
#include <cstdint>
#include <string_view>

namespace moecore {

// 64-bit FNV-1a of a name: the stream key of a parameter.
uint64_t stream_key(std::string_view name);

// Four 32-bit words for counter `counter` of stream (seed, key).
std::array<uint32_t, 4> philox4x32(uint64_t seed, uint64_t key, uint64_t counter);

class CounterRng {
 public:
  CounterRng(uint64_t seed, uint64_t key) : seed_(seed), key_(key) {}
  // Uniform in [0, 1) for element `index` (24 random mantissa bits).
  float uniform(uint64_t index) const;
  // Standard normal for element `index` (Box-Muller on two 32-bit words, computed in double).
  double normal(uint64_t index) const;

 private:
  uint64_t seed_;
  uint64_t key_;
};

}  // namespace moecore
