// Mixture-of-Experts hyper-parameters, named after Megatron's TransformerConfig fields / flags
// (megatron/core/transformer/transformer_config.py). num_experts == 0 means a dense model.
#pragma once

#include <cstdint>
#include <optional>
#include <string>
#include <vector>

namespace moecore {

enum class RouterScoreFunction { kSoftmax, kSigmoid, kSqrtSoftplus };  // --moe-router-score-function
enum class LoadBalancingType { kAuxLoss, kSeqAuxLoss, kGlobalAuxLoss, kSinkhorn, kNone };
enum class TokenDropPolicy { kProbs, kPosition };                 // --moe-token-drop-policy
enum class RouterDType { kFP32, kFP64 };                          // --moe-router-dtype
enum class TokenDispatcherType { kAllGather, kAllToAll, kFlex };  // --moe-token-dispatcher-type

struct MoEConfig {
  int64_t num_experts = 0;              // --num-experts
  int64_t ffn_hidden_size = 0;          // --moe-ffn-hidden-size (default: the dense --ffn-hidden-size)
  std::vector<bool> moe_layer_pattern;  // --moe-layer-freq, expanded: layer i is MoE iff pattern[i]
  int64_t topk = 2;                     // --moe-router-topk
  RouterScoreFunction score_function = RouterScoreFunction::kSoftmax;
  bool pre_softmax = false;                   // --moe-router-pre-softmax (softmax scores only; ignored otherwise)
  std::optional<double> topk_scaling_factor;  // --moe-router-topk-scaling-factor
  int64_t num_groups = 0;                     // --moe-router-num-groups (0 = no group-limited routing)
  int64_t group_topk = 0;                     // --moe-router-group-topk
  double input_jitter_eps = 0.0;              // --moe-input-jitter-eps (0 = off)
  RouterDType router_dtype = RouterDType::kFP32;
  bool enable_expert_bias = false;    // --moe-router-enable-expert-bias
  double bias_update_rate = 1e-3;     // --moe-router-bias-update-rate
  bool force_load_balancing = false;  // --moe-router-force-load-balancing
  std::vector<LoadBalancingType> load_balancing_types{LoadBalancingType::kAuxLoss};  // --moe-router-load-balancing-type
  std::vector<double> aux_loss_coeffs{0.0};  // --moe-aux-loss-coeff, one per type
  double z_loss_coeff = 0.0;                 // --moe-z-loss-coeff
  std::optional<double> capacity_factor;     // --moe-expert-capacity-factor (none = dropless)
  TokenDropPolicy drop_policy = TokenDropPolicy::kProbs;
  bool pad_expert_input_to_capacity = false;  // --moe-pad-expert-input-to-capacity
  bool apply_probs_on_input = false;          // --moe-apply-probs-on-input (top-1 only)
  // The report's memory-efficient permutation: the probability scales fc2's input (fc2(act(fc1 x) p)), so backward
  // needs no copy of the experts' output; off (--no-moe-memory-efficient-permutation): it scales fc2's output
  // (p fc2(act(fc1 x))), Megatron's earlier unpermute with probabilities, and the output [R, H] is kept for dp.
  bool memory_efficient_permutation = true;
  bool grouped_gemm = false;                    // --moe-grouped-gemm (GroupedMLP, else SequentialMLP)
  int64_t shared_expert_intermediate_size = 0;  // --moe-shared-expert-intermediate-size (0 = none)
  bool shared_expert_gate = false;              // --moe-shared-expert-gate
  bool shared_expert_overlap = false;           // --moe-shared-expert-overlap
  // --moe-latent-size (LatentMoE, Megatron's MoELayer.fc1_latent_proj / fc2_latent_proj): the routed experts work in
  // this width; tokens are projected down before dispatch and back up after combine (0: off, experts on the hidden
  // size). The router and the shared experts stay on the full hidden size.
  int64_t latent_size = 0;
  // --overlap-moe-expert-parallel-comm: Megatron's combined 1F1B schedule pairs the forward of one micro-batch with
  // the backward of another, and the dispatcher hands the cores to the other one while its all-to-all travels
  // (parallel/turn_taking.h).
  bool overlap_ep_comm = false;
  // --delay-wgrad-compute: the routed experts' weight gradients run while the dispatch backward's all-to-all
  // travels, after their data gradients have been sent on.
  bool delay_wgrad_compute = false;
  bool per_layer_logging = false;                                         // --moe-per-layer-logging
  TokenDispatcherType dispatcher_type = TokenDispatcherType::kAllGather;  // --moe-token-dispatcher-type
  // --moe-router-padding-for-quantization: each rank pads its routing map before dispatch so every expert's count is
  // a multiple of this (the recipe's align_size_for_quantization; 0: off; routing_padding.h).
  int64_t router_padding_multiple = 0;

  bool enabled() const { return num_experts > 0; }
  bool is_moe_layer(int64_t layer) const {
    return enabled() && layer < static_cast<int64_t>(moe_layer_pattern.size()) && moe_layer_pattern[layer];
  }
  // Throws ConfigError (one line) for inconsistent settings (Megatron's asserts and moecore's own consistency rules).
  void validate(int64_t num_layers) const;
};

// --moe-layer-freq: an int N (layer i is MoE iff i % N == 0) or a Python-like list expression such as
// "([0]*3+[1]*9)" or "[1,0,1,0]". Throws ConfigError naming the text when it is malformed or its length
// is not num_layers.
std::vector<bool> parse_moe_layer_freq(const std::string& text, int64_t num_layers);

std::string to_string(RouterScoreFunction value);
std::string to_string(LoadBalancingType value);

// Megatron's get_aux_loss_coeff: the coefficient of the first entry of that type, 0 when absent.
double aux_loss_coeff(const MoEConfig& config, LoadBalancingType type);
// Whether any of the auxiliary losses on the router's scores (aux, seq-aux, global aux) is on: then the router keeps
// its aux scores for backward.
bool aux_losses_on(const MoEConfig& config);

}  // namespace moecore
