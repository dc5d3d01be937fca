#include "moecore/model/parallel_linear.h"

#include <stdexcept>

#include "moecore/model/config.h"
#include "moecore/ops/elementwise.h"
#include "moecore/ops/linear.h"
#include "moecore/ops/precision.h"
#include "moecore/ops/rows.h"
#include "moecore/parallel/process_group.h"

namespace moecore {
namespace {

void check_divisible(const std::string& name, const int64_t features, const int64_t parts, const char* what) {
  if (features % parts != 0) {
    throw ConfigError(name + ": " + std::to_string(features) + " " + what + " are not divisible by the " +
                      std::to_string(parts) + "-way tensor-parallel split");
  }
}

// The saved input the weight gradient reads: the quantized one where the forward kept it, else the tensor.
const Tensor* saved_input(const LinearActivations& saved) {
  return saved.input_q.defined() ? nullptr : &saved.input_TI;
}

// Keeps only the quantized input where the forward made one.
void drop_quantized_input(LinearActivations& saved) {
  if (saved.input_q.defined()) saved.input_TI = Tensor();
}

Param& register_param(ParamStore& params, Param p, const LinearOptions& options, const bool weight = false) {
  p.linear_weight = weight;
  p.is_expert = options.is_expert;
  p.module = options.module;
  return params.push_back(std::move(p));
}

}  // namespace

ColumnParallelLinear::ColumnParallelLinear(const std::string& name, const int64_t in_features,
                                           const int64_t out_features, const TensorParallel& tp,
                                           const LinearOptions& options, ParamStore& params)
    : tp_(options.explicit_expert_comm ? TensorParallel(tp.group(), false) : tp), options_(options) {
  const int n = tp.size();
  check_divisible(name, out_features, static_cast<int64_t>(n) * options.segments, "output features");
  out_local_ = out_features / n;
  if (options.shared_weight.empty()) {
    const ParamShard shard{0, options.segments, n, tp.rank(), {out_features, in_features}};
    weight_ = &register_param(params, make_sharded_param(name + ".weight", shard, options.init), options, true);
  } else {
    weight_ = find_param(params, options.shared_weight);
  }
  if (options.bias) {
    const ParamShard bias_shard{0, options.segments, n, tp.rank(), {out_features}};
    bias_ = &register_param(params, make_sharded_param(name + ".bias", bias_shard, InitKind::kZeros), options);
  }
}

Tensor ColumnParallelLinear::forward(const Tensor& x_TI, LinearActivations& saved, const InputKeepers keepers) const {
  saved.input_TI = gather_input(x_TI);
  const bool own = keepers == InputKeepers::kLinearOnly || (keepers == InputKeepers::kShared && tp_.sequence_sharded());
  const int64_t T = saved.input_TI.dim(0);
  Tensor y_TO = ops::uninitialized_activation({T, out_local_});
  ops::linear_forward(y_TO, saved.input_TI, weight_->value,
                      options_.skip_bias_add || bias_ == nullptr ? nullptr : &bias_->value,
                      weight_->delayed_scaling.get(), &saved.delayed, own ? &saved.input_q : nullptr);
  drop_quantized_input(saved);
  parallel::drive_progress();
  return y_TO;
}

Tensor ColumnParallelLinear::forward_saved(const LinearActivations& saved) const {
  if (!saved.input_TI.defined()) {
    throw std::logic_error("ColumnParallelLinear::forward_saved: the forward kept only the quantized input");
  }
  Tensor y_TO = ops::uninitialized_activation({saved.input_TI.dim(0), out_local_});
  quant::DelayedForwardScales scales;
  ops::linear_forward(y_TO, saved.input_TI, weight_->value,
                      options_.skip_bias_add || bias_ == nullptr ? nullptr : &bias_->value,
                      weight_->delayed_scaling.get(), &scales);
  return y_TO;
}

void ColumnParallelLinear::backward_weights(const Tensor& dy_TO, const LinearActivations& saved) const {
  const bool with_bias = bias_ != nullptr && !options_.skip_bias_add;
  ops::linear_backward(nullptr, &weight_->grad, with_bias ? &bias_->grad : nullptr, dy_TO, saved_input(saved),
                       weight_->value, weight_->delayed_scaling.get(), &saved.delayed, &saved.input_q);
  parallel::drive_progress();
}

Tensor ColumnParallelLinear::gather_input(const Tensor& x_TI) const {
  return tp_.sequence_sharded() ? tp_.all_gather_rows(x_TI) : x_TI;
}

Tensor ColumnParallelLinear::reduce_input_grad(const Tensor& dinput_TI) const {
  if (tp_.size() == 1 || options_.explicit_expert_comm) return dinput_TI;
  // Each rank holds part of d(input) of every token: reduce-scatter it to the sequence shard (backward of the
  // all-gather), or all-reduce it (backward of copy_to_tensor_model_parallel_region).
  if (tp_.sequence_sharded()) return tp_.reduce_scatter_rows(dinput_TI);
  Tensor sum_TI = dinput_TI;
  tp_.all_reduce_activations_(sum_TI);
  return sum_TI;
}

void ColumnParallelLinear::backward(Tensor& dx_TI, const Tensor& dy_TO, const LinearActivations& saved) const {
  backward_weights(dy_TO, saved);
  const bool communicates = tp_.size() > 1 && !options_.explicit_expert_comm;
  if (!communicates) {
    ops::linear_backward(&dx_TI, nullptr, nullptr, dy_TO, nullptr, weight_->value, weight_->delayed_scaling.get(),
                         &saved.delayed);
    parallel::drive_progress();
    return;
  }
  Tensor dinput_TI = ops::activation_tensor(
      saved.input_TI.defined() ? saved.input_TI.shape()
                               : std::vector<int64_t>{dy_TO.numel() / out_local_, weight_->value.dim(1)});
  ops::linear_backward(&dinput_TI, nullptr, nullptr, dy_TO, nullptr, weight_->value, weight_->delayed_scaling.get(),
                       &saved.delayed);
  parallel::drive_progress();
  ops::add_(dx_TI, reduce_input_grad(dinput_TI));
}

RowParallelLinear::RowParallelLinear(const std::string& name, const int64_t in_features, const int64_t out_features,
                                     const TensorParallel& tp, const LinearOptions& options, ParamStore& params)
    : tp_(options.explicit_expert_comm ? TensorParallel(tp.group(), false) : tp), options_(options) {
  const int n = tp.size();
  check_divisible(name, in_features, n, "input features");
  in_local_ = in_features / n;
  const ParamShard shard{1, 1, n, tp.rank(), {out_features, in_features}};
  weight_ = &register_param(params, make_sharded_param(name + ".weight", shard, options.init), options, true);
  if (options.bias) {
    // Replicated; under sequence parallelism each rank's gradient covers only its rows, so it is summed over TP.
    Param bias = make_param(name + ".bias", {out_features}, InitKind::kZeros);
    bias.grad_sum_over_tp = tp_.sequence_sharded();
    bias_ = &register_param(params, std::move(bias), options);
  }
}

Tensor RowParallelLinear::forward(const Tensor& x_TI, LinearActivations& saved, const InputKeepers keepers) const {
  saved.input_TI = x_TI;
  const int64_t T = x_TI.dim(0), O = weight_->value.dim(0);
  Tensor partial_TO = ops::uninitialized_activation({T, O});
  ops::linear_forward(partial_TO, x_TI, weight_->value, nullptr, weight_->delayed_scaling.get(), &saved.delayed,
                      keepers == InputKeepers::kLinearOnly ? &saved.input_q : nullptr);
  drop_quantized_input(saved);
  parallel::drive_progress();
  Tensor y_TO;
  if (options_.explicit_expert_comm || tp_.size() == 1) {
    y_TO = std::move(partial_TO);
  } else if (tp_.sequence_sharded()) {
    y_TO = tp_.reduce_scatter_rows(partial_TO);
  } else {
    tp_.all_reduce_activations_(partial_TO);
    y_TO = std::move(partial_TO);
  }
  if (bias_ != nullptr && !options_.skip_bias_add) ops::add_bias_rows(y_TO, bias_->value);
  return y_TO;
}

void RowParallelLinear::backward(Tensor& dx_TI, const Tensor& dy_TO, const LinearActivations& saved) const {
  if (bias_ != nullptr && !options_.skip_bias_add) ops::bias_grad_rows(bias_->grad, dy_TO);
  const bool gather = tp_.sequence_sharded() && !options_.explicit_expert_comm;
  const Tensor dy_full_TO = gather ? tp_.all_gather_rows(dy_TO) : dy_TO;
  ops::linear_backward(&dx_TI, &weight_->grad, nullptr, dy_full_TO, saved_input(saved), weight_->value,
                       weight_->delayed_scaling.get(), &saved.delayed, &saved.input_q);
  parallel::drive_progress();
}

}  // namespace moecore
