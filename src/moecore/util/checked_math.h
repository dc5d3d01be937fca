// Products of sizes derived from user input (shapes, bytes, samples, tokens): an overflow becomes std::overflow_error
// naming what was being computed, instead of a wrapped value that later allocates too little or loops forever.
#pragma once

#include <cstdint>
#include <stdexcept>
#include <string>
#include <string_view>

namespace moecore {

// a * b, or std::overflow_error("<what> overflows 64-bit integers (a x b)").
inline int64_t checked_mul(const int64_t a, const int64_t b, const std::string_view what) {
  int64_t product = 0;
  if (__builtin_mul_overflow(a, b, &product)) {
    throw std::overflow_error(std::string(what) + " overflows 64-bit integers (" + std::to_string(a) + " x " +
                              std::to_string(b) + ")");
  }
  return product;
}

}  // namespace moecore
