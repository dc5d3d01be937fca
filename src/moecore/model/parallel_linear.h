// Megatron's tensor-parallel linear layers (megatron/core/tensor_parallel/layers.py). The only place, with
// vocab_parallel.h, where tensor- and sequence-parallel communication on activations happens:
//   ColumnParallelLinear: weight [O/TP, I] (rows split; SwiGLU's [gate; up] halves split separately), bias [O/TP].
//     Input: this rank's rows of the activation (a sequence shard under sequence parallelism, all-gathered here; else
//     the replicated tokens, whose gradient is all-reduced in backward). Output: every token, this rank's columns.
//   RowParallelLinear: weight [O, I/TP] (columns split), bias [O] replicated. Input: every token, this rank's
//     columns. Output: the sum over TP, reduce-scattered to this rank's sequence shard or all-reduced.
// With explicit_expert_comm (routed experts) the layers shard their weights over the given group (expert TP) but
// never communicate: the token dispatcher does. Legend: T tokens, I in features, O out features.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "moecore/model/param.h"
#include "moecore/model/tensor_parallel.h"
#include "moecore/quant/packed_quantized_tensor.h"
#include "moecore/tensor/tensor.h"

namespace moecore {

struct LinearOptions {
  bool bias = false;
  InitKind init = InitKind::kNormal;
  int segments = 1;                   // column-parallel only: SwiGLU's fc1 is 2 segments
  bool skip_bias_add = false;         // forward leaves the bias to the caller (Megatron's skip_bias_add)
  bool explicit_expert_comm = false;  // shard over the group, never communicate (routed experts)
  bool is_expert = false;             // Param::is_expert
  int module = -1;                    // Param::module
  // Column-parallel only: use this already registered parameter as the weight instead of registering one (the
  // output layer tied to the word embeddings; Megatron's skip_weight_param_allocation).
  std::string shared_weight;
};

// What a linear layer's backward needs: its input as the GEMM saw it (all tokens), or under an FP8 / FP4 recipe that
// input quantized for the weight gradient (ops/linear.h; then input_TI is empty), and under FP8 delayed scaling the
// scales its forward quantized the input and the weight with.
struct LinearActivations {
  Tensor input_TI;
  quant::PackedQuantizedTensor input_q;
  quant::DelayedForwardScales delayed;
};

// Who keeps a linear layer's input for backward besides the layer. kLinearOnly: nobody, so under a quantized recipe
// the layer keeps only the input quantized for its weight gradient, as TE's Linear saves it (the planner's
// Fp8::kOnly). kShared: the caller keeps the same tensor for another use (a norm recompute, another GEMM, an
// activation's backward), so the layer reads that one; TE would save a quantized copy besides it (the planner's
// GPU model, Fp8::kExtra), moecore does not (the high-precision tensor is there anyway). kRecomputed: the caller
// recomputes the output from the saved input (ColumnParallelLinear::forward_saved), which stays high precision. A
// column-parallel layer whose input is all-gathered under sequence parallelism owns the gathered tensor: kShared
// acts as kLinearOnly there.
enum class InputKeepers { kShared, kLinearOnly, kRecomputed };

class ColumnParallelLinear {
 public:
  ColumnParallelLinear() = default;
  // Registers `name`.weight (and .bias) into params (with options.shared_weight: uses that registered weight).
  ColumnParallelLinear(const std::string& name, int64_t in_features, int64_t out_features, const TensorParallel& tp,
                       const LinearOptions& options, ParamStore& params);

  // x_TI (this rank's rows) -> y_TO [all tokens, O/TP].
  Tensor forward(const Tensor& x_TI, LinearActivations& saved, InputKeepers keepers = InputKeepers::kShared) const;
  // The output again from the input `saved` kept (recomputation: no communication; under FP8 delayed scaling inside
  // a replaying ops::ScopedDelayedScales, the forward's scales).
  Tensor forward_saved(const LinearActivations& saved) const;
  // dx_TI (this rank's rows) += d(y)/d(x)^T dy_TO; weight and bias gradients accumulate.
  void backward(Tensor& dx_TI, const Tensor& dy_TO, const LinearActivations& saved) const;
  // Weight and bias gradients only (a caller that computes the data gradient itself).
  void backward_weights(const Tensor& dy_TO, const LinearActivations& saved) const;
  // The two communication halves, for a caller that does the GEMMs itself (the fused output layer + loss): the
  // input as the GEMM sees it (every token), and this rank's d(input) from the GEMM's partial one over every token.
  Tensor gather_input(const Tensor& x_TI) const;
  Tensor reduce_input_grad(const Tensor& dinput_TI) const;

  int64_t out_local() const { return out_local_; }
  Param& weight() const { return *weight_; }
  Param* bias() const { return bias_; }  // null without --add-bias-linear

 private:
  TensorParallel tp_;
  LinearOptions options_;
  int64_t out_local_ = 0;
  Param* weight_ = nullptr;
  Param* bias_ = nullptr;
};

class RowParallelLinear {
 public:
  RowParallelLinear() = default;
  RowParallelLinear(const std::string& name, int64_t in_features, int64_t out_features, const TensorParallel& tp,
                    const LinearOptions& options, ParamStore& params);

  // x_TI [all tokens, I/TP] -> y_TO (this rank's rows), bias added unless skip_bias_add.
  Tensor forward(const Tensor& x_TI, LinearActivations& saved, InputKeepers keepers = InputKeepers::kShared) const;
  // dx_TI [all tokens, I/TP] += d(y)/d(x)^T dy_TO; dy_TO holds this rank's rows; the bias gradient too unless
  // skip_bias_add.
  void backward(Tensor& dx_TI, const Tensor& dy_TO, const LinearActivations& saved) const;

  int64_t in_local() const { return in_local_; }
  Param& weight() const { return *weight_; }
  Param* bias() const { return bias_; }  // null without --add-bias-linear

 private:
  TensorParallel tp_;
  LinearOptions options_;
  int64_t in_local_ = 0;
  Param* weight_ = nullptr;
  Param* bias_ = nullptr;
};

}  // namespace moecore
