// Single-process token dispatcher: permutes tokens into expert-major order
// (Megatron's permute with a routing map: experts in order, tokens ascending
// within each expert) and restores them by scatter-add. Shapes: T tokens, H
// hidden, E experts, R permuted rows (sum of tokens_per_expert_E). Also the
// helpers every dispatcher shares and the factory.
#include "moecore/moe/token_dispatcher.h"

#include <algorithm>
#include <cstring>
#include <stdexcept>
#include <string>

#include "moecore/moe/token_dispatcher_internal.h"
#include "moecore/ops/rows.h"

namespace moecore {
namespace detail {

void check_routing(const RouterOutput &routing, const int64_t T, const int64_t E) {
  if (!routing.routing_map_TE.defined() || routing.routing_map_TE.dtype() != DType::kU8 ||
      routing.routing_map_TE.numel() != T * E) {
    throw std::invalid_argument("token dispatcher: routing map has " +
                                std::to_string(routing.routing_map_TE.defined() ? routing.routing_map_TE.numel() : 0) +
                                " entries, expected kU8 T*E = " + std::to_string(T * E));
  }
  if (!routing.probs_TE.defined() || routing.probs_TE.numel() != T * E || routing.probs_TE.dtype() != DType::kF32) {
    throw std::invalid_argument("token dispatcher: probs must be fp32 [T, E] = [" + std::to_string(T) + ", " +
                                std::to_string(E) + "]");
  }
}

void scatter_add_rows(float *out_NH, const int64_t N, const float *rows_RH, const std::vector<int64_t> &index_R,
                      const int64_t H) {
  Tensor out = Tensor::from_blob(out_NH, {N, H});
  ops::scatter_add_rows(out, Tensor::from_blob(rows_RH, {static_cast<int64_t>(index_R.size()), H}), index_R);
}

void gather_rows(float *dst_RH, const float *src_NH, const std::vector<int64_t> &index_R, const int64_t H) {
  const auto R = static_cast<int64_t>(index_R.size());
  int64_t N = 0;  // the rows of src the index reaches
  for (const int64_t n : index_R) N = std::max(N, n + 1);
  Tensor dst = Tensor::from_blob(dst_RH, {R, H});
  if (N == 0) {
    dst.zero_();
    return;
  }
  ops::gather_rows(dst, Tensor::from_blob(src_NH, {N, H}), index_R);
}

}  // namespace detail

namespace {

class LocalDispatcher final : public TokenDispatcher {
 public:
  Tensor dispatch(const float *x_TH, const int64_t T, const int64_t H, const RouterOutput &routing,
                  DispatchState &state) override {
    const int64_t E = static_cast<int64_t>(routing.tokens_per_expert_E.size());
    if (T < 0 || H <= 0 || E <= 0) {
      throw std::invalid_argument("token dispatcher: bad sizes T=" + std::to_string(T) + " H=" + std::to_string(H) +
                                  " E=" + std::to_string(E));
    }
    detail::check_routing(routing, T, E);
    const float *probs_TE = routing.probs_TE.data<float>();

    state = DispatchState{};
    state.T = T;
    state.H = H;
    state.E = E;
    state.tokens_per_expert_E = routing.tokens_per_expert_E;
    detail::ExpertMajorRows rows = detail::expert_major_rows(routing.routing_map_TE.data<uint8_t>(), probs_TE, T, E, 0,
                                                             E, routing.tokens_per_expert_E, routing.capacity);
    state.source_token_R = std::move(rows.token_R);
    state.probs_R = std::move(rows.probs_R);
    for (int64_t e = 0; e < E; ++e) {
      state.expert_R.insert(state.expert_R.end(), static_cast<size_t>(routing.tokens_per_expert_E[e]), e);
    }

    const int64_t R = static_cast<int64_t>(state.source_token_R.size());
    Tensor x_RH({R, H}, DType::kF32, MemCategory::kActivations);
    detail::gather_rows(x_RH.data<float>(), x_TH, state.source_token_R, H);
    return x_RH;
  }

  void combine(float *out_TH, const float *y_RH, const DispatchState &state) override {
    detail::scatter_add_rows(out_TH, state.T, y_RH, state.source_token_R, state.H);
  }

  void combine_backward(float *dy_RH, const float *dout_TH, const DispatchState &state) override {
    detail::gather_rows(dy_RH, dout_TH, state.source_token_R, state.H);
  }

  void dispatch_backward(float *dx_TH, const float *dx_RH, const DispatchState &state) override {
    detail::scatter_add_rows(dx_TH, state.T, dx_RH, state.source_token_R, state.H);
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

std::unique_ptr<TokenDispatcher> make_token_dispatcher(const TokenDispatcherType type, const int64_t num_experts,
                                                       const parallel::ParallelState &parallel) {
  if (num_experts <= 0 || num_experts % parallel.ep_size() != 0) {
    throw std::invalid_argument("token dispatcher: " + std::to_string(num_experts) +
                                " experts are not divisible by the expert-parallel size " +
                                std::to_string(parallel.ep_size()));
  }
  if (parallel.tp_ep.size() == 1) return make_local_dispatcher();
  return type == TokenDispatcherType::kAllToAll ? detail::make_alltoall_dispatcher(num_experts, parallel)
                                                : detail::make_allgather_dispatcher(num_experts, parallel);
}

}  // namespace moecore
