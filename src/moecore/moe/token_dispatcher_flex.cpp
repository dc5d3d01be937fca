// Megatron's flex token dispatcher (megatron/core/transformer/moe/token_dispatcher.py, MoEFlexTokenDispatcher) with
// moecore's MPI backend "mpiep": what DeepEP (NVLink inside a node, RDMA between nodes) and HybridEP do on GPUs,
// done with MPI between hosts and an MPI-3 shared-memory window inside one.
//
// One communication group, ETP x EP (Megatron's tp_ep_group). A token routed to expert e goes to every ETP rank of
// e's EP rank (Megatron's _initialize_metadata replicates each EP destination over the TP ranks). The ranks of the
// group sit on hosts (parallel/shared_window.h: host_id, MOECORE_PRETEND_HOSTS); every host holds as many of them,
// and a rank's "rail" is the ranks with its place on every host (DeepEP sends to the GPU of the same local rank on the
// remote node, then forwards over NVLink).
//
// Dispatch (routing plan per (token, destination host), each token once per host):
//   1. each token goes once to every host that holds a destination of it, over the rail (one all-to-all), with its
//      metadata: its source rank and token index and, per routing slot, the expert (or -1 when not on that host),
//      its probability and the slot's row in the source's expert-major order (Megatron's num_tokens_per_rdma_rank
//      counts these rows; DeepEP's is_token_in_rank / topk_idx / topk_weights carry the same facts);
//   2. on the host, the rail's receiver writes the rows into its segment of the host's shared window (a source's
//      own-host tokens go there directly), and every rank of the host copies the rows of its local experts out of
//      all segments, in the alltoall dispatcher's order: by local expert, then the source's ETP rank and EP rank,
//      tokens ascending (so the experts see the same rows in the same order, and the results are its bit for bit).
// Combine, the exact inverse: every expert rank writes its output rows into the host's window; for each source on
// another host, the rank of the host on that source's rail forwards the rows of that source's tokens, one per
// (token, expert) (summing a row's ETP partial outputs in fp32 first, where they are on one host), and the source
// adds them into its tokens in expert order as the alltoall dispatcher's unpermute does. (DeepEP also sums a token's
// rows of one rank before sending them back; moecore keeps one row per (token, expert) so the sums happen in the
// same order as the alltoall dispatcher's.) The backward of dispatch is the combine path, the backward of combine the
// dispatch path, with the plan kept in the DispatchState.
//
// The inter-host exchange (the rail all-to-all) is the slow link: MOECORE_EP_A2A_DELAY_US holds it, it is what the
// EP overlap hides (parallel::pass_turn between its start and its wait), and its token-row bytes are the [comm]
// line's inter-host all-to-all bytes.
#include <algorithm>
#include <chrono>
#include <cstring>
#include <functional>
#include <memory>
#include <numeric>
#include <stdexcept>
#include <string>
#include <tuple>
#include <vector>

#include "moecore/moe/token_dispatcher_internal.h"
#include "moecore/ops/convert.h"
#include "moecore/ops/moe_rows.h"
#include "moecore/ops/precision.h"
#include "moecore/parallel/comm_stats.h"
#include "moecore/parallel/shared_window.h"
#include "moecore/parallel/turn_taking.h"

namespace moecore {

// One entry of a host's window: a token row from one source with its routing slots.
struct FlexEntry {
  int32_t source = 0;  // rank in the ETP x EP group
  int32_t token = 0;
  std::vector<int32_t> expert_K;  // global expert, -1: none on this host
  std::vector<int32_t> row_K;     // the slot's row in the source's expert-major order (combine's target)
  std::vector<float> prob_K;
};

// A received row: segment `owner`'s entry `entry`, routing slot `slot`.
struct FlexRow {
  int32_t owner = 0, entry = 0, slot = 0;
};

struct FlexDispatchPlan {
  int64_t K = 0;                               // routing slots per token (the group's most experts of one token)
  std::vector<std::vector<int64_t>> tokens_N;  // per host: this rank's tokens it needs, ascending
  std::vector<size_t> rail_send, rail_recv;    // tokens to / from each host over the rail (0 for this host)
  std::vector<std::vector<FlexEntry>> segment_entries;  // per host rank: its window segment's entries
  std::vector<std::vector<FlexRow>> rows_of;            // per host rank: the rows it receives, in order
};

namespace detail {
namespace {

constexpr const char* kName = "flex dispatcher (mpiep)";

// The group's topology, fixed for the dispatcher's life.
struct Topology {
  int P = 1, me = 0;
  std::vector<int> ep_of, etp_of, host_of, local_of;  // per group rank
  int hosts = 1, my_host = 0, my_local = 0;
  // This rank's host (by local index), its rail (by host index).
  parallel::ProcessGroup host = parallel::ProcessGroup::self(), rail = parallel::ProcessGroup::self();
};

template <typename T>
std::vector<T> gather_one(const parallel::ProcessGroup& group, const T value) {
  std::vector<T> all(static_cast<size_t>(group.size()));
  group.all_gather<T>(std::span<const T>(&value, 1), all);
  return all;
}

int64_t total(const std::vector<size_t>& n) { return std::accumulate(n.begin(), n.end(), int64_t{0}); }
std::vector<size_t> scaled(const std::vector<size_t>& rows, const int64_t width) {
  std::vector<size_t> out(rows.size());
  for (size_t i = 0; i < rows.size(); ++i) out[i] = rows[i] * static_cast<size_t>(width);
  return out;
}

class FlexDispatcher final : public TokenDispatcher {
 public:
  FlexDispatcher(const int64_t num_experts, const parallel::ParallelState& parallel)
      : E_(num_experts),
        El_(num_experts / parallel.ep_size()),
        ep_size_(parallel.ep_size()),
        ep_rank_(parallel.ep_rank()),
        etp_size_(parallel.etp_size()),
        etp_rank_(parallel.etp.rank()),
        host_(parallel.host),
        group_(parallel.tp_ep) {}

  DispatchBuffers dispatch_preprocess(const Tensor& x_TH, const RouterOutput& routing, DispatchState& state) override {
    check_tokens(kName, x_TH);
    const int64_t T = x_TH.dim(0), H = x_TH.dim(1);
    if (static_cast<int64_t>(routing.tokens_per_expert_E.size()) != E_) {
      throw std::invalid_argument(std::string(kName) + ": " + std::to_string(routing.tokens_per_expert_E.size()) +
                                  " expert counts, expected " + std::to_string(E_));
    }
    check_routing(routing, T, E_);
    const Topology& topo = topology();
    state = DispatchState{};
    state.T = T;
    state.H = H;
    state.E = E_;
    state.capacity = routing.capacity;
    const Tensor probs_L =
        expert_major_rows(state.sent_token_L, routing.routing_map_TE.view({T, E_}), routing.probs_TE.view({T, E_}), 0,
                          routing.tokens_per_expert_E, routing.capacity);
    for (int64_t e = 0; e < E_; ++e) {
      state.sent_expert_L.insert(state.sent_expert_L.end(), static_cast<size_t>(routing.tokens_per_expert_E[e]), e);
    }
    // Each token's routed (expert, row) slots, experts ascending.
    std::vector<std::vector<std::pair<int32_t, int32_t>>> slots_T(static_cast<size_t>(T));
    for (size_t l = 0; l < state.sent_token_L.size(); ++l) {
      const int64_t t = state.sent_token_L[l];
      if (t < 0) throw std::invalid_argument(std::string(kName) + ": padding rows are not supported");
      slots_T[static_cast<size_t>(t)].emplace_back(static_cast<int32_t>(state.sent_expert_L[l]),
                                                   static_cast<int32_t>(l));
    }
    int64_t K = 0;
    for (const auto& slots : slots_T) K = std::max<int64_t>(K, static_cast<int64_t>(slots.size()));
    group_.all_reduce(std::span<int64_t>(&K, 1), parallel::ReduceOp::kMax);

    auto plan = std::make_shared<FlexDispatchPlan>();
    plan->K = K;
    // The hosts holding each EP rank (its ETP ranks may span several).
    std::vector<std::vector<char>> ep_on_host(static_cast<size_t>(ep_size_),
                                              std::vector<char>(static_cast<size_t>(topo.hosts), 0));
    for (int g = 0; g < topo.P; ++g) ep_on_host[static_cast<size_t>(topo.ep_of[g])][topo.host_of[g]] = 1;
    plan->tokens_N.assign(static_cast<size_t>(topo.hosts), {});
    std::vector<std::vector<FlexEntry>> outgoing(static_cast<size_t>(topo.hosts));
    for (int64_t t = 0; t < T; ++t) {
      for (int h = 0; h < topo.hosts; ++h) {
        FlexEntry entry{topo.me, static_cast<int32_t>(t), std::vector<int32_t>(static_cast<size_t>(K), -1),
                        std::vector<int32_t>(static_cast<size_t>(K), -1), std::vector<float>(static_cast<size_t>(K))};
        bool needed = false;
        const auto& slots = slots_T[static_cast<size_t>(t)];
        for (size_t k = 0; k < slots.size(); ++k) {
          const auto [e, l] = slots[k];
          if (!ep_on_host[static_cast<size_t>(e / El_)][static_cast<size_t>(h)]) continue;
          needed = true;
          entry.expert_K[k] = e;
          entry.row_K[k] = l;
          entry.prob_K[k] = probs_L.data<float>()[l];
        }
        if (!needed) continue;
        plan->tokens_N[static_cast<size_t>(h)].push_back(t);
        outgoing[static_cast<size_t>(h)].push_back(std::move(entry));
      }
    }
    // Metadata over the rail: [source, token, expert_K, row_K] as int32 and prob_K as fp32 per token.
    plan->rail_send.assign(static_cast<size_t>(topo.hosts), 0);
    for (int h = 0; h < topo.hosts; ++h) {
      if (h != topo.my_host) plan->rail_send[static_cast<size_t>(h)] = outgoing[static_cast<size_t>(h)].size();
    }
    plan->rail_recv = topo.rail.exchange_counts(plan->rail_send);
    const int64_t int_width = 2 + 2 * K;
    std::vector<int32_t> ints_out, ints_in(static_cast<size_t>(total(plan->rail_recv) * int_width));
    std::vector<float> probs_out, probs_in(static_cast<size_t>(total(plan->rail_recv) * K));
    for (int h = 0; h < topo.hosts; ++h) {
      if (h == topo.my_host) continue;
      for (const FlexEntry& entry : outgoing[static_cast<size_t>(h)]) {
        ints_out.push_back(entry.source);
        ints_out.push_back(entry.token);
        ints_out.insert(ints_out.end(), entry.expert_K.begin(), entry.expert_K.end());
        ints_out.insert(ints_out.end(), entry.row_K.begin(), entry.row_K.end());
        probs_out.insert(probs_out.end(), entry.prob_K.begin(), entry.prob_K.end());
      }
    }
    {
      const parallel::CommTimer timer(parallel::CommKind::kAllToAll);
      topo.rail.all_to_all_v<int32_t>(ints_out, scaled(plan->rail_send, int_width), ints_in,
                                      scaled(plan->rail_recv, int_width));
      topo.rail.all_to_all_v<float>(probs_out, scaled(plan->rail_send, K), probs_in, scaled(plan->rail_recv, K));
      count_dispatch_bytes(DType::kI32, static_cast<int64_t>(ints_out.size()));
      count_dispatch_bytes(DType::kF32, static_cast<int64_t>(probs_out.size()));
    }
    // My segment: what the rail brought (hosts in order), then my own tokens for my host.
    std::vector<FlexEntry> segment;
    for (size_t n = 0; n < static_cast<size_t>(total(plan->rail_recv)); ++n) {
      const int32_t* ints = ints_in.data() + n * static_cast<size_t>(int_width);
      FlexEntry entry{ints[0], ints[1], std::vector<int32_t>(ints + 2, ints + 2 + K),
                      std::vector<int32_t>(ints + 2 + K, ints + 2 + 2 * K),
                      std::vector<float>(probs_in.begin() + static_cast<std::ptrdiff_t>(n * K),
                                         probs_in.begin() + static_cast<std::ptrdiff_t>((n + 1) * K))};
      segment.push_back(std::move(entry));
    }
    for (FlexEntry& entry : outgoing[static_cast<size_t>(topo.my_host)]) segment.push_back(std::move(entry));
    plan->segment_entries = share_entries(topo, segment, K);
    plan_rows(topo, *plan);

    // This rank's rows: tokens per local expert, their experts and probabilities.
    const std::vector<FlexRow>& mine = plan->rows_of[static_cast<size_t>(topo.my_local)];
    state.tokens_per_expert_E.assign(static_cast<size_t>(El_), 0);
    state.probs_R = activation_rows({static_cast<int64_t>(mine.size())});
    const int64_t first_expert = static_cast<int64_t>(ep_rank_) * El_;
    for (size_t r = 0; r < mine.size(); ++r) {
      const FlexEntry& entry =
          plan->segment_entries[static_cast<size_t>(mine[r].owner)][static_cast<size_t>(mine[r].entry)];
      const int64_t le = entry.expert_K[static_cast<size_t>(mine[r].slot)] - first_expert;
      state.expert_R.push_back(le);
      ++state.tokens_per_expert_E[static_cast<size_t>(le)];
      state.probs_R.data<float>()[r] = entry.prob_K[static_cast<size_t>(mine[r].slot)];
    }
    state.flex = plan;
    return DispatchBuffers{x_TH, Tensor()};
  }

  DispatchBuffers token_dispatch(const DispatchBuffers& local, DispatchState& state,
                                 const std::function<void()>* overlapped) override {
    ToExperts rows = start_to_experts(local.rows, state);
    if (overlapped) (*overlapped)();
    parallel::pass_turn();
    return DispatchBuffers{finish_to_experts(rows, state), Tensor()};
  }

  // The rows already arrive grouped by local expert (the probabilities came with the plan).
  Tensor dispatch_postprocess(const DispatchBuffers& received, DispatchState& /*state*/) override {
    return received.rows;
  }

  Tensor combine_preprocess(const Tensor& y_RH, const DispatchState& /*state*/) override { return y_RH; }
  Tensor token_combine(const Tensor& y_RH, const DispatchState& state) override {
    FromExperts rows = start_from_experts(y_RH, state);
    parallel::pass_turn();
    return finish_from_experts(rows, state);
  }
  void combine_postprocess(Tensor& out_TH, const Tensor& rows_LH, const DispatchState& state) override {
    ops::moe_unpermute(out_TH, rows_LH, state.sent_token_L);
  }

  void combine_backward(Tensor& dy_RH, const Tensor& dout_TH, const DispatchState& state,
                        const std::function<void()>* overlapped) override {
    ToExperts rows = start_to_experts(dout_TH, state);
    if (overlapped) (*overlapped)();
    parallel::pass_turn();
    const Tensor gathered = finish_to_experts(rows, state);
    const std::vector<int64_t> first{0}, count{gathered.dim(0)};
    ops::sort_chunks(dy_RH, gathered, first, count);  // a copy, into dy's dtype as the alltoall dispatcher's
  }

  void probs_backward(Tensor& dprobs_TE, const Tensor& dprobs_R, const DispatchState& state) override {
    FromExperts probs = start_from_experts(dprobs_R.view({dprobs_R.numel(), 1}), state, false);
    add_probs(dprobs_TE, finish_from_experts(probs, state), state);
  }

  void dispatch_backward_with_probs(Tensor& dx_TH, Tensor& dprobs_TE, const Tensor& dx_RH, const Tensor& dprobs_R,
                                    const DispatchState& state, const std::function<void()>* overlapped) override {
    FromExperts rows = start_from_experts(dx_RH, state);
    FromExperts probs = start_from_experts(dprobs_R.view({dprobs_R.numel(), 1}), state, false);
    if (overlapped) (*overlapped)();
    parallel::pass_turn();
    combine_postprocess(dx_TH, finish_from_experts(rows, state), state);
    add_probs(dprobs_TE, finish_from_experts(probs, state), state);
  }

 private:
  const Topology& topology() {
    if (topo_) return *topo_;
    auto topo = std::make_unique<Topology>();
    topo->P = group_.size();
    topo->me = group_.rank();
    topo->ep_of = gather_one<int>(group_, ep_rank_);
    topo->etp_of = gather_one<int>(group_, etp_rank_);
    const std::vector<int> host_ids = gather_one<int>(group_, host_);
    std::vector<int> distinct = host_ids;
    std::sort(distinct.begin(), distinct.end());
    distinct.erase(std::unique(distinct.begin(), distinct.end()), distinct.end());
    topo->hosts = static_cast<int>(distinct.size());
    topo->host_of.resize(host_ids.size());
    topo->local_of.resize(host_ids.size());
    std::vector<int> on_host(distinct.size(), 0);
    for (size_t g = 0; g < host_ids.size(); ++g) {
      const int h =
          static_cast<int>(std::lower_bound(distinct.begin(), distinct.end(), host_ids[g]) - distinct.begin());
      topo->host_of[g] = h;
      topo->local_of[g] = on_host[static_cast<size_t>(h)]++;
    }
    for (const int n : on_host) {
      if (n != on_host.front()) {
        throw std::invalid_argument(std::string(kName) + ": every host must hold as many ranks of the expert group (" +
                                    std::to_string(on_host.front()) + " and " + std::to_string(n) + ")");
      }
    }
    topo->my_host = topo->host_of[static_cast<size_t>(topo->me)];
    topo->my_local = topo->local_of[static_cast<size_t>(topo->me)];
    topo->host = group_.split(topo->my_host, topo->my_local);
    topo->rail = group_.split(topo->my_local, topo->my_host);
    topo_ = std::move(topo);
    return *topo_;
  }

  // Every host rank's segment entries, through a shared window (each rank writes its own, reads the others').
  static std::vector<std::vector<FlexEntry>> share_entries(const Topology& topo, const std::vector<FlexEntry>& mine,
                                                           const int64_t K) {
    const std::vector<int64_t> counts = gather_one<int64_t>(topo.host, static_cast<int64_t>(mine.size()));
    const size_t entry_bytes = static_cast<size_t>(2 + 3 * K) * 4;
    const parallel::SharedWindow window(topo.host, mine.size() * entry_bytes);
    std::byte* out = window.segment(topo.host.rank());
    for (const FlexEntry& entry : mine) {
      std::memcpy(out, &entry.source, 4);
      std::memcpy(out + 4, &entry.token, 4);
      std::memcpy(out + 8, entry.expert_K.data(), static_cast<size_t>(K) * 4);
      std::memcpy(out + 8 + K * 4, entry.row_K.data(), static_cast<size_t>(K) * 4);
      std::memcpy(out + 8 + 2 * K * 4, entry.prob_K.data(), static_cast<size_t>(K) * 4);
      out += entry_bytes;
    }
    window.synchronize();
    std::vector<std::vector<FlexEntry>> all(static_cast<size_t>(topo.host.size()));
    for (int o = 0; o < topo.host.size(); ++o) {
      const std::byte* in = window.segment(o);
      for (int64_t i = 0; i < counts[static_cast<size_t>(o)]; ++i, in += entry_bytes) {
        FlexEntry entry{0, 0, std::vector<int32_t>(static_cast<size_t>(K)),
                        std::vector<int32_t>(static_cast<size_t>(K)), std::vector<float>(static_cast<size_t>(K))};
        std::memcpy(&entry.source, in, 4);
        std::memcpy(&entry.token, in + 4, 4);
        std::memcpy(entry.expert_K.data(), in + 8, static_cast<size_t>(K) * 4);
        std::memcpy(entry.row_K.data(), in + 8 + K * 4, static_cast<size_t>(K) * 4);
        std::memcpy(entry.prob_K.data(), in + 8 + 2 * K * 4, static_cast<size_t>(K) * 4);
        all[static_cast<size_t>(o)].push_back(std::move(entry));
      }
    }
    window.synchronize();  // every rank has read before the window goes
    return all;
  }

  // The rows each rank of the host receives, in the alltoall dispatcher's order: local expert, the source's ETP rank,
  // its EP rank, token.
  void plan_rows(const Topology& topo, FlexDispatchPlan& plan) const {
    const int local_ranks = topo.host.size();
    plan.rows_of.assign(static_cast<size_t>(local_ranks), {});
    std::vector<int> group_rank_of_local(static_cast<size_t>(local_ranks));
    for (int g = 0; g < topo.P; ++g) {
      if (topo.host_of[g] == topo.my_host) group_rank_of_local[static_cast<size_t>(topo.local_of[g])] = g;
    }
    for (int m = 0; m < local_ranks; ++m) {
      const int ep = topo.ep_of[group_rank_of_local[static_cast<size_t>(m)]];
      std::vector<std::tuple<int64_t, int, int, int32_t, FlexRow>> keyed;
      for (int o = 0; o < local_ranks; ++o) {
        const auto& entries = plan.segment_entries[static_cast<size_t>(o)];
        for (size_t i = 0; i < entries.size(); ++i) {
          const FlexEntry& entry = entries[i];
          for (int64_t k = 0; k < plan.K; ++k) {
            const int32_t e = entry.expert_K[static_cast<size_t>(k)];
            if (e < 0 || e / El_ != ep) continue;
            keyed.emplace_back(e, topo.etp_of[entry.source], topo.ep_of[entry.source], entry.token,
                               FlexRow{o, static_cast<int32_t>(i), static_cast<int32_t>(k)});
          }
        }
      }
      std::sort(keyed.begin(), keyed.end(), [](const auto& a, const auto& b) {
        return std::tie(std::get<0>(a), std::get<1>(a), std::get<2>(a), std::get<3>(a)) <
               std::tie(std::get<0>(b), std::get<1>(b), std::get<2>(b), std::get<3>(b));
      });
      auto& rows = plan.rows_of[static_cast<size_t>(m)];
      for (const auto& key : keyed) rows.push_back(std::get<4>(key));
    }
  }

  // Token rows [T, W] -> the rail (started here) ...
  struct ToExperts {
    parallel::Work work;
    Tensor input, sent, received;
    std::chrono::steady_clock::time_point started;
  };
  ToExperts start_to_experts(const Tensor& rows_TW, const DispatchState& state) const {
    const Topology& topo = *topo_;
    const FlexDispatchPlan& plan = *state.flex;
    const int64_t W = rows_TW.dim(1);
    ToExperts exchange;
    exchange.input = rows_TW.view({state.T, W});
    std::vector<int64_t> send_rows;
    for (int h = 0; h < topo.hosts; ++h) {
      if (h == topo.my_host) continue;
      const auto& tokens = plan.tokens_N[static_cast<size_t>(h)];
      send_rows.insert(send_rows.end(), tokens.begin(), tokens.end());
    }
    exchange.sent = activation_rows({static_cast<int64_t>(send_rows.size()), W}, rows_TW.dtype());
    ops::moe_permute(exchange.sent, exchange.input, send_rows);
    exchange.received = activation_rows({total(plan.rail_recv), W}, rows_TW.dtype());
    count_dispatch_bytes(rows_TW.dtype(), static_cast<int64_t>(send_rows.size()) * W);
    parallel::CommStats::instance().add_inter_host_bytes(static_cast<double>(exchange.sent.nbytes()), true);
    exchange.started = std::chrono::steady_clock::now();
    const parallel::CommTimer timer(parallel::CommKind::kAllToAll);
    exchange.work = topo.rail.all_to_all_v_async(exchange.sent, scaled(plan.rail_send, W), exchange.received,
                                                 scaled(plan.rail_recv, W));
    exchange.work.trace_as("flex dispatch (inter-host)");
    return exchange;
  }
  // ... waited for -> the host's window -> this rank's rows [R, W], grouped by local expert.
  Tensor finish_to_experts(ToExperts& exchange, const DispatchState& state) const {
    const Topology& topo = *topo_;
    const FlexDispatchPlan& plan = *state.flex;
    const parallel::CommTimer timer(parallel::CommKind::kAllToAll);
    exchange.work.wait();
    if (topo_->hosts > 1) finish_link_delay(exchange.started);  // the inter-host link
    const int64_t W = exchange.input.dim(1);
    const DType dtype = exchange.input.dtype();
    const size_t row_bytes = static_cast<size_t>(W) * dtype_size(dtype);
    const auto& own = plan.tokens_N[static_cast<size_t>(topo.my_host)];
    const parallel::SharedWindow window(topo.host,
                                        (static_cast<size_t>(exchange.received.dim(0)) + own.size()) * row_bytes);
    std::byte* segment = window.segment(topo.host.rank());
    if (exchange.received.nbytes() > 0)
      std::memcpy(segment, exchange.received.data<uint8_t>(), exchange.received.nbytes());
    segment += exchange.received.nbytes();
    const auto* input = reinterpret_cast<const std::byte*>(exchange.input.data<uint8_t>());
    for (const int64_t t : own) {
      std::memcpy(segment, input + static_cast<size_t>(t) * row_bytes, row_bytes);
      segment += row_bytes;
    }
    window.synchronize();
    const std::vector<FlexRow>& mine = plan.rows_of[static_cast<size_t>(topo.my_local)];
    Tensor rows_RW = activation_rows({static_cast<int64_t>(mine.size()), W}, dtype);
    auto* out = reinterpret_cast<std::byte*>(rows_RW.data<uint8_t>());
    for (const FlexRow& row : mine) {
      std::memcpy(out, window.segment(row.owner) + static_cast<size_t>(row.entry) * row_bytes, row_bytes);
      out += row_bytes;
    }
    window.synchronize();
    return rows_RW;
  }

  // Expert rows [R, W] -> the host's window; this rank forwards its rail's share to the other hosts (started here) ...
  struct FromExperts {
    parallel::Work work;
    Tensor sent, received;
    std::vector<int32_t> sent_rows, received_rows;  // the source's expert-major row of each forwarded row
    Tensor local;                                   // rows for this rank from its own host: [L, W], summed
    std::vector<char> local_set;
    std::chrono::steady_clock::time_point started;
    parallel::Work rows_work;
  };
  // The rows bound for `source` (a rank of the group) found in the host's window, per source row: the ETP
  // partials summed in fp32 in ETP-rank order (more than one only under expert tensor parallelism).
  struct Partial {
    int32_t row;  // in the source's expert-major order
    int etp;
    const std::byte* data;
  };
  std::vector<Partial> partials_for(const Topology& topo, const FlexDispatchPlan& plan, const int source,
                                    const parallel::SharedWindow& window, const size_t row_bytes) const {
    std::vector<Partial> found;
    for (int m = 0; m < topo.host.size(); ++m) {
      const auto& rows = plan.rows_of[static_cast<size_t>(m)];
      const int etp = topo.etp_of[group_rank_of_local(topo, m)];
      for (size_t r = 0; r < rows.size(); ++r) {
        const FlexEntry& entry =
            plan.segment_entries[static_cast<size_t>(rows[r].owner)][static_cast<size_t>(rows[r].entry)];
        if (entry.source != source) continue;
        found.push_back({entry.row_K[static_cast<size_t>(rows[r].slot)], etp, window.segment(m) + r * row_bytes});
      }
    }
    std::sort(found.begin(), found.end(),
              [](const Partial& a, const Partial& b) { return std::tie(a.row, a.etp) < std::tie(b.row, b.etp); });
    return found;
  }
  static int group_rank_of_local(const Topology& topo, const int local) {
    for (int g = 0; g < topo.P; ++g) {
      if (topo.host_of[g] == topo.my_host && topo.local_of[g] == local) return g;
    }
    throw std::logic_error("flex dispatcher: no group rank at that place of the host");
  }
  // Sums each row's partials (first + second + ...) into one row of dtype `out_dtype` at out_rows[i]; returns the
  // source rows in order.
  static std::vector<int32_t> sum_partials(const std::vector<Partial>& partials, const int64_t W, const DType dtype,
                                           std::vector<std::byte>& out) {
    std::vector<int32_t> rows;
    const size_t in_bytes = static_cast<size_t>(W) * dtype_size(dtype);
    for (size_t i = 0; i < partials.size();) {
      size_t j = i + 1;
      while (j < partials.size() && partials[j].row == partials[i].row) ++j;
      rows.push_back(partials[i].row);
      const size_t at = out.size();
      if (j == i + 1) {
        out.insert(out.end(), partials[i].data, partials[i].data + in_bytes);
      } else {
        if (dtype != DType::kF32) throw std::logic_error("flex dispatcher: partial sums must be fp32");
        std::vector<float> sum(static_cast<size_t>(W)), add(static_cast<size_t>(W));
        std::memcpy(sum.data(), partials[i].data, in_bytes);
        for (size_t p = i + 1; p < j; ++p) {
          std::memcpy(add.data(), partials[p].data, in_bytes);
          for (size_t w = 0; w < add.size(); ++w) sum[w] += add[w];
        }
        out.resize(at + in_bytes);
        std::memcpy(out.data() + at, sum.data(), in_bytes);
      }
      i = j;
    }
    return rows;
  }

  FromExperts start_from_experts(const Tensor& rows_RW, const DispatchState& state,
                                 const bool token_rows = true) const {
    const Topology& topo = *topo_;
    const FlexDispatchPlan& plan = *state.flex;
    const int64_t R = rows_RW.dim(0), W = rows_RW.dim(1);
    // Under expert tensor parallelism the rows are partial sums, added in fp32 (the alltoall dispatcher's
    // reduce-scatter); otherwise they move in their own dtype.
    const DType dtype = etp_size_ > 1 ? DType::kF32 : rows_RW.dtype();
    Tensor rows = rows_RW.view({R, W});
    if (rows.dtype() != dtype) {
      Tensor wide({R, W}, dtype, MemCategory::kActivations);
      ops::convert(wide, rows);
      rows = wide;
    }
    const size_t row_bytes = static_cast<size_t>(W) * dtype_size(dtype);
    FromExperts exchange;
    const parallel::SharedWindow window(topo.host, static_cast<size_t>(R) * row_bytes);
    if (rows.nbytes() > 0) std::memcpy(window.segment(topo.host.rank()), rows.data<uint8_t>(), rows.nbytes());
    window.synchronize();
    // Sources on other hosts on this rank's rail: forwarded, per host in order.
    std::vector<size_t> send(static_cast<size_t>(topo.hosts), 0);
    std::vector<std::byte> packed;
    for (int h = 0; h < topo.hosts; ++h) {
      if (h == topo.my_host) continue;
      for (int g = 0; g < topo.P; ++g) {
        if (topo.host_of[g] != h || topo.local_of[g] != topo.my_local) continue;
        const std::vector<int32_t> source_rows =
            sum_partials(partials_for(topo, plan, g, window, row_bytes), W, dtype, packed);
        exchange.sent_rows.insert(exchange.sent_rows.end(), source_rows.begin(), source_rows.end());
        send[static_cast<size_t>(h)] += source_rows.size();
      }
    }
    // This rank's own rows from its host.
    std::vector<std::byte> local_bytes;
    const std::vector<int32_t> local_rows =
        sum_partials(partials_for(topo, plan, topo.me, window, row_bytes), W, dtype, local_bytes);
    const int64_t L = static_cast<int64_t>(state.sent_token_L.size());
    exchange.local = activation_rows({L, W}, dtype);
    exchange.local_set.assign(static_cast<size_t>(L), 0);
    for (size_t i = 0; i < local_rows.size(); ++i) {
      std::memcpy(exchange.local.data<uint8_t>() + static_cast<size_t>(local_rows[i]) * row_bytes,
                  local_bytes.data() + i * row_bytes, row_bytes);
      exchange.local_set[static_cast<size_t>(local_rows[i])] = 1;
    }
    window.synchronize();  // every rank has read before the window goes
    const std::vector<size_t> recv = topo.rail.exchange_counts(send);
    exchange.sent = activation_rows({static_cast<int64_t>(exchange.sent_rows.size()), W}, dtype);
    if (!packed.empty()) std::memcpy(exchange.sent.data<uint8_t>(), packed.data(), packed.size());
    exchange.received = activation_rows({total(recv), W}, dtype);
    exchange.received_rows.assign(static_cast<size_t>(total(recv)), -1);
    count_dispatch_bytes(dtype, exchange.sent.numel());
    if (token_rows) {
      parallel::CommStats::instance().add_inter_host_bytes(static_cast<double>(exchange.sent.nbytes()), false);
    }
    exchange.started = std::chrono::steady_clock::now();
    const parallel::CommTimer timer(parallel::CommKind::kAllToAll);
    exchange.rows_work = topo.rail.all_to_all_v_async<int32_t>(exchange.sent_rows, send, exchange.received_rows, recv);
    exchange.work = topo.rail.all_to_all_v_async(exchange.sent, scaled(send, W), exchange.received, scaled(recv, W));
    exchange.work.trace_as("flex combine (inter-host)");
    return exchange;
  }
  // ... waited for -> [L, W] in this rank's expert-major order: the rows from its own host and from the others, the
  // partials of one row (under expert tensor parallelism, from several hosts) added in fp32.
  Tensor finish_from_experts(FromExperts& exchange, const DispatchState& /*state*/) const {
    const parallel::CommTimer timer(parallel::CommKind::kAllToAll);
    exchange.rows_work.wait();
    exchange.work.wait();
    if (topo_->hosts > 1) finish_link_delay(exchange.started);  // the inter-host link
    Tensor& out = exchange.local;
    const int64_t W = out.dim(1);
    const size_t row_bytes = static_cast<size_t>(W) * dtype_size(out.dtype());
    for (size_t i = 0; i < exchange.received_rows.size(); ++i) {
      const auto l = static_cast<size_t>(exchange.received_rows[i]);
      const uint8_t* in = exchange.received.data<uint8_t>() + i * row_bytes;
      uint8_t* at = out.data<uint8_t>() + l * row_bytes;
      if (!exchange.local_set[l]) {
        std::memcpy(at, in, row_bytes);
        exchange.local_set[l] = 1;
        continue;
      }
      auto* sum = reinterpret_cast<float*>(at);  // a row of a tensor: aligned
      std::vector<float> add(static_cast<size_t>(W));
      std::memcpy(add.data(), in, row_bytes);
      for (int64_t w = 0; w < W; ++w) sum[w] += add[static_cast<size_t>(w)];
    }
    return out;
  }

  static void add_probs(Tensor& dprobs_TE, const Tensor& dprobs_L, const DispatchState& state) {
    add_probs_gradients(dprobs_TE, dprobs_L, state.sent_token_L, state.sent_expert_L, state.T, state.E);
  }

  int64_t E_, El_;
  int ep_size_, ep_rank_, etp_size_, etp_rank_, host_;
  parallel::ProcessGroup group_;
  std::unique_ptr<Topology> topo_;
};

}  // namespace

std::unique_ptr<TokenDispatcher> make_flex_dispatcher(const int64_t num_experts,
                                                      const parallel::ParallelState& parallel) {
  return std::make_unique<FlexDispatcher>(num_experts, parallel);
}

}  // namespace detail
}  // namespace moecore
