// Shared experts (Megatron's SharedExpertMLP): a dense MLP on every token, out += g_t * mlp(x_t), no bias; with
// --moe-shared-expert-gate g_t = sigmoid(x_t . w_g), else g_t = 1. Under TP the MLP's fc1 is column-parallel on the
// all-gathered sequence shards and its fc2 row-parallel, reduce-scattered back. Legend: T local tokens, H hidden.
#include <stdexcept>
#include <string>
#include <vector>

#include "moecore/moe/experts.h"
#include "moecore/ops/elementwise.h"
#include "moecore/ops/linear.h"
#include "moecore/ops/precision.h"
#include "moecore/ops/quantization.h"
#include "moecore/ops/rows.h"

namespace moecore {
namespace {

Tensor activation_tensor(std::vector<int64_t> shape) {
  return Tensor(std::move(shape), ops::activation_storage_dtype(), MemCategory::kActivations);
}

std::string gate_name(const std::string& prefix) { return prefix + "mlp.shared_experts.gate_weight"; }

// Rows of H in an fp32 token tensor; throws std::invalid_argument otherwise.
int64_t rows_of(const char* name, const Tensor& t, const int64_t H) {
  if (!t.defined() || !ops::activation_storage(t.dtype()) || t.numel() % H != 0) {
    throw std::invalid_argument(std::string("shared experts: ") + name + " must be fp32 rows of " + std::to_string(H) +
                                ", got " + (t.defined() ? t.shape_str() : std::string("none")));
  }
  return t.numel() / H;
}

}  // namespace

SharedExpertMLP::SharedExpertMLP(const MoEConfig& moe, const ModelConfig& model, const std::string& prefix,
                                 ParamStore& params, const parallel::ParallelState& parallel, const int module)
    : model_(model) {
  const int64_t S = moe.shared_expert_intermediate_size, H = model.hidden_size;
  if (S <= 0) {
    throw ConfigError("shared experts: --moe-shared-expert-intermediate-size must be positive, got " +
                      std::to_string(S));
  }
  if (H <= 0) throw ConfigError("shared experts: --hidden-size must be positive, got " + std::to_string(H));
  const TensorParallel tp = TensorParallel::attention(parallel).sequence_sharded_always();
  if (S % tp.size() != 0) {
    throw ConfigError("shared experts: --moe-shared-expert-intermediate-size " + std::to_string(S) +
                      " is not divisible by --tensor-model-parallel-size " + std::to_string(tp.size()));
  }
  MLPOptions options;
  options.ffn_hidden_size = S;
  options.activation = model.activation;
  options.linear.module = module;
  mlp_ = MLP(prefix + "mlp.shared_experts.", H, options, tp, params);
  // Megatron initialises the gate [1, H] with config.init_method: N(0, init_method_std). Replicated over TP, each
  // rank sees only its sequence shard.
  if (moe.shared_expert_gate) {
    Param gate = make_param(gate_name(prefix), {1, H}, InitKind::kNormal);
    gate.grad_sum_over_tp = true;
    gate.module = module;
    gate_ = &params.push_back(std::move(gate));
  }
}

void SharedExpertMLP::forward(Tensor& out, const Tensor& x, SharedExpertActivations& saved) const {
  const int64_t H = model_.hidden_size, T = rows_of("x_TH", x, H);
  if (out.numel() != T * H) throw std::invalid_argument("shared experts: out_TH must hold [T, H] = " + x.shape_str());
  saved = SharedExpertActivations{};
  Tensor y_TH = mlp_.forward(x.view({T, H}), nullptr, saved.mlp);
  if (gate_ == nullptr) {
    ops::add_(out, y_TH);
    return;
  }
  saved.gate_T = activation_tensor({T});
  ops::row_dot(saved.gate_T, x, gate_->value);
  ops::sigmoid_forward(saved.gate_T, saved.gate_T);
  Tensor gated_TH = activation_tensor({T, H});
  ops::scale_rows(gated_TH, y_TH, saved.gate_T);
  ops::add_(out, gated_TH);
  saved.y_TH = std::move(y_TH);
}

void SharedExpertMLP::backward(Tensor& dx, const Tensor& dout, const Tensor& x,
                               const SharedExpertActivations& saved) const {
  const int64_t H = model_.hidden_size, T = rows_of("x_TH", x, H);
  if (dx.numel() != T * H || dout.numel() != T * H) {
    throw std::invalid_argument("shared experts: dx_TH and dout_TH must hold [T, H] = " + x.shape_str());
  }
  if (gate_ == nullptr) {
    mlp_.backward(dx, nullptr, dout, nullptr, saved.mlp);
    return;
  }
  // out = g * y, g = sigmoid(z), z = x . w_g: dy = g * dout; dz = <dout, y> g (1 - g); dx += dz w_g; dw_g += dz^T x.
  Tensor dy_TH = activation_tensor({T, H});
  Tensor dg_T({T}, DType::kF32, MemCategory::kActivations);  // not rounded (scale_rows_backward), as today
  ops::scale_rows_backward(&dy_TH, &dg_T, dout, saved.y_TH, saved.gate_T);
  Tensor dz_T1 = activation_tensor({T, 1});
  ops::sigmoid_backward(dz_T1, dg_T, saved.gate_T);
  ops::add_outer(dx, dz_T1, gate_->value);
  {
    const ops::ScopedLinearQuantization high_precision(nullptr);  // the gate is a plain [1, H] product in Megatron
    ops::linear_backward(nullptr, &gate_->grad, nullptr, dz_T1, &x, gate_->value);
  }
  mlp_.backward(dx, nullptr, dy_TH, nullptr, saved.mlp);
}

}  // namespace moecore
