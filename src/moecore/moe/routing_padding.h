// --moe-router-padding-for-quantization (alias --moe-router-padding-for-fp8): before dispatch each rank pads its
// local routing map so that every expert's token count is a multiple of the recipe's alignment, Megatron's
// MoEAlltoAllTokenDispatcher.dispatch_preprocess calling pad_routing_map (megatron/core/transformer/moe/moe_utils.py).
// For expert e with c routed tokens, the first (-c mod align) tokens NOT routed to e (lowest token index first) are
// routed to it too; their probability is the router's 0 there, so they add nothing to the layer's output and get no
// router gradient. The router's own statistics (aux losses, tokens per expert for logging and the expert bias) are
// computed before, from the unpadded map, as in Megatron. The experts then need no row padding of their own
// (Megatron's skip_routed_expert_padding). With too few unrouted tokens an expert's count stays short of the multiple.
// Legend: T tokens, E experts.
#pragma once

#include <cstdint>
#include <span>
#include <vector>

#include "moecore/moe/router.h"
#include "moecore/quant/recipe.h"

namespace moecore {

// Megatron's get_align_size_for_quantization without TE's op fuser / grouped tensor: get_fp8_align_size (mxfp8 32,
// other FP8 recipes 16, megatron/core/fp8_utils.py) and get_fp4_align_size (nvfp4 128, megatron/core/fp4_utils.py).
int64_t align_size_for_quantization(quant::Recipe recipe);

// Megatron's pad_routing_map on routing_map_TE [T, E] (0 / 1) in place; returns the padded column sums [E].
std::vector<int64_t> pad_routing_map(std::span<uint8_t> routing_map_TE, int64_t T, int64_t E, int64_t pad_multiple);

// `routing` with its map padded to `pad_multiple` and tokens_per_expert_E recounted; probs_TE is shared (the padded
// entries read the 0 it holds there). Not for pad-to-capacity routings (the map and counts disagree there).
RouterOutput padded_routing(const RouterOutput& routing, int64_t T, int64_t E, int64_t pad_multiple);

}  // namespace moecore
