// Megatron's pad_routing_map (moe_utils.py, --moe-router-padding-for-quantization) on a [T, E] byte routing map, in
// place: for expert e with c routed tokens, the first (-c mod multiple) tokens not routed to e (lowest token index
// first) are routed to it too; with too few such tokens the count stays short of the multiple. counts_E receives
// the padded column sums.
#pragma once

#include <cstdint>

namespace moecore::kernels {

#define MOECORE_ROUTING_PADDING_DECL \
  void pad_routing_map(uint8_t* map_TE, int64_t* counts_E, int64_t T, int64_t E, int64_t multiple);

namespace cpu {
MOECORE_ROUTING_PADDING_DECL
}
namespace ref {
MOECORE_ROUTING_PADDING_DECL
}
#undef MOECORE_ROUTING_PADDING_DECL

}  // namespace moecore::kernels
