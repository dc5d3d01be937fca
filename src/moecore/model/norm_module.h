// A LayerNorm or RMSNorm over the last dimension, bound to its parameters.
#pragma once

#include <cstdint>
#include <string>
#include <utility>
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

class NormModule {
 public:
  // Registers `name`.weight [width] (ones) and, for LayerNorm, `name`.bias (zeros). grad_sum_over_tp: replicated
  // over TP while each rank sees part of the tokens or heads (Param::grad_sum_over_tp).
  static void add_params(std::vector<Param>& params, const std::string& name, int64_t width, Normalization kind,
                         bool grad_sum_over_tp, int module);
  // The norm over the parameters registered by add_params. overflow_log (may be null; not owned): where forward
  // records finite input rows whose statistics overflowed (model/norm_overflow.h).
  static NormModule bind(std::vector<Param>& params, const std::string& name, Normalization kind, double eps,
                         NormOverflowLog* overflow_log);

  NormModule() = default;
  NormModule(Normalization kind, double eps, Param* weight, Param* bias, std::string name = {},
             NormOverflowLog* overflow_log = nullptr)
      : kind_(kind), eps_(eps), weight_(weight), bias_(bias), name_(std::move(name)), overflow_log_(overflow_log) {}

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
