// Distributed token dispatchers (allgather, alltoall) checked against a single-process reference. Every rank
// builds the same global data (each world rank's tokens, routing and output gradient from a seed and that rank),
// runs dispatch -> a per-expert function -> combine and the backward chain on its own slice, and compares with the
// reference computed from its own tokens: out_t = sum over routed e of f_e(x_t, p_te), f_e = (e + 1) p x (each ETP
// rank applies 1/ETP of it, so the ETP reduction sums back the full value). Routing cases: random top-k, capacity
// with dropping, capacity with padding, and one EP rank's experts starved (zero rows there). Each dispatched row is
// checked against the expected order (allgather: [local expert][source rank]; alltoall: [local expert][ETP rank]
// [EP source]; tokens ascending, then padding rows). The alltoall dispatcher's count exchange and chunk arithmetic
// are also checked with counts above 2^24 (exact only as integers). Runs as one process or under mpirun; prints one
// line per layout and case and "N passed, M failed" (rank 0); exits non-zero on failure.
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <numeric>
#include <random>
#include <string>
#include <vector>

#include "moecore/moe/token_dispatcher.h"
#include "moecore/moe/token_dispatcher_internal.h"
#include "moecore/parallel/comm_stats.h"
#include "moecore/parallel/mpi_runtime.h"
#include "moecore/parallel/parallel_state.h"
#include "moecore/parallel/process_group.h"
#include "parallel/dist_checks.h"

namespace {

using moecore::DispatchState;
using moecore::DType;
using moecore::ParallelSizes;
using moecore::RouterOutput;
using moecore::Tensor;
using moecore::TokenDispatcherType;
using moecore::detail::AllToAllCounts;
using moecore::detail::AllToAllPlan;
using moecore::detail::RowChunk;
using moecore::parallel::CommStats;
using moecore::parallel::MpiRuntime;
using moecore::parallel::ParallelState;
using moecore::parallel::ProcessGroup;
using moecore::parallel::ReduceOp;
using namespace moecore::test;  // NOLINT: check, g_rank, g_failures (dist_checks.h)

bool near(double got, double expected, double tol) {
  return std::abs(got - expected) <= tol * (1.0 + std::abs(expected));
}

constexpr int64_t kE = 8, kH = 5, kK = 2;

// Tensor views of a test's vectors, rows of width W; ref() lets a view stand for an output argument.
Tensor view(const std::vector<float>& v, const int64_t W) {
  return Tensor::from_blob(v.data(), {static_cast<int64_t>(v.size()) / W, W});
}
Tensor& ref(Tensor&& t) { return t; }

enum class Case { kTopK, kCapacityDrop, kCapacityPad, kStarved, kLargeCounts };
const char* case_name(Case c) {
  switch (c) {
    case Case::kTopK: return "topk";
    case Case::kCapacityDrop: return "capacity_drop";
    case Case::kCapacityPad: return "capacity_pad";
    case Case::kStarved: return "starved";
    case Case::kLargeCounts: return "alltoall_large_counts";
  }
  return "?";
}

// One world rank's micro-batch.
struct RankData {
  int64_t T = 0;
  std::vector<float> x_TH, dout_TH;
  RouterOutput routing;
};

// The data of world rank `rank`: T tokens, top-k routing with random probs; with a capacity C the earliest C tokens
// per expert are kept (and, with padding, tokens_per_expert = C). kStarved never picks experts [0, starve_end).
RankData make_data(const int rank, const int64_t T, const Case c, const int64_t starve_end, const uint64_t seed) {
  RankData d;
  d.T = T;
  std::mt19937_64 gen(seed * 1000003ULL + static_cast<uint64_t>(rank) * 7919ULL + static_cast<uint64_t>(c));
  std::uniform_real_distribution<float> value(-1.0f, 1.0f), prob(0.1f, 1.0f);
  d.x_TH.resize(static_cast<size_t>(T * kH));
  d.dout_TH.resize(static_cast<size_t>(T * kH));
  for (auto& v : d.x_TH) v = value(gen);
  for (auto& v : d.dout_TH) v = value(gen);
  RouterOutput& r = d.routing;
  r.probs_TE = Tensor({T, kE}, DType::kF32);
  std::fill_n(r.probs_TE.data<float>(), T * kE, 0.0f);
  r.routing_map_TE = Tensor::zeros({T, kE}, DType::kU8);
  r.tokens_per_expert_E.assign(static_cast<size_t>(kE), 0);
  const int64_t first = c == Case::kStarved ? starve_end : 0;
  std::vector<int64_t> experts(static_cast<size_t>(kE - first));
  for (int64_t t = 0; t < T; ++t) {
    std::iota(experts.begin(), experts.end(), first);
    std::shuffle(experts.begin(), experts.end(), gen);
    for (int64_t j = 0; j < kK; ++j) {
      const int64_t e = experts[static_cast<size_t>(j)];
      r.routing_map_TE.data<uint8_t>()[t * kE + e] = 1;
      r.probs_TE.data<float>()[t * kE + e] = prob(gen);
    }
  }
  const bool capped = c == Case::kCapacityDrop || c == Case::kCapacityPad;
  const int64_t C = 1;
  for (int64_t e = 0; e < kE; ++e) {
    int64_t kept = 0;
    for (int64_t t = 0; t < T; ++t) {
      if (r.routing_map_TE.data<uint8_t>()[t * kE + e] == 0) continue;
      if (capped && kept == C) {
        r.routing_map_TE.data<uint8_t>()[t * kE + e] = 0;
        r.probs_TE.data<float>()[t * kE + e] = 0.0f;
      } else {
        ++kept;
      }
    }
    r.tokens_per_expert_E[e] = c == Case::kCapacityPad ? C : kept;
  }
  if (capped) r.capacity = C;
  return d;
}

struct Result {
  std::vector<float> out_TH, dx_TH, dprobs_TE;
};

// One expected row of the dispatched buffer: its source (index in the ETP x EP group, world rank) and token (-1 for
// a padding row).
struct ExpectedRow {
  int64_t member = 0;
  int world_rank = 0;
  int64_t token = -1;
};

// Appends the rows world rank `source` sends to global expert e: its routed tokens ascending, then padding rows up
// to its tokens_per_expert.
void append_rows(std::vector<ExpectedRow>& rows, const RankData& data, const int64_t member, const int source,
                 const int64_t e) {
  int64_t routed = 0;
  for (int64_t t = 0; t < data.T; ++t) {
    if (data.routing.routing_map_TE.data<uint8_t>()[t * kE + e] == 0) continue;
    rows.push_back({member, source, t});
    ++routed;
  }
  for (int64_t i = routed; i < data.routing.tokens_per_expert_E[static_cast<size_t>(e)]; ++i) {
    rows.push_back({member, source, -1});
  }
}

// World rank of every member of `group`, by group rank.
std::vector<int> world_ranks_of(const ProcessGroup& group, const int world_rank) {
  const int64_t me = world_rank;
  std::vector<int64_t> ranks(static_cast<size_t>(group.size()));
  group.all_gather<int64_t>(std::span<const int64_t>(&me, 1), ranks);
  return std::vector<int>(ranks.begin(), ranks.end());
}

// The alltoall dispatcher's sources: world rank of (ETP rank j, EP source s) = the EP group of ETP rank j, member s.
std::vector<int64_t> alltoall_sources(const ParallelState& ps) {
  const std::vector<int> ep_members = world_ranks_of(ps.ep, ps.rank);
  const std::vector<int64_t> ep_members64(ep_members.begin(), ep_members.end());
  std::vector<int64_t> sources_JS(static_cast<size_t>(ps.etp_size() * ps.ep_size()));
  ps.etp.all_gather<int64_t>(ep_members64, sources_JS);
  return sources_JS;
}

// The rows this rank's local experts receive, in the dispatcher's order.
std::vector<ExpectedRow> expected_rows(const ParallelState& ps, const TokenDispatcherType type,
                                       const std::vector<RankData>& world_data) {
  const int64_t El = kE / ps.ep_size(), first_expert = ps.ep_rank() * El;
  std::vector<ExpectedRow> rows;
  if (type == TokenDispatcherType::kAllGather) {
    const std::vector<int> members = world_ranks_of(ps.tp_ep, ps.rank);
    for (int64_t le = 0; le < El; ++le) {
      for (size_t m = 0; m < members.size(); ++m) {
        append_rows(rows, world_data[static_cast<size_t>(members[m])], static_cast<int64_t>(m), members[m],
                    first_expert + le);
      }
    }
    return rows;
  }
  const std::vector<int64_t> sources_JS = alltoall_sources(ps);
  for (int64_t le = 0; le < El; ++le) {
    for (const int64_t source : sources_JS) {
      append_rows(rows, world_data[static_cast<size_t>(source)], -1, static_cast<int>(source), first_expert + le);
    }
  }
  return rows;
}

std::vector<int> gather_ints(const ProcessGroup& group, const int value) {
  std::vector<int> all(static_cast<size_t>(group.size()));
  group.all_gather<int>(std::span<const int>(&value, 1), all);
  return all;
}

// dispatch -> experts -> combine -> backward chain on this rank's data; checks everything against the reference.
Result run_dispatcher(const ParallelState& ps, const TokenDispatcherType type, const std::vector<RankData>& world_data,
                      const Case c, const std::string& label) {
  const RankData& mine = world_data[static_cast<size_t>(ps.rank)];
  const int64_t T = mine.T, H = kH, E = kE, El = E / ps.ep_size(), ETP = ps.etp_size();
  const int64_t first_expert = ps.ep_rank() * El;
  auto dispatcher = moecore::make_token_dispatcher(type, E, ps);

  const std::vector<int> members = world_ranks_of(ps.tp_ep, ps.rank);
  const std::vector<ExpectedRow> expected_R = expected_rows(ps, type, world_data);

  DispatchState state;
  const double inter_host_before = CommStats::instance().inter_host_bytes(true);
  const Tensor x_RH = dispatcher->dispatch(view(mine.x_TH, H), mine.routing, state);
  if (type == TokenDispatcherType::kFlex) {
    // Each token crosses to another host once per host holding any of its experts (an ETP replica of their EP rank).
    const std::vector<int> hosts = gather_ints(ps.world, ps.host), ep_ranks = gather_ints(ps.world, ps.ep_rank());
    int64_t crossings = 0;
    for (int64_t t = 0; t < T; ++t) {
      std::vector<int> needed;
      for (int64_t e = 0; e < E; ++e) {
        if (mine.routing.routing_map_TE.data<uint8_t>()[t * E + e] == 0) continue;
        for (const int m : members) {
          if (ep_ranks[static_cast<size_t>(m)] == e / El && hosts[static_cast<size_t>(m)] != ps.host) {
            needed.push_back(hosts[static_cast<size_t>(m)]);
          }
        }
      }
      std::sort(needed.begin(), needed.end());
      crossings += std::unique(needed.begin(), needed.end()) - needed.begin();
    }
    const double bytes = CommStats::instance().inter_host_bytes(true) - inter_host_before;
    check(bytes == static_cast<double>(crossings * H * 4),
          label + ": inter-host bytes " + std::to_string(bytes) + ", expected " + std::to_string(crossings * H * 4));
  }
  const int64_t R = x_RH.dim(0);
  check(x_RH.dim(1) == H, label + ": x_RH width");
  check(static_cast<int64_t>(state.expert_R.size()) == R && state.probs_R.numel() == R &&
            static_cast<int64_t>(expected_R.size()) == R,
        label + ": state sizes (R = " + std::to_string(R) + ", expected " + std::to_string(expected_R.size()) + ")");
  // The local dispatcher (a group of one) knows each row's token, the allgather one also its source rank; the
  // alltoall one, as Megatron's, only counts rows.
  const bool local = ps.tp_ep.size() == 1;
  const bool knows_tokens = local || type == TokenDispatcherType::kAllGather;
  const bool knows_ranks = !local && type == TokenDispatcherType::kAllGather;
  check(state.source_token_R.size() == (knows_tokens ? static_cast<size_t>(R) : 0) &&
            state.source_rank_R.size() == (knows_ranks ? static_cast<size_t>(R) : 0),
        label + ": source_token_R / source_rank_R sizes");
  check(static_cast<int64_t>(state.tokens_per_expert_E.size()) == El, label + ": tokens_per_expert size");
  check(state.T == T && state.E == E && state.H == H, label + ": state T/E/H");

  // Rows per local expert: with padding C per source rank, else the routed tokens of all sources.
  int64_t sum_rows = 0;
  for (int64_t le = 0; le < El && le < static_cast<int64_t>(state.tokens_per_expert_E.size()); ++le) {
    int64_t expected = 0;
    for (const int m : members) {
      const RouterOutput& rm = world_data[static_cast<size_t>(m)].routing;
      expected += rm.tokens_per_expert_E[static_cast<size_t>(first_expert + le)];
    }
    if (c == Case::kCapacityPad) check(expected == 1 * static_cast<int64_t>(members.size()), label + ": pad count");
    check(state.tokens_per_expert_E[le] == expected, label + ": tokens_per_expert[" + std::to_string(le) +
                                                         "] = " + std::to_string(state.tokens_per_expert_E[le]) +
                                                         ", expected " + std::to_string(expected));
    sum_rows += state.tokens_per_expert_E[le];
  }
  check(sum_rows == R, label + ": tokens_per_expert sums to R");

  // Each row is its source token's x with its prob, in the expected order; padding rows are zero.
  for (int64_t r = 0; r < R && r < static_cast<int64_t>(expected_R.size()); ++r) {
    const ExpectedRow& want = expected_R[static_cast<size_t>(r)];
    const int64_t le = state.expert_R[r], t = want.token;
    const RankData& src = world_data[static_cast<size_t>(want.world_rank)];
    check(le >= 0 && le < El, label + ": row expert in range");
    if (r > 0) check(le >= state.expert_R[r - 1], label + ": rows expert-major");
    if (knows_tokens && static_cast<size_t>(r) < state.source_token_R.size()) {
      check(state.source_token_R[r] == t, label + ": row " + std::to_string(r) + " source token");
    }
    if (knows_ranks && static_cast<size_t>(r) < state.source_rank_R.size()) {
      check(state.source_rank_R[r] == (t < 0 ? -1 : want.member),
            label + ": row " + std::to_string(r) + " source rank");
    }
    const float* row = x_RH.data<float>() + r * H;
    if (t < 0) {
      check(state.probs_R.data<float>()[r] == 0.0f, label + ": padding prob");
      for (int64_t h = 0; h < H; ++h) check(row[h] == 0.0f, label + ": padding row");
      continue;
    }
    check(src.routing.routing_map_TE.data<uint8_t>()[t * E + first_expert + le] == 1,
          label + ": row routed to its expert");
    check(state.probs_R.data<float>()[r] == src.routing.probs_TE.data<float>()[t * E + first_expert + le],
          label + ": row prob");
    for (int64_t h = 0; h < H; ++h) {
      check(row[h] == src.x_TH[t * H + h], label + ": row " + std::to_string(r) + " values");
    }
  }

  // Experts: y = x * (e + 1) * p / ETP.
  auto factor = [&](int64_t r) {
    return static_cast<float>(first_expert + state.expert_R[r] + 1) / static_cast<float>(ETP);
  };
  std::vector<float> y_RH(static_cast<size_t>(R * H));
  for (int64_t r = 0; r < R; ++r) {
    for (int64_t h = 0; h < H; ++h)
      y_RH[r * H + h] = x_RH.data<float>()[r * H + h] * factor(r) * state.probs_R.data<float>()[r];
  }
  Result res;
  const float base = 0.25f;  // combine and the backward adjoints add into their outputs
  res.out_TH.assign(static_cast<size_t>(T * H), base);
  dispatcher->combine(ref(view(res.out_TH, H)), view(y_RH, H), state);

  // Backward of the objective <out, dout>.
  std::vector<float> dy_RH(static_cast<size_t>(R * H), 99.0f);
  dispatcher->combine_backward(ref(view(dy_RH, H)), view(mine.dout_TH, H), state);
  std::vector<float> dx_RH(static_cast<size_t>(R * H)), dprobs_R(static_cast<size_t>(R));
  for (int64_t r = 0; r < R; ++r) {
    double dot = 0.0;
    for (int64_t h = 0; h < H; ++h) {
      dx_RH[r * H + h] = dy_RH[r * H + h] * factor(r) * state.probs_R.data<float>()[r];
      dot += static_cast<double>(dy_RH[r * H + h]) * x_RH.data<float>()[r * H + h];
    }
    dprobs_R[r] = static_cast<float>(dot) * factor(r);
  }
  res.dx_TH.assign(static_cast<size_t>(T * H), base);
  dispatcher->dispatch_backward(ref(view(res.dx_TH, H)), view(dx_RH, H), state);
  res.dprobs_TE.assign(static_cast<size_t>(T * E), base);
  dispatcher->probs_backward(ref(view(res.dprobs_TE, E)), view(dprobs_R, 1), state);

  // Reference over this rank's tokens.
  const float* p_TE = mine.routing.probs_TE.data<float>();
  for (int64_t t = 0; t < T; ++t) {
    double dot = 0.0;
    for (int64_t h = 0; h < H; ++h) dot += static_cast<double>(mine.dout_TH[t * H + h]) * mine.x_TH[t * H + h];
    std::vector<double> out_ref(static_cast<size_t>(H), base), dx_ref(static_cast<size_t>(H), base);
    for (int64_t e = 0; e < E; ++e) {
      const bool routed = mine.routing.routing_map_TE.data<uint8_t>()[t * E + e] != 0;
      const double p = p_TE[t * E + e], w = static_cast<double>(e + 1);
      for (int64_t h = 0; h < H && routed; ++h) {
        out_ref[h] += w * p * mine.x_TH[t * H + h];
        dx_ref[h] += w * p * mine.dout_TH[t * H + h];
      }
      const double dp_ref = base + (routed ? w * dot : 0.0);
      check(near(res.dprobs_TE[t * E + e], dp_ref, 1e-5),
            label + ": dprobs[" + std::to_string(t) + "," + std::to_string(e) +
                "] = " + std::to_string(res.dprobs_TE[t * E + e]) + ", expected " + std::to_string(dp_ref));
    }
    for (int64_t h = 0; h < H; ++h) {
      check(near(res.out_TH[t * H + h], out_ref[h], 1e-5),
            label + ": out[" + std::to_string(t) + "," + std::to_string(h) +
                "] = " + std::to_string(res.out_TH[t * H + h]) + ", expected " + std::to_string(out_ref[h]));
      check(near(res.dx_TH[t * H + h], dx_ref[h], 1e-5), label + ": dx[" + std::to_string(t) + "," + std::to_string(h) +
                                                             "] = " + std::to_string(res.dx_TH[t * H + h]) +
                                                             ", expected " + std::to_string(dx_ref[h]));
    }
  }
  return res;
}

// The alltoall dispatcher's chunk arithmetic on counts above 2^24 (fp32 would round the sums), hand-computed:
// ETP 2 x EP 2 sources, 2 local experts, counts [j][s][le] = a..h, seen from ETP rank 1.
void test_alltoall_plan_large_counts() {
  const int64_t big = (int64_t{1} << 24) + 1;
  const int64_t a = big, b = big + 2, c = 3, d = big + 4, e = big + 6, f = 0, g = 7, h = big;
  AllToAllCounts counts;
  counts.ETP = 2;
  counts.EP = 2;
  counts.El = 2;
  counts.rows_JSL = {a, b, c, d, e, f, g, h};
  const AllToAllPlan plan = moecore::detail::plan_alltoall(counts, 1);
  const int64_t M = a + b + c + d;  // > e + f + g + h
  check(plan.etp_rows == std::vector<int64_t>{a + b + c + d, e + f + g + h} && plan.etp_max_rows == M,
        "plan: rows per ETP rank");
  check(plan.ep_recv_rows == std::vector<size_t>{static_cast<size_t>(e + f), static_cast<size_t>(g + h)},
        "plan: rows from each EP source (ETP rank 1)");
  check(plan.tokens_per_expert_El == std::vector<int64_t>{a + c + e + g, b + d + f + h}, "plan: rows per local expert");
  const std::vector<RowChunk> expected = {{0, a, 0}, {a + b, c, 0},     {M, e, 0},     {M + e + f, g, 0},
                                          {a, b, 1}, {a + b + c, d, 1}, {M + e, f, 1}, {M + e + f + g, h, 1}};
  check(plan.sorted_chunks.size() == expected.size(), "plan: chunk count");
  for (size_t i = 0; i < expected.size() && i < plan.sorted_chunks.size(); ++i) {
    const RowChunk& got = plan.sorted_chunks[i];
    check(got.first_row == expected[i].first_row && got.rows == expected[i].rows &&
              got.local_expert == expected[i].local_expert,
          "plan: chunk " + std::to_string(i) + " starts at " + std::to_string(got.first_row) + " with " +
              std::to_string(got.rows) + " rows, expected " + std::to_string(expected[i].first_row) + " with " +
              std::to_string(expected[i].rows));
  }
}

// The count exchange over the layout's EP and ETP groups carries counts above 2^24 exactly: odd values in
// (2^24, 2^25) have no fp32 representation, so counts sent as floats would arrive rounded.
void test_alltoall_count_exchange(const ParallelState& ps) {
  const int64_t El = kE / ps.ep_size(), first_expert = ps.ep_rank() * El;
  auto count = [](const int64_t world_rank, const int64_t e) {
    return (int64_t{1} << 24) + 1 + 2 * (world_rank * kE + e);
  };
  std::vector<int64_t> rows_E(static_cast<size_t>(kE));
  for (int64_t e = 0; e < kE; ++e) rows_E[static_cast<size_t>(e)] = count(ps.rank, e);
  const AllToAllCounts counts = moecore::detail::exchange_alltoall_counts(ps.ep, ps.etp, rows_E, El);
  const std::vector<int64_t> sources_JS = alltoall_sources(ps);
  check(counts.ETP == ps.etp_size() && counts.EP == ps.ep_size() && counts.El == El &&
            counts.rows_JSL.size() == sources_JS.size() * static_cast<size_t>(El),
        "count exchange: shape");
  for (int64_t j = 0; j < counts.ETP && counts.rows_JSL.size() == sources_JS.size() * static_cast<size_t>(El); ++j) {
    for (int64_t s = 0; s < counts.EP; ++s) {
      for (int64_t le = 0; le < El; ++le) {
        const int64_t want = count(sources_JS[static_cast<size_t>(j * counts.EP + s)], first_expert + le);
        check(counts.rows(j, s, le) == want, "count exchange: [" + std::to_string(j) + "][" + std::to_string(s) + "][" +
                                                 std::to_string(le) + "] = " + std::to_string(counts.rows(j, s, le)) +
                                                 ", expected " + std::to_string(want));
      }
    }
  }
  const AllToAllPlan plan = moecore::detail::plan_alltoall(counts, ps.etp_rank());
  for (int64_t le = 0; le < El; ++le) {
    int64_t want = 0;
    for (const int64_t source : sources_JS) want += count(source, first_expert + le);
    check(plan.tokens_per_expert_El[static_cast<size_t>(le)] == want, "count exchange: rows per local expert");
  }
}

void check_equal(const std::vector<float>& a, const std::vector<float>& b, const std::string& what) {
  check(a.size() == b.size(), what + ": sizes");
  for (size_t i = 0; i < a.size() && i < b.size(); ++i) {
    if (std::abs(a[i] - b[i]) > 1e-6f) {
      check(false, what + "[" + std::to_string(i) + "]: " + std::to_string(a[i]) + " vs " + std::to_string(b[i]));
      return;
    }
  }
}

struct Layout {
  std::string name;
  int tp, ep, etp;
};

std::vector<Layout> layouts_for(const int world) {
  std::vector<Layout> layouts = {{"ep" + std::to_string(world), 1, world, 1}};
  if (world == 2) layouts.push_back({"tp2_etp2_ep1", 2, 1, 2});
  if (world == 4) {
    layouts.push_back({"tp2_etp2_ep2", 2, 2, 2});
    layouts.push_back({"tp2_etp1_ep2_edp2", 2, 2, 1});
    layouts.push_back({"tp1_etp1_ep2_edp2", 1, 2, 1});
    layouts.push_back({"tp4_etp4_ep1", 4, 1, 4});
  }
  return layouts;
}

// Both dispatchers on one layout and case: equal T everywhere (both run, results must agree), then unequal T
// (alltoall only).
void test_layout_case(const ProcessGroup& world, const Layout& layout, const Case c) {
  ParallelSizes sizes;
  sizes.world_size = world.size();
  sizes.tensor_model_parallel_size = layout.tp;
  sizes.expert_model_parallel_size = layout.ep;
  sizes.expert_tensor_parallel_size = layout.etp;
  const ParallelState ps = ParallelState::create(sizes, false, world);
  const int64_t starve_end = layout.ep > 1 ? kE / layout.ep : kE / 2;
  const std::string label = layout.name + "/" + case_name(c);
  if (c == Case::kLargeCounts) {
    test_alltoall_plan_large_counts();
    test_alltoall_count_exchange(ps);
    return;
  }

  std::vector<RankData> equal_data;
  for (int r = 0; r < world.size(); ++r) equal_data.push_back(make_data(r, 6, c, starve_end, 17));
  const Result ag = run_dispatcher(ps, TokenDispatcherType::kAllGather, equal_data, c, label + "/allgather");
  const Result a2a = run_dispatcher(ps, TokenDispatcherType::kAllToAll, equal_data, c, label + "/alltoall");
  check_equal(ag.out_TH, a2a.out_TH, label + ": allgather vs alltoall out");
  check_equal(ag.dx_TH, a2a.dx_TH, label + ": allgather vs alltoall dx");
  check_equal(ag.dprobs_TE, a2a.dprobs_TE, label + ": allgather vs alltoall dprobs");
  // Deterministic: a second run gives the same bits.
  const Result again = run_dispatcher(ps, TokenDispatcherType::kAllToAll, equal_data, c, label + "/alltoall again");
  check(again.out_TH == a2a.out_TH && again.dx_TH == a2a.dx_TH && again.dprobs_TE == a2a.dprobs_TE,
        label + ": alltoall repeatable");
  // The flex dispatcher (no padding to capacity, as Megatron's backends): the alltoall dispatcher's bits.
  if (c != Case::kCapacityPad && ps.tp_ep.size() > 1) {
    const Result flex = run_dispatcher(ps, TokenDispatcherType::kFlex, equal_data, c, label + "/flex");
    check(flex.out_TH == a2a.out_TH && flex.dx_TH == a2a.dx_TH && flex.dprobs_TE == a2a.dprobs_TE,
          label + ": flex bit-identical to alltoall");
  }

  std::vector<RankData> unequal_data;
  for (int r = 0; r < world.size(); ++r) unequal_data.push_back(make_data(r, 3 + 2 * (r % 3), c, starve_end, 23));
  const Result a2a_unequal =
      run_dispatcher(ps, TokenDispatcherType::kAllToAll, unequal_data, c, label + "/alltoall unequal T");
  if (c != Case::kCapacityPad && ps.tp_ep.size() > 1) {
    const Result flex = run_dispatcher(ps, TokenDispatcherType::kFlex, unequal_data, c, label + "/flex unequal T");
    check(
        flex.out_TH == a2a_unequal.out_TH && flex.dx_TH == a2a_unequal.dx_TH && flex.dprobs_TE == a2a_unequal.dprobs_TE,
        label + ": flex bit-identical to alltoall, unequal T");
  }
}

}  // namespace

int main(int argc, char** argv) {
  const MpiRuntime mpi(&argc, &argv);
  int failed_total = 0;
  try {
    const ProcessGroup world = ProcessGroup::world();
    g_rank = world.rank();
    int passed = 0;
    for (const Layout& layout : layouts_for(world.size())) {
      for (const Case c : {Case::kTopK, Case::kCapacityDrop, Case::kCapacityPad, Case::kStarved, Case::kLargeCounts}) {
        g_failures = 0;
        try {
          test_layout_case(world, layout, c);
        } catch (const std::exception& error) {
          ++g_failures;
          std::fprintf(stderr, "[rank %d] %s/%s threw: %s\n", g_rank, layout.name.c_str(), case_name(c), error.what());
        }
        std::vector<float> failed = {g_failures > 0 ? 1.0f : 0.0f};
        world.all_reduce<float>(failed, ReduceOp::kMax);
        if (failed[0] > 0)
          ++failed_total;
        else
          ++passed;
        if (world.rank() == 0)
          std::printf("%s %s/%s (%d ranks)\n", failed[0] > 0 ? "FAIL" : "ok  ", layout.name.c_str(), case_name(c),
                      world.size());
      }
    }
    if (world.rank() == 0) std::printf("%d passed, %d failed\n", passed, failed_total);
  } catch (const std::exception& error) {
    std::fprintf(stderr, "[rank %d] fatal: %s\n", g_rank, error.what());
    return 1;
  }
  return failed_total > 0 ? 1 : 0;
}
