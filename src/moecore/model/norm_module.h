// A LayerNorm or RMSNorm over the last dimension.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "moecore/model/config.h"
#include "moecore/model/norm_overflow.h"
#include "moecore/model/param.h"
#include "moecore/tensor/tensor.h"

namespace moecore {

struct NormStats {
  Tensor mean_R;  // LayerNorm only
  Tensor rstd_R;
};

// How a norm is built: its kind and epsilon, how its parameters are reduced, where it records overflows.
struct NormOptions {
  Normalization kind = Normalization::kLayerNorm;
  double eps = 1e-5;
  // Replicated over TP while each rank sees part of the tokens or heads (Param::grad_sum_over_tp).
  bool grad_sum_over_tp = false;
  int module = -1;  // Param::module
  // Where forward records finite input rows whose statistics overflowed (model/norm_overflow.h); may be null; not
  // owned.
  NormOverflowLog* overflow_log = nullptr;
};

// The model's norm kind and epsilon (--normalization, --norm-epsilon) with the rest as given.
NormOptions norm_options(const ModelConfig& config, bool grad_sum_over_tp, int module, NormOverflowLog* overflow_log);

class NormModule {
 public:
  NormModule() = default;
  // Registers `name`.weight [width] (ones) and, for LayerNorm, `name`.bias (zeros) into params.
  NormModule(const std::string& name, int64_t width, const NormOptions& options, ParamStore& params);

  // inp_RD -> out_RD (overwrites), rows of width D = the weight's size.
  NormStats forward(Tensor& out_RD, const Tensor& inp_RD) const;
  // dinp_RD += d(out)/d(inp)^T dout_RD; parameter gradients accumulate.
  void backward(Tensor& dinp_RD, const Tensor& dout_RD, const Tensor& inp_RD, const NormStats& stats) const;

 private:
  void record_overflow(const Tensor& inp_RD, const Tensor& rstd_R) const;

  Normalization kind_ = Normalization::kLayerNorm;
  double eps_ = 1e-5;
  Param* weight_ = nullptr;
  Param* bias_ = nullptr;  // LayerNorm only
  std::string name_;       // the parameters' prefix
  NormOverflowLog* overflow_log_ = nullptr;
};

}  // namespace moecore
