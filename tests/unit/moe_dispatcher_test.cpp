// Local token dispatcher: permutation order (expert-major, tokens ascending) against an independent listing,
// dropless permute -> *prob(1/k) -> combine restoring the input and its gradient, pad-to-capacity rows, the
// drop-and-pad output equal to dropping without padding, probs_backward, and bad routing input.
#include <gtest/gtest.h>

#include <algorithm>
#include <numeric>
#include <random>
#include <stdexcept>
#include <tuple>
#include <vector>

#include "kernel_test_util.h"
#include "moecore/moe/token_dispatcher.h"

namespace moecore {
namespace {

// Tensor views of a test's vectors, rows of width W; ref() lets a view stand for an output argument.
Tensor view(const std::vector<float>& v, const int64_t W) {
  return Tensor::from_blob(v.data(), {static_cast<int64_t>(v.size()) / W, W});
}
Tensor& ref(Tensor&& t) { return t; }

using test::random_vector;

// Top-k routing of T tokens over E experts: k distinct random experts per token, each with prob 1/k.
RouterOutput uniform_topk_routing(const int64_t T, const int64_t E, const int64_t k, const uint64_t seed) {
  RouterOutput out;
  out.probs_TE = Tensor({T, E}, DType::kF32);
  out.routing_map_TE = Tensor::zeros({T, E}, DType::kU8);
  out.tokens_per_expert_E.assign(static_cast<size_t>(E), 0);
  std::mt19937_64 gen(seed);
  std::vector<int64_t> experts(static_cast<size_t>(E));
  for (int64_t t = 0; t < T; ++t) {
    std::iota(experts.begin(), experts.end(), 0);
    std::shuffle(experts.begin(), experts.end(), gen);
    for (int64_t j = 0; j < k; ++j) {
      const int64_t e = experts[static_cast<size_t>(j)];
      out.routing_map_TE.data<uint8_t>()[t * E + e] = 1;
      out.probs_TE.data<float>()[t * E + e] = 1.0f / static_cast<float>(k);
      ++out.tokens_per_expert_E[e];
    }
  }
  return out;
}

// Keeps at most C tokens per expert (the earliest), as a capacity-dropping router would.
void drop_to_capacity(RouterOutput& routing, const int64_t T, const int64_t E, const int64_t C, const bool pad) {
  for (int64_t e = 0; e < E; ++e) {
    int64_t kept = 0;
    for (int64_t t = 0; t < T; ++t) {
      if (routing.routing_map_TE.data<uint8_t>()[t * E + e] == 0) continue;
      if (kept == C) {
        routing.routing_map_TE.data<uint8_t>()[t * E + e] = 0;
        routing.probs_TE.data<float>()[t * E + e] = 0.0f;
      } else {
        ++kept;
      }
    }
    routing.tokens_per_expert_E[e] = pad ? C : kept;
  }
  routing.capacity = C;
}

// E = 19 and 64 take the map eight entries at a time (and a tail of 3 for 19), E = 5 entry by entry.
TEST(LocalDispatcherTest, PermutesExpertMajorWithTokensAscending) {
  for (const auto& [T, E, k] : {std::tuple<int64_t, int64_t, int64_t>{23, 5, 2}, {37, 19, 3}, {41, 64, 8}}) {
    SCOPED_TRACE("E=" + std::to_string(E));
    const int64_t H = 7;
    const RouterOutput routing = uniform_topk_routing(T, E, k, static_cast<uint64_t>(E));
    // Give each (token, expert) a distinct prob so the gathered probs identify their source.
    RouterOutput distinct = routing;
    distinct.probs_TE = Tensor({T, E}, DType::kF32);
    for (int64_t i = 0; i < T * E; ++i) {
      distinct.probs_TE.data<float>()[i] =
          routing.routing_map_TE.data<uint8_t>()[i] ? 0.001f * static_cast<float>(i + 1) : 0.0f;
    }
    const auto x_TH = random_vector<float>(static_cast<size_t>(T * H), 2);
    auto dispatcher = make_local_dispatcher();
    DispatchState state;
    const Tensor x_RH = dispatcher->dispatch(view(x_TH, H), distinct, state);

    std::vector<int64_t> expected_source, expected_expert;
    for (int64_t e = 0; e < E; ++e) {
      for (int64_t t = 0; t < T; ++t) {
        if (routing.routing_map_TE.data<uint8_t>()[t * E + e]) {
          expected_source.push_back(t);
          expected_expert.push_back(e);
        }
      }
    }
    ASSERT_EQ(x_RH.dim(0), T * k);
    ASSERT_EQ(x_RH.dim(1), H);
    EXPECT_EQ(state.source_token_R, expected_source);
    EXPECT_EQ(state.expert_R, expected_expert);
    EXPECT_EQ(state.tokens_per_expert_E, routing.tokens_per_expert_E);
    for (size_t r = 0; r < expected_source.size(); ++r) {
      const int64_t t = expected_source[r], e = expected_expert[r];
      EXPECT_FLOAT_EQ(state.probs_R.data<float>()[r], 0.001f * static_cast<float>(t * E + e + 1));
      for (int64_t h = 0; h < H; ++h) EXPECT_EQ(x_RH.data<float>()[r * H + h], x_TH[t * H + h]);
    }
  }
}

TEST(LocalDispatcherTest, DroplessRoundTripRestoresInputAndGradient) {
  for (const int64_t k : {1, 2, 3}) {
    const int64_t T = 41, E = 6, H = 9;
    const RouterOutput routing = uniform_topk_routing(T, E, k, 10 + k);
    const auto x_TH = random_vector<float>(static_cast<size_t>(T * H), 20 + k);
    auto dispatcher = make_local_dispatcher();
    DispatchState state;
    const Tensor x_RH = dispatcher->dispatch(view(x_TH, H), routing, state);
    const int64_t R = x_RH.dim(0);
    ASSERT_EQ(R, T * k);

    // Forward: y = x * prob per row, combined: sum_j x / k = x.
    std::vector<float> y_RH(static_cast<size_t>(R * H));
    for (int64_t r = 0; r < R; ++r) {
      for (int64_t h = 0; h < H; ++h) y_RH[r * H + h] = x_RH.data<float>()[r * H + h] * state.probs_R.data<float>()[r];
    }
    std::vector<float> out_TH(static_cast<size_t>(T * H), 0.0f);
    dispatcher->combine(ref(view(out_TH, H)), view(y_RH, H), state);
    for (int64_t i = 0; i < T * H; ++i) EXPECT_NEAR(out_TH[i], x_TH[i], 1e-6) << "k=" << k;

    // Backward: dout -> combine_backward -> * prob -> dispatch_backward gives dout back.
    const auto dout_TH = random_vector<float>(static_cast<size_t>(T * H), 30 + k);
    std::vector<float> dy_RH(static_cast<size_t>(R * H), 99.0f);  // overwritten
    dispatcher->combine_backward(ref(view(dy_RH, H)), view(dout_TH, H), state);
    for (int64_t r = 0; r < R; ++r) {
      for (int64_t h = 0; h < H; ++h) {
        EXPECT_EQ(dy_RH[r * H + h], dout_TH[state.source_token_R[r] * H + h]);
        dy_RH[r * H + h] *= state.probs_R.data<float>()[r];
      }
    }
    std::vector<float> dx_TH(static_cast<size_t>(T * H), 0.0f);
    dispatcher->dispatch_backward(ref(view(dx_TH, H)), view(dy_RH, H), state);
    for (int64_t i = 0; i < T * H; ++i) EXPECT_NEAR(dx_TH[i], dout_TH[i], 1e-6) << "k=" << k;
  }
}

TEST(LocalDispatcherTest, DispatchBackwardAccumulates) {
  const int64_t T = 11, E = 4, k = 2, H = 5;
  const RouterOutput routing = uniform_topk_routing(T, E, k, 3);
  const auto x_TH = random_vector<float>(static_cast<size_t>(T * H), 4);
  auto dispatcher = make_local_dispatcher();
  DispatchState state;
  dispatcher->dispatch(view(x_TH, H), routing, state);
  const auto dx_RH = random_vector<float>(static_cast<size_t>(T * k * H), 5);
  const auto dx0_TH = random_vector<float>(static_cast<size_t>(T * H), 6);
  auto dx_TH = dx0_TH;
  dispatcher->dispatch_backward(ref(view(dx_TH, H)), view(dx_RH, H), state);
  std::vector<double> expected(dx0_TH.begin(), dx0_TH.end());
  int64_t r = 0;
  for (int64_t e = 0; e < E; ++e) {
    for (int64_t t = 0; t < T; ++t) {
      if (!routing.routing_map_TE.data<uint8_t>()[t * E + e]) continue;
      for (int64_t h = 0; h < H; ++h) expected[t * H + h] += dx_RH[r * H + h];
      ++r;
    }
  }
  for (int64_t i = 0; i < T * H; ++i) EXPECT_NEAR(dx_TH[i], expected[i], 1e-6);
}

TEST(LocalDispatcherTest, PadToCapacityGivesExactlyCRowsPerExpert) {
  const int64_t T = 30, E = 4, k = 2, H = 6, C = 12;  // 60 slots over 4 experts: some exceed C, some fall short
  RouterOutput padded = uniform_topk_routing(T, E, k, 7);
  RouterOutput dropped = padded;
  dropped.routing_map_TE = padded.routing_map_TE.clone();
  drop_to_capacity(padded, T, E, C, /*pad=*/true);
  drop_to_capacity(dropped, T, E, C, /*pad=*/false);
  const auto x_TH = random_vector<float>(static_cast<size_t>(T * H), 8);
  auto dispatcher = make_local_dispatcher();

  DispatchState pad_state, drop_state;
  const Tensor xp_RH = dispatcher->dispatch(view(x_TH, H), padded, pad_state);
  const Tensor xd_RH = dispatcher->dispatch(view(x_TH, H), dropped, drop_state);
  ASSERT_EQ(xp_RH.dim(0), E * C);
  EXPECT_EQ(pad_state.tokens_per_expert_E, std::vector<int64_t>(static_cast<size_t>(E), C));
  int64_t padding_rows = 0;
  for (int64_t e = 0; e < E; ++e) {
    const int64_t routed = drop_state.tokens_per_expert_E[e];
    EXPECT_LE(routed, C);
    for (int64_t j = 0; j < C; ++j) {
      const int64_t r = e * C + j;
      EXPECT_EQ(pad_state.expert_R[r], e);
      if (j < routed) {  // the routed tokens first, ascending, as without padding
        const int64_t rd = std::accumulate(drop_state.tokens_per_expert_E.begin(),
                                           drop_state.tokens_per_expert_E.begin() + e, int64_t{0}) +
                           j;
        EXPECT_EQ(pad_state.source_token_R[r], drop_state.source_token_R[rd]);
        EXPECT_EQ(pad_state.probs_R.data<float>()[r], drop_state.probs_R.data<float>()[rd]);
      } else {
        ++padding_rows;
        EXPECT_EQ(pad_state.source_token_R[r], -1);
        EXPECT_EQ(pad_state.probs_R.data<float>()[r], 0.0f);
        for (int64_t h = 0; h < H; ++h) EXPECT_EQ(xp_RH.data<float>()[r * H + h], 0.0f);
      }
    }
  }
  EXPECT_GT(padding_rows, 0);

  // Expert outputs: any function of the row; padding rows carry garbage that combine must skip.
  auto expert_out = [&](const Tensor& x_RH, const DispatchState& state) {
    std::vector<float> y(static_cast<size_t>(x_RH.numel()));
    for (int64_t r = 0; r < x_RH.dim(0); ++r) {
      for (int64_t h = 0; h < H; ++h) {
        y[r * H + h] = state.source_token_R[r] < 0 ? 1e3f : 2.0f * x_RH.data<float>()[r * H + h] + 0.5f;
      }
    }
    return y;
  };
  std::vector<float> out_pad(static_cast<size_t>(T * H), 0.0f), out_drop(static_cast<size_t>(T * H), 0.0f);
  dispatcher->combine(ref(view(out_pad, H)), view(expert_out(xp_RH, pad_state), H), pad_state);
  dispatcher->combine(ref(view(out_drop, H)), view(expert_out(xd_RH, drop_state), H), drop_state);
  EXPECT_EQ(out_pad, out_drop);

  // combine_backward writes zeros into padding rows.
  const auto dout_TH = random_vector<float>(static_cast<size_t>(T * H), 9);
  std::vector<float> dy_RH(static_cast<size_t>(E * C * H), 5.0f);
  dispatcher->combine_backward(ref(view(dy_RH, H)), view(dout_TH, H), pad_state);
  for (int64_t r = 0; r < E * C; ++r) {
    for (int64_t h = 0; h < H; ++h) {
      const int64_t t = pad_state.source_token_R[r];
      EXPECT_EQ(dy_RH[r * H + h], t < 0 ? 0.0f : dout_TH[t * H + h]);
    }
  }
}

TEST(LocalDispatcherTest, ProbsBackwardScattersIntoRoutedEntries) {
  const int64_t T = 17, E = 5, k = 2, H = 3, C = 6;
  RouterOutput routing = uniform_topk_routing(T, E, k, 12);
  drop_to_capacity(routing, T, E, C, /*pad=*/true);
  const auto x_TH = random_vector<float>(static_cast<size_t>(T * H), 13);
  auto dispatcher = make_local_dispatcher();
  DispatchState state;
  dispatcher->dispatch(view(x_TH, H), routing, state);
  const int64_t R = static_cast<int64_t>(state.source_token_R.size());
  // dprobs_R encodes its (token, expert) so misplacement shows; padding rows get a value that must be ignored.
  std::vector<float> dprobs_R(static_cast<size_t>(R));
  for (int64_t r = 0; r < R; ++r) {
    const int64_t t = state.source_token_R[r];
    dprobs_R[r] = t < 0 ? 1e6f : static_cast<float>(t * E + state.expert_R[r]) + 0.25f;
  }
  const auto dprobs0_TE = random_vector<float>(static_cast<size_t>(T * E), 14);
  auto dprobs_TE = dprobs0_TE;
  dispatcher->probs_backward(ref(view(dprobs_TE, E)), view(dprobs_R, 1), state);
  for (int64_t t = 0; t < T; ++t) {
    for (int64_t e = 0; e < E; ++e) {
      const int64_t i = t * E + e;
      const float added = routing.routing_map_TE.data<uint8_t>()[i] ? static_cast<float>(i) + 0.25f : 0.0f;
      EXPECT_FLOAT_EQ(dprobs_TE[i], dprobs0_TE[i] + added);
    }
  }
}

TEST(LocalDispatcherTest, InconsistentRoutingThrows) {
  const int64_t T = 8, E = 3, H = 4;
  const auto x_TH = random_vector<float>(static_cast<size_t>(T * H), 15);
  auto dispatcher = make_local_dispatcher();
  DispatchState state;
  RouterOutput routing = uniform_topk_routing(T, E, 1, 16);
  RouterOutput wrong_counts = routing;
  wrong_counts.tokens_per_expert_E[0] += 1;  // no capacity: padding not allowed
  EXPECT_THROW(dispatcher->dispatch(view(x_TH, H), wrong_counts, state), std::invalid_argument);
  RouterOutput short_map = routing;
  short_map.routing_map_TE = Tensor({T * E - 1}, DType::kU8);  // one entry short
  EXPECT_THROW(dispatcher->dispatch(view(x_TH, H), short_map, state), std::invalid_argument);
}

TEST(TokenDispatcherFactoryTest, SingleProcessGivesTheLocalPermutationForBothTypes) {
  const int64_t T = 19, E = 6, k = 2, H = 4;
  const RouterOutput routing = uniform_topk_routing(T, E, k, 21);
  const auto x_TH = random_vector<float>(static_cast<size_t>(T * H), 22);
  const parallel::ParallelState parallel = parallel::ParallelState::single_process();
  DispatchState expected_state;
  const Tensor expected_RH = make_local_dispatcher()->dispatch(view(x_TH, H), routing, expected_state);
  for (const TokenDispatcherType type : {TokenDispatcherType::kAllGather, TokenDispatcherType::kAllToAll}) {
    auto dispatcher = make_token_dispatcher(type, E, parallel);
    DispatchState state;
    const Tensor x_RH = dispatcher->dispatch(view(x_TH, H), routing, state);
    ASSERT_EQ(x_RH.dim(0), expected_RH.dim(0));
    EXPECT_EQ(state.source_token_R, expected_state.source_token_R);
    EXPECT_EQ(state.expert_R, expected_state.expert_R);
    EXPECT_EQ(state.tokens_per_expert_E, expected_state.tokens_per_expert_E);
    for (int64_t i = 0; i < x_RH.numel(); ++i) EXPECT_EQ(x_RH.data<float>()[i], expected_RH.data<float>()[i]);
  }
  EXPECT_THROW(make_token_dispatcher(TokenDispatcherType::kAllToAll, 0, parallel), std::invalid_argument);
}

}  // namespace
}  // namespace moecore
