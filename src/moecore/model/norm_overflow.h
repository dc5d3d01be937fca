// A norm whose statistics overflowed: finite input rows whose sum of squares (LayerNorm: variance) is beyond the
// range of the activations' type, so rstd = 1 / sqrt(Inf) = 0 and the norm outputs zeros (plus its bias). Nothing
// after it is non-finite (the loss becomes ln V, the gradients zero), so the non-finite checks of the loss and the
// gradient norm never see it: the norms record it here and the training step, evaluation and generation stop on it.
#pragma once

#include <optional>
#include <string>

#include "moecore/tensor/dtype.h"

namespace moecore {

struct NormOverflow {
  int module = 0;              // Param::module of the norm: 0..L-1 its decoder layer, L the final norm
  std::string name;            // the parameters' prefix: "decoder.layers.1.input_layernorm"
  bool layernorm = false;      // LayerNorm (the variance overflowed) or RMSNorm (the sum of squares)
  DType dtype = DType::kF32;   // the type the statistics were computed in
  double largest_input = 0.0;  // the largest |x| of the rows that overflowed
};

// "decoder.layers.1.input_layernorm's sum of squares overflowed fp32 (input rows with |x| up to 3.4e+20)"
std::string describe_norm_overflow(const NormOverflow& overflow);

// The first overflow in model order since the last take(): the lowest module, in it the first recorded (forward
// order). Not thread-safe: a model's forwards run one after the other.
class NormOverflowLog {
 public:
  void record(NormOverflow overflow);
  std::optional<NormOverflow> take();

 private:
  std::optional<NormOverflow> first_;
};

}  // namespace moecore
