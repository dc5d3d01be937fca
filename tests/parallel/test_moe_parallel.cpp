// MoELayer under Megatron's parallel layouts (TP with sequence shards, EP, expert-TP, Parallel Folding) against a
// one-process MoELayer on the same parameters (init_param draws the one-process elements in every layout).
// Every data-parallel rank d holds its own micro-batch x_d (the same on every rank, built from d); under TP each
// TP rank feeds its sequence shard. On every rank the reference runs each x_d in one process. Compared with relative
// tolerance 1e-5 (max-abs difference over max-abs reference value): outputs and input gradients of the local shard,
// the logged aux / seq-aux / global-aux / z losses summed over tp-cp, grad_sum_over_tp parameters summed over TP,
// TP-sharded shared-expert gradients as slices, routed-expert gradients summed over expert-DP as slices of the sum
// over all micro-batches, and the expert bias after finish_global_batch.
// Runs as one process or under mpirun; exits non-zero when any check failed on any rank.
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <map>
#include <optional>
#include <span>
#include <string>
#include <vector>

#include "moecore/model/param.h"
#include "moecore/moe/moe_layer.h"
#include "moecore/parallel/parallel_state.h"
#include "moecore/parallel/process_group.h"
#include "moecore/tensor/rng.h"
#include "parallel/dist_checks.h"

namespace {

using namespace moecore::test;  // NOLINT: check, g_rank, g_failures (dist_checks.h)
using namespace moecore;
using parallel::ParallelState;
using parallel::ProcessGroup;
using parallel::ReduceOp;

constexpr double kRtol = 1e-5;
constexpr uint64_t kSeed = 1234, kKey = 77;
constexpr int kModule = 3;
constexpr int64_t kS = 8, kB = 2, kH = 16;
constexpr double kAuxGradScale = 0.5;

// max |a - b| <= rtol * max |b| (and both finite).
void check_close(const std::vector<double>& actual, const std::vector<double>& expected, const std::string& what) {
  if (actual.size() != expected.size()) {
    check(false, what + ": size " + std::to_string(actual.size()) + " vs " + std::to_string(expected.size()));
    return;
  }
  double diff = 0.0, scale = 0.0;
  bool finite = true;
  for (size_t i = 0; i < actual.size(); ++i) {
    finite = finite && std::isfinite(actual[i]) && std::isfinite(expected[i]);
    diff = std::max(diff, std::abs(actual[i] - expected[i]));
    scale = std::max(scale, std::abs(expected[i]));
  }
  const bool ok = finite && diff <= kRtol * scale;
  if (!ok) {
    check(false, what + ": max diff " + std::to_string(diff) + " vs scale " + std::to_string(scale));
  }
}

std::vector<double> to_double(const float* p, const int64_t n) { return {p, p + n}; }

struct Layout {
  std::string name;
  int tp = 1, ep = 1;
  std::optional<int> etp;
};

struct Case {
  std::string name;
  ModelConfig config;
  bool needs_tp1 = false;  // capacity: Megatron computes it on local tokens, so only TP 1 matches one process
  bool needs_dp1 = false;  // global aux loss: one process over several micro-batches accumulates differently
};

ModelConfig base_config() {
  ModelConfig c;
  c.num_layers = 4;
  c.hidden_size = kH;
  c.ffn_hidden_size = 32;
  c.init_method_std = 0.3;  // large enough that routing is far from ties and losses are not tiny
  c.activation = Activation::kSwiGLU;
  c.add_bias_linear = false;
  c.moe.num_experts = 8;
  c.moe.ffn_hidden_size = 8;
  c.moe.topk = 2;
  return c;
}

std::vector<Case> cases() {
  std::vector<Case> out;
  {  // sigmoid scores, expert bias, aux + seq-aux + z losses, jitter, gated shared experts, grouped GEMM
    Case c{"sigmoid_bias_aux", base_config()};
    MoEConfig& m = c.config.moe;
    m.score_function = RouterScoreFunction::kSigmoid;
    m.enable_expert_bias = true;
    m.bias_update_rate = 1e-2;
    m.load_balancing_types = {LoadBalancingType::kAuxLoss, LoadBalancingType::kSeqAuxLoss};
    m.aux_loss_coeffs = {1e-1, 5e-2};
    m.z_loss_coeff = 1e-2;
    m.input_jitter_eps = 0.05;
    m.shared_expert_intermediate_size = 8;
    m.shared_expert_gate = true;
    m.grouped_gemm = true;
    m.topk_scaling_factor = 1.5;
    m.dispatcher_type = TokenDispatcherType::kAllToAll;
    out.push_back(c);
  }
  {  // the same with --moe-shared-expert-overlap (the reference runs without it)
    Case c{"shared_expert_overlap", out.back().config};
    c.config.moe.shared_expert_overlap = true;
    out.push_back(c);
  }
  {  // softmax, aux + seq-aux + z losses, gelu, bias (ETP 1 only; shared experts refuse biases), sequential MLP
    Case c{"softmax_aux_bias", base_config()};
    c.config.activation = Activation::kGelu;
    c.config.add_bias_linear = true;
    MoEConfig& m = c.config.moe;
    m.load_balancing_types = {LoadBalancingType::kSeqAuxLoss, LoadBalancingType::kAuxLoss};
    m.aux_loss_coeffs = {1e-1, 1e-1};
    m.z_loss_coeff = 1e-3;
    m.dispatcher_type = TokenDispatcherType::kAllGather;
    out.push_back(c);
  }
  {  // softmax with capacity factor, dropping by probs and padding to capacity, shared experts without gate
    Case c{"softmax_capacity_pad", base_config()};
    MoEConfig& m = c.config.moe;
    m.shared_expert_intermediate_size = 16;
    m.pre_softmax = true;
    m.capacity_factor = 1.0;
    m.pad_expert_input_to_capacity = true;
    m.load_balancing_types = {LoadBalancingType::kAuxLoss};
    m.aux_loss_coeffs = {1e-2};
    m.dispatcher_type = TokenDispatcherType::kAllToAll;
    c.needs_tp1 = true;
    out.push_back(c);
  }
  {  // global aux loss and forced load balancing (random logits keyed by the one-process index)
    Case c{"global_aux", base_config()};
    MoEConfig& m = c.config.moe;
    m.load_balancing_types = {LoadBalancingType::kGlobalAuxLoss};
    m.aux_loss_coeffs = {1e-1};
    m.dispatcher_type = TokenDispatcherType::kAllGather;
    c.needs_dp1 = true;
    out.push_back(c);
    Case f{"force_balance", base_config()};
    f.config.moe.force_load_balancing = true;
    f.config.moe.input_jitter_eps = 0.1;
    f.config.moe.aux_loss_coeffs = {1e-2};
    f.config.moe.dispatcher_type = TokenDispatcherType::kAllToAll;
    out.push_back(f);
  }
  return out;
}

std::vector<Layout> layouts(const int world) {
  if (world == 1) return {{"single", 1, 1, std::nullopt}};
  std::vector<Layout> out = {
      {"tp", world, 1, std::nullopt},  // ETP = TP
      {"tp_etp1", world, 1, 1},        // experts replicated, expert-DP = world
      {"ep", 1, world, 1},
  };
  if (world == 4) out.push_back({"etp2xep2", 2, 2, 2});
  if (world == 2 || world == 4) out.push_back({"folded_tp2_ep2_etp1", 2, 2, 1});
  return out;
}

// Micro-batch d: x [S*B, H] and dout [S*B, H], identical on every rank.
std::vector<float> random_rows(const uint64_t key, const int64_t n) {
  const CounterRng rng(99, key);
  std::vector<float> v(static_cast<size_t>(n));
  for (int64_t i = 0; i < n; ++i) v[static_cast<size_t>(i)] = static_cast<float>(rng.normal(static_cast<uint64_t>(i)));
  return v;
}

struct Reference {
  std::vector<std::vector<double>> out, dx;                       // per micro-batch, [T, H]
  std::vector<std::map<std::string, std::vector<double>>> grads;  // per micro-batch
  std::vector<std::vector<double>> losses;                        // per micro-batch: load-balancing losses then z
  std::vector<float> expert_bias;                                 // after every micro-batch and finish_global_batch
};

std::vector<double> logged_losses(const RouterOutput& r) {
  std::vector<double> v = r.load_balancing_losses;
  v.push_back(r.z_loss);
  return v;
}

Reference run_reference(const ModelConfig& layout_config, const int dp) {
  const std::string prefix = "decoder.layers.3.";
  ModelConfig config = layout_config;
  config.moe.shared_expert_overlap = false;  // the plain layer is the reference of the overlapped one
  ParamStore params;
  MoELayer layer(config, prefix, params, ParallelState::single_process(), kModule);
  for (Param& p : params) init_param(p, kSeed, config.init_method_std, config.num_layers);
  Reference ref;
  const int64_t T = kS * kB;
  for (int d = 0; d < dp; ++d) {
    for (Param& p : params) p.grad.zero_();
    const std::vector<float> x = random_rows(2 * d, T * kH), dout = random_rows(2 * d + 1, T * kH);
    std::vector<float> out(static_cast<size_t>(T * kH)), dx(static_cast<size_t>(T * kH), 0.0f);
    MoELayerActivations saved;
    const Tensor x_TH = Tensor::from_blob(x.data(), {T, kH});
    const Tensor out_TH = layer.forward(x_TH, kS, kB, TokenRows(), true, kSeed, kKey, saved);
    const Tensor dx_TH = layer.backward(Tensor::from_blob(dout.data(), {T, kH}), x_TH, kAuxGradScale, saved);
    std::copy_n(out_TH.data<float>(), out_TH.numel(), out.begin());
    std::copy_n(dx_TH.data<float>(), dx_TH.numel(), dx.begin());
    ref.out.push_back(to_double(out.data(), T * kH));
    ref.dx.push_back(to_double(dx.data(), T * kH));
    ref.losses.push_back(logged_losses(saved.routing));
    std::map<std::string, std::vector<double>> g;
    for (const Param& p : params) g[p.name] = to_double(p.grad.data<float>(), p.grad.numel());
    ref.grads.push_back(std::move(g));
  }
  layer.finish_global_batch();
  const std::span<const float> bias = layer.router().expert_bias();
  ref.expert_bias.assign(bias.begin(), bias.end());
  return ref;
}

void sum_over(std::vector<double>& v, const ProcessGroup& group) {
  std::vector<float> f(v.begin(), v.end());
  group.all_reduce<float>(f, ReduceOp::kSum);
  for (size_t i = 0; i < v.size(); ++i) v[i] = f[i];
}

// Returns what ran: "checked", "skipped" (a case Megatron does not define equal to one process in this layout), or
// "bias-rejected" (the ConfigError check).
std::string run_case(const Case& c, const Layout& layout, const ProcessGroup& world) {
  const std::string tag = c.name + " / " + layout.name;
  ParallelSizes sizes;
  sizes.world_size = world.size();
  sizes.tensor_model_parallel_size = layout.tp;
  sizes.expert_model_parallel_size = layout.ep;
  sizes.expert_tensor_parallel_size = layout.etp;
  const ParallelState ps = ParallelState::create(sizes, true, world);
  const int tp = ps.tp_size(), dp = ps.dp_size(), d = ps.dp_rank();
  if ((c.needs_tp1 && tp > 1) || (c.needs_dp1 && dp > 1)) return "skipped";
  const std::string prefix = "decoder.layers.3.";
  const ModelConfig& config = c.config;

  if (config.add_bias_linear && ps.etp_size() > 1) {  // Megatron: MoE bias only with ETP 1
    ParamStore params;
    bool threw = false;
    try {
      MoELayer layer(config, prefix, params, ps, kModule);
    } catch (const ConfigError&) {
      threw = true;
    }
    check(threw, tag + ": bias with ETP > 1 must throw ConfigError");
    return "bias-rejected";
  }

  const Reference ref = run_reference(config, dp);
  // The reference exercises what the case is about: every configured loss is non-zero, the bias moves.
  for (size_t i = 0; i < config.moe.load_balancing_types.size(); ++i) {
    check(config.moe.aux_loss_coeffs[i] == 0 || ref.losses[d][i] > 0,
          tag + ": reference load-balancing loss " + std::to_string(i) + " is zero");
  }
  check((config.moe.z_loss_coeff > 0) == (ref.losses[d].back() > 0), tag + ": reference z-loss");
  if (config.moe.enable_expert_bias) {
    check(std::any_of(ref.expert_bias.begin(), ref.expert_bias.end(), [](const float b) { return b != 0.0f; }),
          tag + ": reference expert bias did not move");
  }

  ParamStore params;
  MoELayer layer(config, prefix, params, ps, kModule);
  for (Param& p : params) init_param(p, kSeed, config.init_method_std, config.num_layers);

  // Registration: this EP rank's experts under global names, flags.
  const int64_t E = config.moe.num_experts, El = E / ps.ep_size();
  int64_t experts_seen = 0;
  for (const Param& p : params) {
    check(p.module == kModule, tag + ": module of " + p.name);
    const bool expert = p.name.find("local_experts.") != std::string::npos;
    check(p.is_expert == expert, tag + ": is_expert of " + p.name);
    const bool tp_sum = p.name.find("router.") != std::string::npos || p.name.find("gate_weight") != std::string::npos;
    check(p.grad_sum_over_tp == tp_sum, tag + ": grad_sum_over_tp of " + p.name);
    if (!expert) continue;
    const size_t at = p.name.find("local_experts.") + 14;
    const int64_t e = std::stoll(p.name.substr(at));
    check(e >= ps.ep_rank() * El && e < (ps.ep_rank() + 1) * El, tag + ": non-local expert " + p.name);
    check(p.shard.num_shards == ps.etp_size() && p.shard.shard_index == ps.etp_rank(), tag + ": shard of " + p.name);
    if (p.name.find("linear_fc1.weight") != std::string::npos) ++experts_seen;
  }
  check(experts_seen == El, tag + ": registered " + std::to_string(experts_seen) + " experts");

  // This rank's sequence shard of micro-batch d.
  const int64_t T = kS * kB, S_loc = kS / tp, T_loc = S_loc * kB, offset = ps.tp_rank() * T_loc;
  const std::vector<float> x = random_rows(2 * d, T * kH), dout = random_rows(2 * d + 1, T * kH);
  for (Param& p : params) p.grad.zero_();
  std::vector<float> out(static_cast<size_t>(T_loc * kH)), dx(static_cast<size_t>(T_loc * kH), 0.0f);
  MoELayerActivations saved;
  const Tensor x_TH = Tensor::from_blob(x.data() + offset * kH, {T_loc, kH});
  const Tensor out_TH = layer.forward(x_TH, S_loc, kB, TokenRows::contiguous(offset, T_loc), true, kSeed, kKey, saved);
  const Tensor dx_TH =
      layer.backward(Tensor::from_blob(dout.data() + offset * kH, {T_loc, kH}), x_TH, kAuxGradScale, saved);
  std::copy_n(out_TH.data<float>(), out_TH.numel(), out.begin());
  std::copy_n(dx_TH.data<float>(), dx_TH.numel(), dx.begin());

  auto slice = [&](const std::vector<double>& full) {
    return std::vector<double>(full.begin() + offset * kH, full.begin() + (offset + T_loc) * kH);
  };
  check_close(to_double(out.data(), T_loc * kH), slice(ref.out[d]), tag + ": output");
  check_close(to_double(dx.data(), T_loc * kH), slice(ref.dx[d]), tag + ": input gradient");

  // Logged losses: each rank's share; their sum over tp-cp is the one-process value.
  std::vector<double> losses = logged_losses(saved.routing);
  sum_over(losses, ps.tp_cp);
  check_close(losses, ref.losses[d], tag + ": logged losses");

  // Gradients after the reductions the caller (DDP) performs before its data-parallel average.
  for (Param& p : params) {
    std::vector<double> g = to_double(p.grad.data<float>(), p.grad.numel());
    std::vector<double> expected(g.size());
    if (p.is_expert) {
      sum_over(g, ps.edp);  // every micro-batch's tokens reached expert e on exactly one rank of the expert-DP group
      for (size_t i = 0; i < g.size(); ++i) {
        double sum = 0.0;
        for (int dd = 0; dd < dp; ++dd) {
          sum += ref.grads[dd].at(p.name)[static_cast<size_t>(full_index(p.shard, static_cast<int64_t>(i)))];
        }
        expected[i] = sum;
      }
    } else {
      if (p.grad_sum_over_tp) sum_over(g, ps.tp);
      for (size_t i = 0; i < g.size(); ++i) {
        expected[i] = ref.grads[d].at(p.name)[static_cast<size_t>(full_index(p.shard, static_cast<int64_t>(i)))];
      }
    }
    check_close(g, expected, tag + ": gradient of " + p.name);
  }

  layer.finish_global_batch();
  const std::span<const float> bias_span = layer.router().expert_bias();
  const std::vector<float> bias(bias_span.begin(), bias_span.end());
  check(bias == ref.expert_bias, tag + ": expert bias after finish_global_batch");
  return "checked";
}

}  // namespace

int main(int argc, char** argv) {
  const parallel::MpiRuntime mpi(&argc, &argv);
  int failed_total = 0;
  try {
    const ProcessGroup world = ProcessGroup::world();
    g_rank = world.rank();
    for (const Layout& layout : layouts(world.size())) {
      for (const Case& c : cases()) {
        g_failures = 0;
        std::string what = "threw";
        try {
          what = run_case(c, layout, world);
        } catch (const std::exception& error) {
          ++g_failures;
          std::fprintf(stderr, "[rank %d] %s / %s threw: %s\n", g_rank, c.name.c_str(), layout.name.c_str(),
                       error.what());
        }
        std::vector<float> failed{g_failures > 0 ? 1.0f : 0.0f};
        world.all_reduce<float>(failed, ReduceOp::kMax);
        if (failed[0] > 0) ++failed_total;
        if (world.rank() == 0) {
          std::printf("%s %s / %s (%d ranks): %s\n", failed[0] > 0 ? "FAIL" : "ok  ", c.name.c_str(),
                      layout.name.c_str(), world.size(), what.c_str());
        }
      }
    }
  } catch (const std::exception& error) {
    std::fprintf(stderr, "[rank %d] fatal: %s\n", g_rank, error.what());
    return 1;
  }
  if (g_rank == 0) std::printf("%d failed\n", failed_total);
  return failed_total > 0 ? 1 : 0;
}
