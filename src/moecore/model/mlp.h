// Megatron's MLP (megatron/core/transformer/mlp.py): fc1 (ColumnParallelLinear) -> activation -> fc2
// (RowParallelLinear), parameters `<prefix>linear_fc1.{weight,bias}` [F1, H] and `<prefix>linear_fc2.{weight,bias}`
// [H, F]. One class serves the dense MLP, the shared experts and each routed expert of SequentialMLP. An optional
// per-token scale p (the router probability) multiplies the activation output before fc2, the fc2 bias with it
// (y = fc2(act(fc1(x)) * p) + p b2), or, with --moe-apply-probs-on-input, the input (y = fc2(act(fc1(x * p))) + b2).
// Legend: T tokens, H hidden, F ffn width (this rank's shard), F1 = 2F with SwiGLU else F.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "moecore/model/parallel_linear.h"
#include "moecore/ops/activation.h"
#include "moecore/tensor/tensor.h"

namespace moecore {

struct MLPOptions {
  int64_t ffn_hidden_size = 0;  // F before the tensor-parallel split
  ops::Activation activation = ops::Activation::kGelu;
  bool bias = false;
  bool probs_on_input = false;
  LinearOptions linear;  // explicit_expert_comm, is_expert, module (bias / init / segments are set by the MLP)
};

struct MLPActivations {
  LinearActivations fc1, fc2;
  Tensor fc1_TF1;  // fc1 output (activation input)
  Tensor act_TF;   // activation output, before the probability
  Tensor x_TH;     // with probs on input: the input before x * p
};

// The activation and probability step shared by MLP and GroupedMLP:
// act_TF = act(fc1_TF1); h_TF = act_TF * probs_T (or act_TF itself without probs). h_TF may be act_TF.
void mlp_activation_forward(ops::Activation kind, Tensor& act_TF, Tensor& h_TF, const Tensor& fc1_TF1,
                            const Tensor* probs_T);
// Backward from dh_TF: dfc1_TF1 += ...; dprobs_T = <dh_TF, act_TF> per token (overwrites; needs probs_T).
void mlp_activation_backward(ops::Activation kind, Tensor& dfc1_TF1, Tensor* dprobs_T, const Tensor& dh_TF,
                             const Tensor& fc1_TF1, const Tensor& act_TF, const Tensor* probs_T);

class MLP {
 public:
  MLP() = default;
  MLP(const std::string& prefix, int64_t hidden_size, const MLPOptions& options, const TensorParallel& tp,
      ParamStore& params);

  // x_TH: the rows the column-parallel fc1 takes (a sequence shard under sequence parallelism); the output has
  // the same rows. probs_T: per-token scale over all the tokens fc1 sees, or null.
  // x_keepers: who besides fc1 keeps x_TH (parallel_linear.h).
  Tensor forward(const Tensor& x_TH, const Tensor* probs_T, MLPActivations& saved,
                 InputKeepers x_keepers = InputKeepers::kShared) const;
  // dx_TH += d(out)/d(x)^T dout_TH; parameter gradients accumulate; dprobs_T (with probs) OVERWRITTEN with
  // d(objective)/d(p) per token.
  void backward(Tensor& dx_TH, Tensor* dprobs_T, const Tensor& dout_TH, const Tensor* probs_T,
                const MLPActivations& saved) const;

  const ColumnParallelLinear& fc1() const { return fc1_; }
  const RowParallelLinear& fc2() const { return fc2_; }

 private:
  MLPOptions options_;
  ColumnParallelLinear fc1_;
  RowParallelLinear fc2_;
};

}  // namespace moecore
