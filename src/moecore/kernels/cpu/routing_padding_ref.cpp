// Naive reference routing-map padding: each expert's column counted and padded in turn.
#include "moecore/kernels/cpu/routing_padding.h"

namespace moecore::kernels::ref {

void pad_routing_map(uint8_t* map_TE, int64_t* counts_E, const int64_t T, const int64_t E, const int64_t multiple) {
  for (int64_t e = 0; e < E; ++e) {
    int64_t count = 0;
    for (int64_t t = 0; t < T; ++t) count += map_TE[t * E + e] != 0;
    for (int64_t t = 0; t < T && count % multiple != 0; ++t) {
      if (map_TE[t * E + e] != 0) continue;
      map_TE[t * E + e] = 1;
      ++count;
    }
    counts_E[e] = count;
  }
}

}  // namespace moecore::kernels::ref
