// A LayerNorm or RMSNorm over the last dimension, bound to its parameters.
#pragma once

#include <cstdint>

#include "moecore/model/config.h"
#include "moecore/model/param.h"
#include "moecore/tensor/tensor.h"

namespace moecore {

struct NormStats {
  Tensor mean_R;  // LayerNorm only
  Tensor rstd_R;
};

class NormModule {
 public:
  NormModule() = default;
  NormModule(Normalization kind, double eps, Param* weight, Param* bias)
      : kind_(kind), eps_(eps), weight_(weight), bias_(bias) {}

  // inp_RD, out_RD: [rows, D]
  NormStats forward(float* out_RD, const float* inp_RD, int64_t rows) const;
  // dinp_RD += d(out)/d(inp)^T dout_RD; parameter gradients accumulate.
  void backward(float* dinp_RD, const float* dout_RD, const float* inp_RD, const NormStats& stats, int64_t rows) const;

 private:
  Normalization kind_ = Normalization::kLayerNorm;
  double eps_ = 1e-5;
  Param* weight_ = nullptr;
  Param* bias_ = nullptr;  // LayerNorm only
};

}  // namespace moecore
