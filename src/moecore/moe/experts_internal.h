// Internal to src/moecore/moe (not a public interface): what GroupedMLP and SequentialMLP share. Both hold the same
// parameters (one MLP per local expert: the same names, shards and initial values) and give the same results to
// rounding; SequentialMLP runs each expert's MLP over its rows, GroupedMLP all experts at once through the fused
// grouped-MLP op (ops/grouped_mlp.h; under FP8 / FP4 or native 16-bit GEMMs the same math per expert through the
// single ops: the MLP's activation and probability step, mlp_activation_forward / _backward, or for SwiGLU with the
// probability after it the fused ops::weighted_swiglu_forward / _backward). Legend: R
// rows grouped by expert, H hidden, F expert ffn width (this rank's shard), F1 = 2F with SwiGLU else F, E local
// experts.
#pragma once

#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "moecore/model/mlp.h"
#include "moecore/moe/experts.h"

namespace moecore::experts_detail {

class ExpertMLPBase : public ExpertMLP {
 public:
  // Registers this EP rank's experts (global names), each sharded over expert-TP.
  ExpertMLPBase(const MoEConfig& moe, const ModelConfig& model, const std::string& prefix, ParamStore& params,
                const parallel::ParallelState& parallel, int module);
  Tensor forward(const Tensor& x_RH, const Tensor& probs_R, const std::vector<int64_t>& tokens_per_expert_E,
                 ExpertActivations& saved) final;
  void backward(Tensor& dx_RH, Tensor& dprobs_R, const Tensor& dy_RH, const ExpertActivations& saved,
                std::function<void()>* deferred_weight_grads = nullptr) final;

 protected:
  // How the per-expert work runs: the only difference between the two implementations. offsets_E1: exclusive
  // prefix sums of the rows per expert. Inputs and outputs are [R, ...] tensors.
  virtual void run_forward(const std::vector<int64_t>& offsets_E1, Tensor& y_RH, ExpertActivations& saved) const = 0;
  // With deferred_weight_grads: the data gradients only, and *deferred_weight_grads set to the weight gradients'
  // callable (ExpertMLP::backward); called so only where defers_weight_grads().
  virtual void run_backward(const std::vector<int64_t>& offsets_E1, Tensor& dx_RH, Tensor& dprobs_R,
                            const Tensor& dy_RH, const ExpertActivations& saved,
                            std::function<void()>* deferred_weight_grads) const = 0;
  // Whether run_backward can defer the weight gradients (--delay-wgrad-compute).
  virtual bool defers_weight_grads() const { return false; }

  int64_t E_ = 0, H_ = 0, F_ = 0, F1_ = 0;
  ops::Activation activation_ = ops::Activation::kGelu;
  bool probs_on_input_ = false;
  bool memory_efficient_permutation_ = true;
  std::vector<MLP> experts_;  // the local experts

 private:
  // Without memory-efficient permutation: y_RH (the MLPs' output, kept) scaled by the router's probabilities.
  Tensor apply_output_probs(const Tensor& y_RH, ExpertActivations& saved) const;
};

// Exclusive prefix sums of tokens_per_expert_E ([E + 1]); throws on a wrong count or a negative entry.
std::vector<int64_t> expert_offsets(const std::vector<int64_t>& tokens_per_expert_E, int64_t E);

std::unique_ptr<ExpertMLP> make_sequential_mlp(const MoEConfig& moe, const ModelConfig& model,
                                               const std::string& prefix, ParamStore& params,
                                               const parallel::ParallelState& parallel, int module);
std::unique_ptr<ExpertMLP> make_grouped_mlp(const MoEConfig& moe, const ModelConfig& model, const std::string& prefix,
                                            ParamStore& params, const parallel::ParallelState& parallel, int module);

}  // namespace moecore::experts_detail
