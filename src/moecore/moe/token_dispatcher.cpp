// Single-process token dispatcher: permutes tokens into expert-major order
// (Megatron's permute with a routing map: experts in order, tokens ascending
// within each expert) and restores them by scatter-add. Shapes: T tokens, H
// hidden, E experts, R permuted rows (sum of tokens_per_expert_E).
#include "moecore/moe/token_dispatcher.h"

#include <algorithm>
#include <cstring>
#include <stdexcept>
#include <string>

namespace moecore {
namespace {

// For each token, the rows that came from it, in ascending row order (CSR).
// Lets the scatter-add run in parallel over tokens while every token sums its
// rows in one fixed order, so results do not depend on the thread count.
struct TokenRows {
  std::vector<int64_t> begin_T1;  // [T + 1]
  std::vector<int64_t> rows;
};

TokenRows rows_by_token(const DispatchState &state) {
  TokenRows index;
  index.begin_T1.assign(static_cast<size_t>(state.T + 1), 0);
  for (const int64_t t : state.source_token_R) {
    if (t >= 0) ++index.begin_T1[static_cast<size_t>(t + 1)];
  }
  for (int64_t t = 0; t < state.T; ++t) index.begin_T1[t + 1] += index.begin_T1[t];
  index.rows.resize(static_cast<size_t>(index.begin_T1.back()));
  std::vector<int64_t> fill(index.begin_T1.begin(), index.begin_T1.end() - 1);
  const int64_t R = static_cast<int64_t>(state.source_token_R.size());
  for (int64_t r = 0; r < R; ++r) {
    const int64_t t = state.source_token_R[r];
    if (t >= 0) index.rows[fill[t]++] = r;
  }
  return index;
}

// out_TH[t] += sum of rows_RH[r] over the rows r of token t.
void scatter_add(float *out_TH, const float *rows_RH, const DispatchState &state) {
  const TokenRows index = rows_by_token(state);
  const int64_t T = state.T, H = state.H;
#pragma omp parallel for schedule(static) if (T * H > 16384)
  for (int64_t t = 0; t < T; ++t) {
    float *out = out_TH + t * H;
    for (int64_t i = index.begin_T1[t]; i < index.begin_T1[t + 1]; ++i) {
      const float *row = rows_RH + index.rows[i] * H;
#pragma omp simd
      for (int64_t h = 0; h < H; ++h) out[h] += row[h];
    }
  }
}

// dst_RH[r] = src_TH[source_token_R[r]] (zeros for padding rows).
void gather_rows(float *dst_RH, const float *src_TH, const DispatchState &state) {
  const int64_t R = static_cast<int64_t>(state.source_token_R.size()), H = state.H;
#pragma omp parallel for schedule(static) if (R * H > 16384)
  for (int64_t r = 0; r < R; ++r) {
    const int64_t t = state.source_token_R[r];
    float *dst = dst_RH + r * H;
    if (t < 0) {
      std::fill_n(dst, H, 0.0f);
    } else {
      std::memcpy(dst, src_TH + t * H, sizeof(float) * static_cast<size_t>(H));
    }
  }
}

void check_routing(const RouterOutput &routing, const int64_t T, const int64_t E) {
  if (static_cast<int64_t>(routing.routing_map_TE.size()) != T * E) {
    throw std::invalid_argument("token dispatcher: routing map has " + std::to_string(routing.routing_map_TE.size()) +
                                " entries, expected T*E = " + std::to_string(T * E));
  }
  if (!routing.probs_TE.defined() || routing.probs_TE.numel() != T * E || routing.probs_TE.dtype() != DType::kF32) {
    throw std::invalid_argument("token dispatcher: probs must be fp32 [T, E] = [" + std::to_string(T) + ", " +
                                std::to_string(E) + "]");
  }
}

class LocalDispatcher final : public TokenDispatcher {
 public:
  Tensor dispatch(const float *x_TH, const int64_t T, const int64_t H, const RouterOutput &routing,
                  DispatchState &state) override {
    const int64_t E = static_cast<int64_t>(routing.tokens_per_expert_E.size());
    if (T < 0 || H <= 0 || E <= 0) {
      throw std::invalid_argument("token dispatcher: bad sizes T=" + std::to_string(T) + " H=" + std::to_string(H) +
                                  " E=" + std::to_string(E));
    }
    check_routing(routing, T, E);
    const float *probs_TE = routing.probs_TE.data<float>();

    state = DispatchState{};
    state.T = T;
    state.H = H;
    state.E = E;
    state.tokens_per_expert_E.assign(static_cast<size_t>(E), 0);
    for (int64_t e = 0; e < E; ++e) {
      const int64_t begin = static_cast<int64_t>(state.source_token_R.size());
      for (int64_t t = 0; t < T; ++t) {
        if (routing.routing_map_TE[t * E + e] == 0) continue;
        state.source_token_R.push_back(t);
        state.expert_R.push_back(e);
        state.probs_R.push_back(probs_TE[t * E + e]);
      }
      const int64_t routed = static_cast<int64_t>(state.source_token_R.size()) - begin;
      const int64_t rows = routing.tokens_per_expert_E[e];
      if (rows != routed) {
        // Pad-to-capacity: the router reports C rows per expert while the map
        // holds at most C tokens.
        if (routing.capacity < 0 || rows != routing.capacity || routed > rows) {
          throw std::invalid_argument("token dispatcher: expert " + std::to_string(e) + " has " +
                                      std::to_string(routed) + " routed tokens but tokens_per_expert says " +
                                      std::to_string(rows) + " (capacity " + std::to_string(routing.capacity) + ")");
        }
        state.source_token_R.insert(state.source_token_R.end(), rows - routed, -1);
        state.expert_R.insert(state.expert_R.end(), rows - routed, e);
        state.probs_R.insert(state.probs_R.end(), rows - routed, 0.0f);
      }
      state.tokens_per_expert_E[e] = rows;
    }

    const int64_t R = static_cast<int64_t>(state.source_token_R.size());
    Tensor x_RH({R, H}, DType::kF32, MemCategory::kActivations);
    gather_rows(x_RH.data<float>(), x_TH, state);
    return x_RH;
  }

  void combine(float *out_TH, const float *y_RH, const DispatchState &state) override {
    scatter_add(out_TH, y_RH, state);
  }

  void combine_backward(float *dy_RH, const float *dout_TH, const DispatchState &state) override {
    gather_rows(dy_RH, dout_TH, state);
  }

  void dispatch_backward(float *dx_TH, const float *dx_RH, const DispatchState &state) override {
    scatter_add(dx_TH, dx_RH, state);
  }

  void probs_backward(float *dprobs_TE, const float *dprobs_R, const DispatchState &state) override {
    const int64_t R = static_cast<int64_t>(state.source_token_R.size());
    for (int64_t r = 0; r < R; ++r) {
      const int64_t t = state.source_token_R[r];
      if (t >= 0) dprobs_TE[t * state.E + state.expert_R[r]] += dprobs_R[r];
    }
  }
};

}  // namespace

std::unique_ptr<TokenDispatcher> make_local_dispatcher() { return std::make_unique<LocalDispatcher>(); }

}  // namespace moecore
