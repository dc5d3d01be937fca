#include "moecore/quant/hadamard.h"

#include <bit>
#include <stdexcept>
#include <string>

#include "moecore/tensor/rng.h"

namespace moecore::quant {
namespace {

bool hadamard_negative(const int64_t i, const int64_t j) {
  return (std::popcount(static_cast<uint64_t>(i & j)) & 1) != 0;
}

void check_cols(const int64_t cols) {
  if (cols % kRhtSize != 0) {
    throw std::invalid_argument("the random Hadamard transform needs rows of a multiple of 16 elements, got " +
                                std::to_string(cols));
  }
}

}  // namespace

RhtSigns te_rht_signs() { return {1, 1, 1, -1, 1, -1, -1, -1, -1, -1, -1, 1, -1, 1, -1, -1}; }

RhtSigns rht_signs_from_seed(const uint64_t seed) {
  RhtSigns signs{};
  const uint64_t key = stream_key("quant.rht_signs");
  for (int64_t i = 0; i < kRhtSize; ++i)
    signs[i] = (philox4x32(seed, key, static_cast<uint64_t>(i))[0] & 1u) ? -1.0f : 1.0f;
  return signs;
}

void rht_rows(const float* x, const int64_t rows, const int64_t cols, const RhtSigns& signs, float* out) {
  check_cols(cols);
  const int64_t groups = rows * (cols / kRhtSize);
#pragma omp parallel for schedule(static) if (groups > 4096)
  for (int64_t g = 0; g < groups; ++g) {
    const float* in = x + g * kRhtSize;
    float* y = out + g * kRhtSize;
    for (int64_t j = 0; j < kRhtSize; ++j) {
      float acc = 0.0f;
      for (int64_t i = 0; i < kRhtSize; ++i) {
        const bool negative = hadamard_negative(i, j) != (signs[i] < 0.0f);
        acc += negative ? -in[i] : in[i];
      }
      y[j] = acc * 0.25f;
    }
  }
}

void inverse_rht_rows(const float* y, const int64_t rows, const int64_t cols, const RhtSigns& signs, float* out) {
  check_cols(cols);
  const int64_t groups = rows * (cols / kRhtSize);
#pragma omp parallel for schedule(static) if (groups > 4096)
  for (int64_t g = 0; g < groups; ++g) {
    const float* in = y + g * kRhtSize;
    float* x = out + g * kRhtSize;
    for (int64_t i = 0; i < kRhtSize; ++i) {
      float acc = 0.0f;
      for (int64_t j = 0; j < kRhtSize; ++j) acc += hadamard_negative(i, j) ? -in[j] : in[j];
      x[i] = signs[i] < 0.0f ? -(acc * 0.25f) : acc * 0.25f;
    }
  }
}

}  // namespace moecore::quant
