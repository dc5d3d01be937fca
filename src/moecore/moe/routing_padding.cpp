#include "moecore/moe/routing_padding.h"

#include <stdexcept>
#include <string>

#include "moecore/ops/routing_padding.h"

namespace moecore {

int64_t align_size_for_quantization(const quant::Recipe recipe) {
  switch (recipe) {
    case quant::Recipe::kMxfp8: return 32;
    case quant::Recipe::kNvfp4: return 128;
    default: return 16;
  }
}

std::vector<int64_t> pad_routing_map(const std::span<uint8_t> routing_map_TE, const int64_t T, const int64_t E,
                                     const int64_t pad_multiple) {
  if (pad_multiple < 1 || static_cast<int64_t>(routing_map_TE.size()) != T * E) {
    throw std::invalid_argument("pad_routing_map: a [" + std::to_string(T) + ", " + std::to_string(E) + "] map needs " +
                                std::to_string(T * E) + " entries and a positive multiple, got " +
                                std::to_string(routing_map_TE.size()) + " and " + std::to_string(pad_multiple));
  }
  std::vector<int64_t> count_E(static_cast<size_t>(E), 0);
  Tensor map = Tensor::from_blob(routing_map_TE.data(), {T, E});
  Tensor counts = Tensor::from_blob(count_E.data(), {E});
  ops::pad_routing_map(map, counts, pad_multiple);
  return count_E;
}

RouterOutput padded_routing(const RouterOutput& routing, const int64_t T, const int64_t E, const int64_t pad_multiple) {
  RouterOutput out;
  out.probs_TE = routing.probs_TE;
  out.routing_map_TE = routing.routing_map_TE.clone(MemCategory::kActivations);
  out.capacity = routing.capacity;
  out.tokens_per_expert_E = pad_routing_map(out.routing_map_TE.span<uint8_t>(), T, E, pad_multiple);
  return out;
}

}  // namespace moecore
