// MXFP8 (OCP microscaling; TE's MXFP8BlockScaling): blocks of 32 consecutive elements along the stored data's last
// dimension, each with an E8M0 power-of-two scale; elements in E4M3 or E5M2.
#pragma once

#include <cstdint>

#include "moecore/quant/quantized_tensor.h"
#include "moecore/quant/recipe.h"

namespace moecore::quant {

// Per block (transformer_engine/common/cast/mxfp8/quantize_mxfp8.cuh): amax (NaN skipped), E8M0 code
// e = float_to_e8m0(amax * max_norm_rcp) with max_norm_rcp = fp32(1 / format max), i.e. 2^(e - 127) is the amax
// over the format max rounded up to a power of two; codes = fp8(x * 2^(127 - e)) (exp2f_rcp), decoded as
// code value * 2^(e - 127). TE's MXFP8 tensors need both dimensions divisible by 32 (MXFP8Quantizer
// .is_quantizable): other shapes throw std::invalid_argument.
QuantizedTensor quantize_mxfp8(const float* x, int64_t rows, int64_t cols, const QuantSpec& spec);

}  // namespace moecore::quant
