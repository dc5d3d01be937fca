// Fast expert-major rows: two passes over the map row by row (count, place), reading a byte map eight entries at a
// time and skipping zero words (a token selects k of E experts, so most words are empty): the cost is the map's
// size over eight, not E strided column scans.
#include "moecore/kernels/cpu/expert_rows.h"

#include <algorithm>
#include <cstring>
#include <vector>

namespace moecore::kernels::cpu {
namespace {

// Calls fn(e) for every e in [e_begin, e_end) where row_E[e] is set, in ascending order.
template <typename Fn>
void for_each_selected(const uint8_t* row_E, const int64_t e_begin, const int64_t e_end, Fn&& fn) {
  int64_t e = e_begin;
  for (; e + 8 <= e_end; e += 8) {
    uint64_t word = 0;
    std::memcpy(&word, row_E + e, sizeof word);
    if (word == 0) continue;
    for (int64_t i = 0; i < 8; ++i) {
      if (row_E[e + i] != 0) fn(e + i);
    }
  }
  for (; e < e_end; ++e) {
    if (row_E[e] != 0) fn(e);
  }
}

}  // namespace

void expert_routed_counts(int64_t* routed_X, const uint8_t* map_TE, const int64_t T, const int64_t E,
                          const int64_t e_begin, const int64_t e_end) {
  std::fill_n(routed_X, e_end - e_begin, int64_t{0});
  for (int64_t t = 0; t < T; ++t) {
    for_each_selected(map_TE + t * E, e_begin, e_end, [&](const int64_t e) { ++routed_X[e - e_begin]; });
  }
}

template <typename T>
void expert_major_rows(int64_t* token_R, T* probs_R, const uint8_t* map_TE, const T* probs_TE, const int64_t num_tokens,
                       const int64_t E, const int64_t e_begin, const int64_t e_end, const int64_t* rows_X) {
  const int64_t X = e_end - e_begin;
  std::vector<int64_t> next_X(static_cast<size_t>(X));
  int64_t R = 0;
  for (int64_t x = 0; x < X; ++x) {
    next_X[static_cast<size_t>(x)] = R;
    R += rows_X[x];
  }
  std::fill_n(token_R, R, int64_t{-1});
  std::fill_n(probs_R, R, T(0));
  for (int64_t t = 0; t < num_tokens; ++t) {
    for_each_selected(map_TE + t * E, e_begin, e_end, [&](const int64_t e) {
      const int64_t r = next_X[static_cast<size_t>(e - e_begin)]++;
      token_R[r] = t;
      probs_R[r] = probs_TE[t * E + e];
    });
  }
}

template void expert_major_rows<float>(int64_t*, float*, const uint8_t*, const float*, int64_t, int64_t, int64_t,
                                       int64_t, const int64_t*);
template void expert_major_rows<double>(int64_t*, double*, const uint8_t*, const double*, int64_t, int64_t, int64_t,
                                        int64_t, const int64_t*);

}  // namespace moecore::kernels::cpu
