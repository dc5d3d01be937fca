// Which of 16 doubles exceed a bound, as a bit mask: the block test of the router's streaming top-k (routing.cpp),
// which offers a block's values to its best k only where they beat the k-th best. One compare per vector register
// where the CPU has AVX-512 or AVX (picked at run time); every form gives the same mask.
#pragma once

#include <cstdint>

namespace moecore::kernels::cpu {

// Bit j set iff values[j] > bound, j < 16 (clear for NaN, as the comparison is).
uint32_t above_mask16_portable(const double* values, double bound);
uint32_t above_mask16_avx(const double* values, double bound);     // only where the CPU has AVX
uint32_t above_mask16_avx512(const double* values, double bound);  // only where the CPU has AVX-512F

// Which forms this CPU runs, and the fastest of them.
bool above_mask16_avx_usable();
bool above_mask16_avx512_usable();
using AboveMask16 = uint32_t (*)(const double* values, double bound);
AboveMask16 best_above_mask16();

}  // namespace moecore::kernels::cpu
