// Fast routing-map padding: the column sums in one row-major pass, then each expert's column filled independently
// (OpenMP over experts: an expert writes only its own column's bytes).
#include "moecore/kernels/cpu/routing_padding.h"

#include <algorithm>

namespace moecore::kernels::cpu {

void pad_routing_map(uint8_t* map_TE, int64_t* counts_E, const int64_t T, const int64_t E, const int64_t multiple) {
  std::fill_n(counts_E, E, int64_t{0});
  for (int64_t t = 0; t < T; ++t) {
    const uint8_t* row = map_TE + t * E;
    for (int64_t e = 0; e < E; ++e) counts_E[e] += row[e] != 0;
  }
#pragma omp parallel for schedule(dynamic) if (T * E > 65536)
  for (int64_t e = 0; e < E; ++e) {
    int64_t missing = (multiple - counts_E[e] % multiple) % multiple;
    counts_E[e] += std::min(missing, T - counts_E[e]);
    for (int64_t t = 0; t < T && missing > 0; ++t) {
      uint8_t& routed = map_TE[t * E + e];
      if (routed != 0) continue;
      routed = 1;
      --missing;
    }
  }
}

}  // namespace moecore::kernels::cpu
