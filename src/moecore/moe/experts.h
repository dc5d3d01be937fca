// Routed experts: every expert is an MLP W2 (act(fc1(x)) * p) + p * b2 (Megatron applies the router probability
// between the activation and fc2; with --moe-apply-probs-on-input, fc2(act(fc1(x * p)))).
// fc1: H -> F (2F with SwiGLU, halves [gate | up]); fc2: F -> H; F = --moe-ffn-hidden-size; H the hidden size, or
// --moe-latent-size with LatentMoE (Megatron's experts.py: the routed experts work in the latent width).
// Parameters (per expert e, under the layer prefix; identical for both implementations, so they share
// checkpoints and give identical results):
//   mlp.experts.local_experts.{e}.linear_fc1.weight [F1, H]   (+ .bias [F1] with --add-bias-linear)
//   mlp.experts.local_experts.{e}.linear_fc2.weight [H, F]    (+ .bias [H]; init scaled normal as dense fc2)
// Input rows are grouped by expert (tokens_per_expert_E rows each, in order). An expert with no rows
// produces nothing and gets zero (but present) gradients.
#pragma once

#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "moecore/model/config.h"
#include "moecore/model/mlp.h"
#include "moecore/model/param.h"
#include "moecore/moe/moe_config.h"
#include "moecore/parallel/parallel_state.h"
#include "moecore/tensor/tensor.h"

namespace moecore {

struct ExpertActivations {
  Tensor x_RH;     // expert input rows: the dispatcher's tensor itself (shared storage, not a copy)
  Tensor xs_RH;    // with --moe-apply-probs-on-input: x * p, fc1's input; else empty
  Tensor fc1_RF1;  // GroupedMLP: fc1 output of every row
  Tensor act_RF;   // GroupedMLP: activation output, before the probability (not with weighted SwiGLU)
  Tensor h_RF;     // GroupedMLP with SwiGLU and the probability after it: fc2's input swiglu(fc1) * p
  Tensor probs_R;  // the probabilities the MLPs apply: the router's, or ones without memory-efficient permutation
  // --no-moe-memory-efficient-permutation: the router's probabilities, applied to the output, and the output before
  // them (for their gradient).
  Tensor output_probs_R, y_RH;
  std::vector<int64_t> tokens_per_expert_E;
  std::vector<MLPActivations> per_expert;  // SequentialMLP: each expert's MLP activations
  // GroupedMLP under FP8 delayed scaling: the scales each expert's fc1 / fc2 forward quantized with.
  std::vector<quant::DelayedForwardScales> fc1_delayed_E, fc2_delayed_E;
  // GroupedMLP under FP8 / FP4: each expert's fc1 / fc2 input quantized for its weight gradient (ops/linear.h), kept
  // instead of x_RH (or xs_RH) and h_RF (TE's GroupedLinear saves its inputs quantized, module/grouped_linear.py).
  std::vector<quant::PackedQuantizedTensor> fc1_input_q_E, fc2_input_q_E;
};

class ExpertMLP {
 public:
  virtual ~ExpertMLP() = default;
  // Returns y_RH [R, H] = expert(x_RH) with probs applied (x_RH fp32 [R, H], probs_R fp32 [R], R the sum of
  // tokens_per_expert_E); keeps what backward needs in `saved`, x_RH and probs_R by reference (shared storage).
  virtual Tensor forward(const Tensor& x_RH, const Tensor& probs_R, const std::vector<int64_t>& tokens_per_expert_E,
                         ExpertActivations& saved) = 0;
  // Accumulates dx_RH [R, H] and the expert parameters' gradients; OVERWRITES dprobs_R [R] (d objective / d prob
  // per row). With deferred_weight_grads (Megatron's --delay-wgrad-compute, grouped experts only; std::logic_error
  // for SequentialMLP) only dx_RH and dprobs_R are computed now, and *deferred_weight_grads is set to a callable that
  // later accumulates exactly the parameter gradients this call would have, bit for bit. It holds what it needs
  // besides `saved` and the parameters (dy_RH, the workspace, the precision and quantization scopes of this call);
  // the caller keeps `saved` and the experts alive until it has run, once.
  virtual void backward(Tensor& dx_RH, Tensor& dprobs_R, const Tensor& dy_RH, const ExpertActivations& saved,
                        std::function<void()>* deferred_weight_grads = nullptr) = 0;
  // --recompute-modules moe_act (Megatron's, grouped experts only): drop_activation frees fc2's input (the
  // activation output) once forward is done; recompute_activation rebuilds it from the kept fc1 output before
  // backward. std::logic_error where the experts do not support it.
  virtual void drop_activation(ExpertActivations& saved) const;
  virtual void recompute_activation(ExpertActivations& saved) const;
};

// --moe-grouped-gemm: GroupedMLP (all local experts in one grouped GEMM over variable row counts),
// else SequentialMLP (one expert at a time). Registers the parameters under `prefix`: only EP rank r's experts
// [r E/EP, (r+1) E/EP) under their global names, Param::is_expert, each sharded over expert-TP (fc1 rows, per
// SwiGLU half; fc2 columns), Param::module = module. The MLP then runs over those E/EP local experts (input rows
// and tokens_per_expert_E index local experts). Under expert-TP the output is a partial sum over the ETP group (the
// dispatcher reduces it), as are dx and dprobs. Bias (--add-bias-linear) needs ETP 1, as Megatron.
std::unique_ptr<ExpertMLP> make_experts(
    const MoEConfig& moe, const ModelConfig& model, const std::string& prefix, ParamStore& params,
    const parallel::ParallelState& parallel = parallel::ParallelState::single_process(), int module = -1);

// Shared experts (--moe-shared-expert-intermediate-size S): a dense MLP H -> S (2S with SwiGLU) -> H on every
// token, no bias, output added to the routed output; with --moe-shared-expert-gate the output is scaled by
// sigmoid(x . w_g), w_g [1, H]. Parameters: mlp.shared_experts.linear_fc1.weight, mlp.shared_experts.linear_fc2.weight,
// mlp.shared_experts.gate_weight.
struct SharedExpertActivations {
  MLPActivations mlp;
  Tensor y_TH;    // the MLP output (gate only)
  Tensor gate_T;  // sigmoid values (gate only)
};

class SharedExpertMLP {
 public:
  // An MLP on the attention TP group (fc1 rows per SwiGLU half and fc2 columns sharded; its input is always a
  // sequence shard when TP > 1); the gate is replicated (Param::grad_sum_over_tp). Param::module = module.
  SharedExpertMLP(const MoEConfig& moe, const ModelConfig& model, const std::string& prefix, ParamStore& params,
                  const parallel::ParallelState& parallel = parallel::ParallelState::single_process(), int module = -1);
  // out_TH += shared(x_TH) on this rank's tokens (fp32 [T, H], a sequence shard under TP; collective over TP).
  void forward(Tensor& out_TH, const Tensor& x_TH, SharedExpertActivations& saved) const;
  // Accumulates dx_TH and parameter gradients from dout_TH.
  void backward(Tensor& dx_TH, const Tensor& dout_TH, const Tensor& x_TH, const SharedExpertActivations& saved) const;

 private:
  ModelConfig model_;
  MLP mlp_;
  Param* gate_ = nullptr;
};

}  // namespace moecore
