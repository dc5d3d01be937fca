// numpy.random.RandomState(seed) as Megatron's GPT dataset uses it: the legacy MT19937 seeded with an integer
// (the same initialisation as std::mt19937(seed)) and RandomState.shuffle, a Fisher-Yates pass from the end
// that draws each swap partner in [0, i] by masked rejection sampling ("random_interval"). Matching it bit for
// bit makes our document and shuffle indices equal to Megatron's for the same seed.
#pragma once

#include <cstdint>
#include <random>
#include <span>
#include <utility>

namespace moecore {

class NumpyRandomState {
 public:
  explicit NumpyRandomState(uint32_t seed) : engine_(seed) {}

  // Uniform integer in [0, max] (numpy's legacy random_interval).
  uint64_t interval(uint64_t max) {
    if (max == 0) return 0;
    uint64_t mask = max;
    for (int shift = 1; shift <= 32; shift *= 2) mask |= mask >> shift;  // smallest all-ones mask >= max
    uint64_t value = 0;
    if (max <= 0xffffffffULL) {
      do {
        value = engine_() & mask;
      } while (value > max);
    } else {
      do {
        const uint64_t high = engine_();  // numpy's mt19937_next64: first draw is the high word
        value = ((high << 32) | engine_()) & mask;
      } while (value > max);
    }
    return value;
  }

  // In-place RandomState.shuffle of a 1-D array.
  template <typename T>
  void shuffle(std::span<T> values) {
    for (size_t i = values.size(); i-- > 1;) {
      const uint64_t j = interval(i);
      std::swap(values[i], values[j]);
    }
  }

 private:
  std::mt19937 engine_;
};

}  // namespace moecore
