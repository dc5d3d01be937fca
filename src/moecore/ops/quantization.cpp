#include "moecore/ops/quantization.h"

#include <atomic>

namespace moecore::ops {
namespace {

std::atomic<const quant::QuantizedLinearConfig*> scoped_config{nullptr};
std::atomic<uint64_t> backward_calls{0};

}  // namespace

const quant::QuantizedLinearConfig* linear_quantization() { return scoped_config.load(); }

ScopedLinearQuantization::ScopedLinearQuantization(const quant::QuantizedLinearConfig* config)
    : previous_(scoped_config.exchange(config)) {}

ScopedLinearQuantization::~ScopedLinearQuantization() { scoped_config = previous_; }

uint64_t quantized_backward_calls() { return backward_calls.load(); }

uint64_t quantization_seed(const uint64_t base_seed, const uint64_t call_index) {
  // SplitMix64's finalizer over the pair: distinct, well-mixed seeds for consecutive calls.
  uint64_t z = base_seed + 0x9E3779B97F4A7C15ULL * (call_index + 1);
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

namespace detail {
uint64_t next_quantized_backward_call() { return backward_calls.fetch_add(1); }
}  // namespace detail

}  // namespace moecore::ops
