// A QuantizedTensor held in tracked tensors, the form a linear layer saves its input in for the weight gradient
// (TransformerEngine's Linear saves the input quantized for the column-wise usage: module/linear.py sets
// input_quantizer.set_usage(columnwise=backward_needs_input) and saves inputmat for backward). FP8 codes take one
// byte an element, E2M1 codes two to a byte (low nibble first, as TE's NVFP4 data); the block scales are kept as TE
// keeps them: their E8M0 / E4M3 bytes (MXFP8, NVFP4), else fp32 decode scales (per-tensor: one; blockwise: one per
// 1x128 block).
#pragma once

#include <cstdint>

#include "moecore/quant/quantized_tensor.h"
#include "moecore/tensor/tensor.h"

namespace moecore::quant {

struct PackedQuantizedTensor {
  QuantizedTensor meta;  // everything but the codes and scales (its vectors empty)
  Tensor codes;          // kU8
  Tensor scales;         // kU8 scale bytes where the format has them, else kF32 decode scales

  bool defined() const { return codes.defined(); }
  int64_t bytes() const;  // codes + scales
};

// Moves q's codes and scales into tensors on `device` under `category`.
PackedQuantizedTensor pack(QuantizedTensor q, Device device, MemCategory category);
// The QuantizedTensor again, bit for bit (scales decoded from their bytes as the quantizers decode them).
QuantizedTensor unpack(const PackedQuantizedTensor& p);

}  // namespace moecore::quant
