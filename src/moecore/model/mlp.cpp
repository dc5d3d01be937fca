#include "moecore/model/mlp.h"

#include <stdexcept>

#include "moecore/ops/linear.h"
#include "moecore/ops/precision.h"
#include "moecore/ops/rows.h"

namespace moecore {

void mlp_activation_forward(const ops::Activation kind, Tensor& act_TF, Tensor& h_TF, const Tensor& fc1_TF1,
                            const Tensor* probs_T) {
  ops::activation_forward(kind, act_TF, fc1_TF1);
  if (probs_T != nullptr) ops::scale_rows(h_TF, act_TF, *probs_T);
}

void mlp_activation_backward(const ops::Activation kind, Tensor& dfc1_TF1, Tensor* dprobs_T, const Tensor& dh_TF,
                             const Tensor& fc1_TF1, const Tensor& act_TF, const Tensor* probs_T) {
  if (probs_T == nullptr) {
    ops::activation_backward(kind, dfc1_TF1, dh_TF, fc1_TF1);
    return;
  }
  Tensor dact_TF = ops::activation_tensor(act_TF.shape());
  ops::scale_rows_backward(&dact_TF, dprobs_T, dh_TF, act_TF, *probs_T);
  ops::activation_backward(kind, dfc1_TF1, dact_TF, fc1_TF1);
}

MLP::MLP(const std::string& prefix, const int64_t hidden_size, const MLPOptions& options, const TensorParallel& tp,
         ParamStore& params)
    : options_(options) {
  const int64_t F = options.ffn_hidden_size;
  LinearOptions fc1 = options.linear;
  fc1.bias = options.bias;
  fc1.init = InitKind::kNormal;
  fc1.segments = options.activation == ops::Activation::kSwiGLU ? 2 : 1;
  fc1_ = ColumnParallelLinear(prefix + "linear_fc1", hidden_size, ops::activation_input_width(options.activation, F),
                              tp, fc1, params);
  LinearOptions fc2 = options.linear;
  fc2.bias = options.bias;
  fc2.init = InitKind::kScaledNormal;
  fc2.skip_bias_add = true;  // added here: scaled by the probability on routed experts
  fc2_ = RowParallelLinear(prefix + "linear_fc2", F, hidden_size, tp, fc2, params);
}

Tensor MLP::forward(const Tensor& x_TH, const Tensor* probs_T, MLPActivations& saved,
                    const InputKeepers x_keepers) const {
  const bool probs_on_input = probs_T != nullptr && options_.probs_on_input;
  const Tensor* probs_on_act = probs_on_input ? nullptr : probs_T;
  Tensor fc1_in = x_TH;
  if (probs_on_input) {
    saved.x_TH = x_TH;
    fc1_in = ops::activation_tensor(x_TH.shape());
    ops::scale_rows(fc1_in, x_TH, *probs_T);
  }
  // fc1's input: the caller's tensor, or x * p, fc1's alone.
  saved.fc1_TF1 = fc1_.forward(fc1_in, saved.fc1, probs_on_input ? InputKeepers::kLinearOnly : x_keepers);
  const int64_t T = saved.fc1_TF1.dim(0), F = fc2_.in_local();
  saved.act_TF = ops::activation_tensor({T, F});
  Tensor h_TF = probs_on_act != nullptr ? ops::activation_tensor({T, F}) : saved.act_TF;
  mlp_activation_forward(options_.activation, saved.act_TF, h_TF, saved.fc1_TF1, probs_on_act);
  // fc2's input is fc2's alone (the activation's backward reads fc1's output, and act only to scale by probs):
  // under FP8 / FP4 only its quantized copy is kept.
  Tensor y_TH = fc2_.forward(h_TF, saved.fc2, InputKeepers::kLinearOnly);
  if (probs_on_act == nullptr && saved.fc2.input_q.defined()) saved.act_TF = Tensor();
  if (const Param* b2 = fc2_.bias()) {
    if (probs_on_act != nullptr) {
      ops::add_outer(y_TH, *probs_on_act, b2->value);
    } else {
      ops::add_bias_rows(y_TH, b2->value);
    }
  }
  return y_TH;
}

void MLP::backward(Tensor& dx_TH, Tensor* dprobs_T, const Tensor& dout_TH, const Tensor* probs_T,
                   const MLPActivations& saved) const {
  if (probs_T != nullptr && dprobs_T == nullptr) throw std::logic_error("MLP backward: probs need dprobs_T");
  const bool probs_on_input = probs_T != nullptr && options_.probs_on_input;
  const Tensor* probs_on_act = probs_on_input ? nullptr : probs_T;
  const int64_t T = saved.fc1_TF1.dim(0), F = fc2_.in_local();
  Tensor dh_TF = ops::activation_tensor({T, F});
  fc2_.backward(dh_TF, dout_TH, saved.fc2);
  Tensor dfc1_TF1 = ops::activation_tensor(saved.fc1_TF1.shape());
  mlp_activation_backward(options_.activation, dfc1_TF1, probs_on_act != nullptr ? dprobs_T : nullptr, dh_TF,
                          saved.fc1_TF1, saved.act_TF, probs_on_act);
  dh_TF = Tensor();
  if (Param* b2 = fc2_.bias()) {
    if (probs_on_act != nullptr) {
      ops::add_outer_backward(dprobs_T, &b2->grad, dout_TH, *probs_on_act, b2->value);
    } else {
      ops::bias_grad_rows(b2->grad, dout_TH);
    }
  }
  if (!probs_on_input) {
    fc1_.backward(dx_TH, dfc1_TF1, saved.fc1);
    return;
  }
  // fc1 input x * p: dx += d(fc1 input) * p, dp = <d(fc1 input), x>.
  Tensor dxs_TH = ops::activation_tensor(dx_TH.shape());
  fc1_.backward(dxs_TH, dfc1_TF1, saved.fc1);
  ops::scale_rows_backward(&dx_TH, dprobs_T, dxs_TH, saved.x_TH, *probs_T);
}

}  // namespace moecore
