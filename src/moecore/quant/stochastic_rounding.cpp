#include "moecore/quant/stochastic_rounding.h"

#include "moecore/tensor/rng.h"

namespace moecore::quant {

uint8_t random_byte(const uint64_t seed, const uint64_t key, const uint64_t index) {
  const auto words = philox4x32(seed, key, index / 16);
  const uint64_t byte = index % 16;
  return static_cast<uint8_t>(words[byte / 4] >> (8 * (byte % 4)));
}

uint64_t rowwise_rounding_key() { return stream_key("quant.nvfp4.stochastic_rounding.rowwise"); }
uint64_t columnwise_rounding_key() { return stream_key("quant.nvfp4.stochastic_rounding.columnwise"); }

}  // namespace moecore::quant
