// Random bits for stochastic rounding from moecore's counter-based Philox (tensor/rng.h): the bits of element
// `index` depend only on (seed, stream key, index), never on thread count or parallel layout, so a quantization
// is reproducible. TE draws its bits from curand's Philox per CUDA thread (cast/nvfp4/core_nvfp4.cuh get_rbits),
// an order no CPU layout can reproduce; the rounding rule that consumes them is TE's (fp8_formats.h).
#pragma once

#include <cstdint>

namespace moecore::quant {

// Byte (index % 16) of the 128 bits Philox4x32-10(seed, key, index / 16) returns, bytes numbered little-endian
// within words 0..3.
uint8_t random_byte(uint64_t seed, uint64_t key, uint64_t index);

// Stream keys of NVFP4's row-wise and column-wise quantizations (separate streams, as TE's separate rng states).
uint64_t rowwise_rounding_key();
uint64_t columnwise_rounding_key();

}  // namespace moecore::quant
