// Dense-to-MoE upcycling (Megatron's --moe-use-upcycling: megatron/core/transformer/moe/upcycling_utils.py,
// _convert_to_moe_state_dict; driven by setup_model_and_optimizer in megatron/training/training.py; method of
// "Upcycling Large Language Models into Mixture of Experts", arXiv 2410.07524): a MoE model starts from a trained
// dense model's weights, every expert a copy (or, fine-grained, a piece) of the dense MLP.
#pragma once

#include <cstdint>
#include <memory>

#include "moecore/ckpt/state_source.h"
#include "moecore/model/config.h"

namespace moecore {

// The dense model a MoE run upcycles from (training.py builds it from the MoE run's flags): `moe_config` with the
// experts off (num_experts 0, the MoE settings reset) and ffn_hidden_size = moe_ffn_hidden_size * granularity
// (--moe-upcycling-granularity). Megatron multiplies --ffn-hidden-size instead and then takes the split's granularity
// as dense / --moe-ffn-hidden-size; the two agree when --moe-ffn-hidden-size is --ffn-hidden-size (its default), and
// moecore requires the granularity it is given to be the split's.
// Throws ConfigError (one line) for: no MoE (--num-experts), granularity < 1, a granularity that does not divide
// --num-experts (Megatron's assert in _get_config), shared experts (Megatron's upcycling leaves them at their random
// init, so the upcycled model would not compute the dense one; moecore refuses instead), and dense layers
// (--moe-layer-freq) whose --ffn-hidden-size is not --moe-ffn-hidden-size * granularity (they copy the dense MLP).
ModelConfig dense_config_for_upcycling(const ModelConfig& moe_config, int64_t granularity);

// The state of the MoE model `moe_config` (the keys and global shapes of a one-process GPTModel, model_state_keys.h)
// produced on demand from `dense`, a source holding the dense model of dense_config_for_upcycling (any layout; read
// with read_global_tensor, so `dense` must outlive the returned source). With E experts, top-k, granularity g:
// - every key outside the MoE layers' MLPs, and the whole MLP of dense layers (--moe-layer-freq), is the dense value;
// - routed expert e of MoE layer i takes piece e mod g of the dense decoder.layers.i.mlp: linear_fc1.weight / .bias
//   cut into g row blocks (SwiGLU: the gate and up halves cut separately, block j of each re-paired as [gate_j; up_j]),
//   linear_fc2.weight into g column blocks, both times the scale s, in fp32 (as Megatron's param * scale);
//   linear_fc2.bias is the dense bias, unscaled, for every expert (Megatron's _process_fc2_bias_param);
// - s = a^(1/3) for SwiGLU or squared ReLU, a^(1/2) for GeLU, where a = g (post-softmax top-k) or E * g / topk
//   (--moe-router-pre-softmax) (Megatron's _get_moe_activation_scale / _get_weight_scale);
// - the router weight [E, H] is the MoE model's own initial value (init_param under its name with `seed` and
//   `init_method_std`, exactly as GPTModel initialises it) with its first E/g rows each repeated g times, so the g
//   pieces of one dense MLP share a router row (_process_router_param); the router bias (--add-bias-linear) keeps the
//   MoE model's own init, as in Megatron (which converts only the weight); the expert-bias buffer is zeros.
// Post-softmax with g = 1 the upcycled model computes the dense model (the top-k probabilities sum to one over
// identical experts). With g > 1 and top-k a multiple of g, the g experts sharing a router row are selected together
// with equal probabilities (p / g each, the p summing to one), so the model computes the dense one when the
// activation is positively homogeneous (squared ReLU: s^3 = g cancels the 1/g), and approximately for SwiGLU / GeLU
// (the scale is the paper's magnitude-matching heuristic). Throws what dense_config_for_upcycling
// throws, and ConfigError when the dense source's FFN width (decoder.layers.0.mlp.linear_fc2.weight) is not
// moe_ffn_hidden_size * g; std::runtime_error naming a key the dense source lacks or holds with another shape.
std::unique_ptr<GlobalTensorSource> upcycled_state_source(const StateSource& dense, const ModelConfig& moe_config,
                                                          int64_t granularity, uint64_t seed, double init_method_std);

}  // namespace moecore
