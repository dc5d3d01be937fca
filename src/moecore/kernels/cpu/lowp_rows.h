// Widening and narrowing of 16-bit values (the bf16 / fp16 bits of a LowpType) on the calling thread, through the
// fastest conversion path of this CPU (convert.h): exact widening, round-to-nearest-even narrowing. For kernels that
// run fp32 steps on 16-bit activations a row or a tile at a time.
#pragma once

#include <cstdint>

#include "moecore/kernels/cpu/convert.h"
#include "moecore/kernels/cpu/gemm_lowp.h"

namespace moecore::kernels::cpu {

class LowpRows {
 public:
  explicit LowpRows(const LowpType type) : type_(type), isa_(best_convert_isa()) {}
  void widen(float* out, const uint16_t* in, const int64_t n) const {
    type_ == LowpType::kBF16 ? decode_bf16(out, in, n, isa_) : decode_fp16(out, in, n, isa_);
  }
  void narrow(uint16_t* out, const float* in, const int64_t n) const {
    type_ == LowpType::kBF16 ? encode_bf16(out, in, n, isa_) : encode_fp16(out, in, n, isa_);
  }

 private:
  LowpType type_;
  ConvertIsa isa_;
};

}  // namespace moecore::kernels::cpu
