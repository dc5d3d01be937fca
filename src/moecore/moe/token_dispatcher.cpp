// Single-process token dispatcher: permutes tokens into expert-major order (Megatron's permute with a routing map:
// experts in order, tokens ascending within each expert) and restores them by scatter-add (unpermute). Shapes: T
// tokens, H hidden, E experts, R permuted rows (sum of tokens_per_expert_E). Also the helpers every dispatcher
// shares and the factory.
#include "moecore/moe/token_dispatcher.h"

#include <algorithm>
#include <stdexcept>
#include <string>

#include "moecore/moe/token_dispatcher_internal.h"
#include "moecore/ops/expert_rows.h"
#include "moecore/ops/moe_rows.h"
#include "moecore/ops/precision.h"

namespace moecore {
namespace detail {

void check_routing(const RouterOutput &routing, const int64_t T, const int64_t E) {
  if (routing_map_entries(routing) != T * E) {
    throw std::invalid_argument("token dispatcher: routing map has " + std::to_string(routing_map_entries(routing)) +
                                " entries, expected T*E = " + std::to_string(T * E));
  }
  if (!routing.probs_TE.defined() || routing.probs_TE.numel() != T * E || routing.probs_TE.dtype() != DType::kF32) {
    throw std::invalid_argument("token dispatcher: probs must be fp32 [T, E] = [" + std::to_string(T) + ", " +
                                std::to_string(E) + "]");
  }
}

void check_tokens(const char *dispatcher, const Tensor &x_TH) {
  if (!x_TH.defined() || !ops::activation_storage(x_TH.dtype()) || x_TH.ndim() != 2 || x_TH.dim(1) <= 0) {
    throw std::invalid_argument(std::string(dispatcher) + ": tokens must be an fp32 [T, H] tensor with H > 0, got " +
                                (x_TH.defined() ? x_TH.shape_str() : std::string("none")));
  }
}

Tensor expert_major_rows(std::vector<int64_t> &token_R, const Tensor &map_TE, const Tensor &probs_TE,
                         const int64_t e_begin, const std::span<const int64_t> rows_X, const int64_t capacity) {
  int64_t R = 0;
  for (const int64_t rows : rows_X) R += std::max<int64_t>(rows, 0);  // the op refuses a negative count
  token_R.resize(static_cast<size_t>(R));
  Tensor tokens = Tensor::from_blob(token_R.data(), {R}, map_TE.device());
  Tensor probs_R({R}, DType::kF32, MemCategory::kActivations, map_TE.device());
  ops::expert_major_rows(tokens, probs_R, map_TE, probs_TE, e_begin, rows_X, capacity);
  return probs_R;
}

Tensor probs_tensor(const std::vector<float> &probs_R) {
  Tensor out = activation_rows({static_cast<int64_t>(probs_R.size())});
  out.copy_from(Tensor::from_blob(probs_R.data(), {static_cast<int64_t>(probs_R.size())}));
  return out;
}

void add_probs_gradients(Tensor &dprobs_TE, const Tensor &dprobs_N, const std::vector<int64_t> &token_N,
                         const std::vector<int64_t> &expert_N, const int64_t T, const int64_t E) {
  // Each (token, expert) pair is one element of the [T E, 1] view.
  std::vector<int64_t> element_N(token_N.size());
  for (size_t n = 0; n < element_N.size(); ++n) element_N[n] = token_N[n] < 0 ? -1 : token_N[n] * E + expert_N[n];
  Tensor dprobs = dprobs_TE.view({T * E, 1});
  const ops::ScopedActivationDType fp32(DType::kF32);  // router gradients stay fp32
  ops::moe_unpermute(dprobs, dprobs_N.view({dprobs_N.numel(), 1}), element_N);
}

}  // namespace detail

namespace {

class LocalDispatcher final : public TokenDispatcher {
 public:
  DispatchBuffers dispatch_preprocess(const Tensor &x_TH, const RouterOutput &routing, DispatchState &state) override {
    const int64_t E = static_cast<int64_t>(routing.tokens_per_expert_E.size());
    detail::check_tokens("token dispatcher", x_TH);
    const int64_t T = x_TH.dim(0), H = x_TH.dim(1);
    if (E <= 0) throw std::invalid_argument("token dispatcher: bad sizes T=" + std::to_string(T) + " E=0");
    detail::check_routing(routing, T, E);

    state = DispatchState{};
    state.T = T;
    state.H = H;
    state.E = E;
    state.tokens_per_expert_E = routing.tokens_per_expert_E;
    Tensor probs_R =
        detail::expert_major_rows(state.source_token_R, routing.routing_map_TE.view({T, E}),
                                  routing.probs_TE.view({T, E}), 0, routing.tokens_per_expert_E, routing.capacity);
    for (int64_t e = 0; e < E; ++e) {
      state.expert_R.insert(state.expert_R.end(), static_cast<size_t>(routing.tokens_per_expert_E[e]), e);
    }
    DispatchBuffers out{detail::activation_rows({static_cast<int64_t>(state.source_token_R.size()), H}, x_TH.dtype()),
                        std::move(probs_R)};
    ops::moe_permute(out.rows, x_TH, state.source_token_R);
    return out;
  }

  // One process: nothing to exchange.
  DispatchBuffers token_dispatch(const DispatchBuffers &local, DispatchState & /*state*/,
                                 const std::function<void()> *overlapped) override {
    if (overlapped) (*overlapped)();
    return local;
  }

  Tensor dispatch_postprocess(const DispatchBuffers &received, DispatchState &state) override {
    state.probs_R = received.probs;
    return received.rows;
  }

  Tensor combine_preprocess(const Tensor &y_RH, const DispatchState & /*state*/) override { return y_RH; }
  Tensor token_combine(const Tensor &rows, const DispatchState & /*state*/) override { return rows; }
  void combine_postprocess(Tensor &out_TH, const Tensor &rows, const DispatchState &state) override {
    ops::moe_unpermute(out_TH, rows, state.source_token_R);
  }

  void combine_backward(Tensor &dy_RH, const Tensor &dout_TH, const DispatchState &state,
                        const std::function<void()> *overlapped) override {
    if (overlapped) (*overlapped)();
    ops::moe_unpermute_backward(&dy_RH, nullptr, dout_TH, state.source_token_R);
  }

  void probs_backward(Tensor &dprobs_TE, const Tensor &dprobs_R, const DispatchState &state) override {
    detail::add_probs_gradients(dprobs_TE, dprobs_R, state.source_token_R, state.expert_R, state.T, state.E);
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
  switch (type) {
    case TokenDispatcherType::kAllToAll: return detail::make_alltoall_dispatcher(num_experts, parallel);
    case TokenDispatcherType::kFlex: return detail::make_flex_dispatcher(num_experts, parallel);
    case TokenDispatcherType::kAllGather: break;
  }
  return detail::make_allgather_dispatcher(num_experts, parallel);
}

}  // namespace moecore
