#include "moecore/ops/quantization.h"

#include <array>
#include <atomic>
#include <bit>

#include "moecore/ops/scoped_state.h"

namespace moecore::ops {
namespace {

// Per device, so a second device's model can run with its own recipe.
std::array<std::atomic<const quant::QuantizedLinearConfig*>, 3> scoped_config{nullptr, nullptr, nullptr};

std::atomic<const quant::QuantizedLinearConfig*>& scoped_config_of(const Device device) {
  return scoped_config.at(static_cast<size_t>(device));
}

}  // namespace

const quant::QuantizedLinearConfig* linear_quantization(const Device device) { return scoped_config_of(device).load(); }

ScopedLinearQuantization::ScopedLinearQuantization(const quant::QuantizedLinearConfig* config, const Device device)
    : device_(device), previous_(scoped_config_of(device).exchange(config)) {}

ScopedLinearQuantization::~ScopedLinearQuantization() { scoped_config_of(device_) = previous_; }

namespace detail {

std::array<const quant::QuantizedLinearConfig*, 3> linear_quantization_state() {
  std::array<const quant::QuantizedLinearConfig*, 3> state{};
  for (size_t d = 0; d < state.size(); ++d) state[d] = scoped_config[d].load();
  return state;
}

void restore_linear_quantization_state(const std::array<const quant::QuantizedLinearConfig*, 3>& state) {
  for (size_t d = 0; d < state.size(); ++d) scoped_config[d] = state[d];
}

}  // namespace detail

uint64_t gradient_fingerprint(const float* data, const int64_t n) {
  // FNV-1a over the values' bit patterns and the count.
  uint64_t hash = 0xCBF29CE484222325ULL ^ static_cast<uint64_t>(n);
  for (int64_t i = 0; i < n; ++i) {
    hash = (hash ^ std::bit_cast<uint32_t>(data[i])) * 0x100000001B3ULL;
  }
  return hash;
}

uint64_t quantization_seed(const uint64_t base_seed, const uint64_t fingerprint) {
  // SplitMix64's finalizer over the pair.
  uint64_t z = base_seed + 0x9E3779B97F4A7C15ULL * (fingerprint + 1);
  z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ULL;
  z = (z ^ (z >> 27)) * 0x94D049BB133111EBULL;
  return z ^ (z >> 31);
}

int64_t quantization_row_multiple(const quant::Recipe recipe) {
  switch (recipe) {
    case quant::Recipe::kMxfp8: return 32;
    case quant::Recipe::kNvfp4: return 16;
    default: return 1;
  }
}

}  // namespace moecore::ops
