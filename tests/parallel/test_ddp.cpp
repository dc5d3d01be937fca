// DistributedDataParallel + DistributedAdamW checked against a single-process AdamWOptimizer. Every rank builds
// its local params of a small synthetic model (dense TP-sharded and replicated params, params summed over TP,
// routed experts split over EP and sharded over expert-TP, modules -1..3), fills gradients with rank-keyed values
// over two micro-batches, and runs 3 steps with clipping. The reference holds the one-process model; its gradient
// is the correct average recomputed locally from every rank's values. Runs as one process or under mpirun with
// any rank count; every layout that fits the world size is tried. Prints "N passed, M failed" on rank 0.
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "moecore/optim/adamw_optimizer.h"
#include "moecore/optim/ddp.h"
#include "moecore/optim/distributed_optimizer.h"
#include "moecore/parallel/parallel_state.h"
#include "moecore/parallel/process_group.h"
#include "moecore/tensor/memory_tracker.h"
#include "parallel/dist_checks.h"

namespace {

using moecore::AdamWOptimizer;
using moecore::AdamWOptions;
using moecore::DdpOptions;
using moecore::DistributedAdamW;
using moecore::DistributedDataParallel;
using moecore::MemCategory;
using moecore::MemoryTracker;
using moecore::ParallelSizes;
using moecore::Param;
using moecore::ParamShard;
using moecore::ParamStore;
using namespace moecore::test;  // NOLINT: check, g_rank, g_failures, mix, name_hash (dist_checks.h)
namespace parallel = moecore::parallel;

// Initial value of element f of the one-process tensor `name`: in [-1, 1].
float init_value(const std::string& name, const int64_t f) {
  const uint64_t z = mix(name_hash(name) ^ mix(static_cast<uint64_t>(f)));
  return static_cast<float>(static_cast<double>(z >> 11) / 9007199254740992.0 * 2.0 - 1.0);
}

// Gradient contribution of contributor c: a multiple of 1/64 in [-4, 4], so sums over ranks and micro-batches
// (and the division by a power-of-two DP size) are exact in fp32 whatever the reduction order.
float grad_value(const std::string& name, const int64_t f, const int contributor, const int step, const int mb) {
  uint64_t z = mix(name_hash(name) ^ mix(static_cast<uint64_t>(f) * 31 + static_cast<uint64_t>(contributor)));
  z = mix(z ^ (static_cast<uint64_t>(step) << 8) ^ static_cast<uint64_t>(mb));
  return static_cast<float>(static_cast<int>(z % 513) - 256) / 64.0f;
}

// One parameter of the synthetic model, in one-process terms.
struct Spec {
  std::string name;
  std::vector<int64_t> full_shape;
  int module;
  bool expert = false;
  bool sum_over_tp = false;
  int shard_dim = -1;  // sharded over TP (experts: expert-TP) along this dim; -1 replicated
  int segments = 1;
};

constexpr int kNumExperts = 4;

std::vector<Spec> dense_specs() {
  return {
      {"embedding.word_embeddings.weight", {40, 8}, -1, false, false, 0},
      {"decoder.layers.0.self_attention.linear_qkv.weight", {24, 8}, 0, false, false, 0},
      {"decoder.layers.0.self_attention.linear_qkv.bias", {24}, 0, false, false, 0},
      {"decoder.layers.0.input_layernorm.weight", {8}, 0, false, true},
      {"decoder.layers.0.self_attention.linear_proj.weight", {8, 16}, 0, false, false, 1},
      {"decoder.layers.1.mlp.router.weight", {kNumExperts, 8}, 1, false, true},
      {"decoder.layers.1.input_layernorm.weight", {8}, 1, false, false},  // replicated, equal over TP
      {"decoder.layers.2.mlp.linear_fc1.weight", {32, 8}, 2, false, false, 0, 2},
      {"decoder.layers.2.mlp.linear_fc2.weight", {8, 16}, 2, false, false, 1},
      {"decoder.layers.2.mlp.linear_fc2.bias", {8}, 2, false, true},
      {"decoder.final_layernorm.weight", {8}, 3, false, true},
      {"output_layer.weight", {40, 8}, 3, false, false, 0},
  };
}

// Expert e's params (registered between the router and layer 2 in the model).
std::vector<Spec> expert_specs(const int e) {
  const std::string prefix = "decoder.layers.1.mlp.experts.local_experts." + std::to_string(e) + ".";
  return {
      {prefix + "linear_fc1.weight", {24, 8}, 1, true, false, 0, 2},
      {prefix + "linear_fc2.weight", {8, 12}, 1, true, false, 1},
      {prefix + "linear_fc2.bias", {8}, 1, true, false},  // replicated over expert-TP
  };
}

// The model in registration order on a rank with this EP rank (all experts when ep_size == 1 and for the
// reference, which passes ep_size 1).
std::vector<Spec> model_specs(const int ep_rank, const int ep_size) {
  std::vector<Spec> dense = dense_specs();
  std::vector<Spec> specs(dense.begin(), dense.begin() + 7);
  const int local = kNumExperts / ep_size;
  for (int j = 0; j < local; ++j) {
    for (Spec& s : expert_specs(ep_rank * local + j)) specs.push_back(std::move(s));
  }
  specs.insert(specs.end(), dense.begin() + 7, dense.end());
  return specs;
}

Param make(const Spec& spec, const int num_shards, const int shard_index) {
  ParamShard shard;
  shard.full_shape = spec.full_shape;
  if (spec.shard_dim >= 0 && num_shards > 1) {
    shard.dim = spec.shard_dim;
    shard.segments = spec.segments;
    shard.num_shards = num_shards;
    shard.shard_index = shard_index;
  }
  Param p = moecore::make_sharded_param(spec.name, shard, moecore::InitKind::kZeros);
  p.module = spec.module;
  p.is_expert = spec.expert;
  p.grad_sum_over_tp = spec.sum_over_tp;
  for (int64_t i = 0; i < p.value.numel(); ++i) {
    p.value.data<float>()[i] = init_value(spec.name, moecore::full_index(p.shard, i));
  }
  return p;
}

struct Layout {
  std::string name;
  ParallelSizes sizes;
};

struct Config {
  std::string name;
  DdpOptions ddp;
};

double rel_diff(const double a, const double b) { return std::abs(a - b) / std::max(std::abs(b), 1e-30); }

// One training run of `config` on `layout`; returns through check().
void run_case(const Layout& layout, const Config& config) {
  const parallel::ParallelState ps =
      layout.sizes.world_size == 1 && !parallel::launched_by_mpi()
          ? parallel::ParallelState::single_process()
          : parallel::ParallelState::create(layout.sizes, false, parallel::ProcessGroup::world());
  const int tp = ps.tp_size(), etp = ps.etp_size(), ep = ps.ep_size();
  const int dp_cp = ps.dp_cp.size(), edp = ps.edp.size();

  const std::vector<Spec> local_specs = model_specs(ps.ep_rank(), ep);
  ParamStore params;
  for (const Spec& s : local_specs) {
    params.push_back(s.expert ? make(s, etp, ps.etp_rank()) : make(s, tp, ps.tp_rank()));
  }
  const std::vector<Spec> ref_specs = model_specs(0, 1);
  ParamStore ref;
  for (const Spec& s : ref_specs) ref.push_back(make(s, 1, 0));
  std::vector<Param*> ref_of;  // local param -> its one-process reference
  for (const Param& p : params) {
    for (Param& r : ref) {
      if (r.name == p.name) ref_of.push_back(&r);
    }
  }

  const AdamWOptions adam{0.9, 0.95, 1e-8, 0.1};
  AdamWOptimizer ref_opt(ref, adam);
  DistributedDataParallel ddp(params, ps, config.ddp);
  const int64_t opt_before = MemoryTracker::instance().current(MemCategory::kOptimizer);
  DistributedAdamW opt(ddp, params, adam);
  const int64_t opt_bytes = MemoryTracker::instance().current(MemCategory::kOptimizer) - opt_before;

  // Optimizer memory: full states without the distributed optimizer, the bucket shards with it.
  int64_t local_numel = 0;
  for (const Param& p : params) local_numel += p.value.numel();
  if (config.ddp.use_distributed_optimizer) {
    int64_t shard_total = 0;
    for (const auto& b : ddp.buckets()) {
      const int64_t group_size = ddp.groups()[static_cast<size_t>(b.group)].pg.size();
      check(b.shard_size * group_size == b.end - b.begin, "bucket padded to a multiple of the group size");
      shard_total += b.shard_size;
    }
    check(opt_bytes == 8 * shard_total, "optimizer bytes " + std::to_string(opt_bytes) + " = 2 fp32 states per shard");
    // Each group's shard is about 1/group size of its params (plus at most 16 + 128 * size padding per param).
    const int64_t bound = local_numel / std::min(dp_cp, edp) + static_cast<int64_t>(params.size()) * 16 +
                          static_cast<int64_t>(ddp.buckets().size()) * 128 * std::max(dp_cp, edp);
    check(shard_total <= bound, "sharded states " + std::to_string(shard_total) + " <= " + std::to_string(bound));
  } else {
    check(opt_bytes == 8 * local_numel, "replicated optimizer states");
  }
  if (config.ddp.bucket_size > 0 && config.ddp.bucket_size < 200) {
    check(ddp.buckets().size() >= 4, "small bucket size gives several buckets");
  }

  const double max_norms[3] = {1.0, 1e9, 20.0};
  const double lrs[3] = {1e-2, 2e-2, 5e-3};
  constexpr int kMicroBatches = 2;
  for (int step = 0; step < 3; ++step) {
    // Forward: with overlapped param gather, each module's params are complete once before_forward returns.
    for (int m = -1; m <= 3; ++m) {
      ddp.before_forward(m);
      for (size_t i = 0; i < params.size(); ++i) {
        if (params[i].module != m) continue;
        bool same = true;
        for (int64_t k = 0; k < params[i].value.numel(); ++k) {
          const float want = ref_of[i]->value.data<float>()[moecore::full_index(params[i].shard, k)];
          same = same && params[i].value.data<float>()[k] == want;
        }
        check(same, params[i].name + " gathered before its forward at step " + std::to_string(step));
      }
    }
    ddp.zero_grad();
    for (int mb = 0; mb < kMicroBatches; ++mb) {
      ddp.set_last_microbatch(mb == kMicroBatches - 1);
      for (int m = 3; m >= -1; --m) {  // backward order
        for (size_t i = 0; i < params.size(); ++i) {
          Param& p = params[i];
          if (p.module != m) continue;
          const int contributor = p.is_expert          ? ps.edp.rank()
                                  : p.grad_sum_over_tp ? ps.dp_cp.rank() * tp + ps.tp_rank()
                                                       : ps.dp_cp.rank();
          for (int64_t k = 0; k < p.grad.numel(); ++k) {
            p.grad.data<float>()[k] += grad_value(p.name, moecore::full_index(p.shard, k), contributor, step, mb);
          }
        }
        ddp.after_backward(m);
      }
    }
    ddp.finish_grad_sync();

    // Reference gradient: every contributor's micro-batches, divided by the dp-cp size (expert grads too).
    for (size_t r = 0; r < ref.size(); ++r) {
      const Spec& s = ref_specs[r];
      const int contributors = s.expert ? edp : s.sum_over_tp ? dp_cp * tp : dp_cp;
      for (int64_t f = 0; f < ref[r].grad.numel(); ++f) {
        double sum = 0.0;
        for (int c = 0; c < contributors; ++c) {
          for (int mb = 0; mb < kMicroBatches; ++mb) sum += grad_value(s.name, f, c, step, mb);
        }
        ref[r].grad.data<float>()[f] = static_cast<float>(sum / dp_cp);
      }
    }
    const double ref_norm = ref_opt.clip_grad_norm(max_norms[step]);
    const double norm = opt.clip_grad_norm(max_norms[step]);
    check(rel_diff(norm, ref_norm) < 1e-9,
          "grad norm " + std::to_string(norm) + " vs reference " + std::to_string(ref_norm));
    if (step == 0) check(ref_norm > max_norms[0], "clipping active in step 0");
    ref_opt.step(lrs[step]);
    opt.step(lrs[step]);
  }
  ddp.wait_param_gather();

  double worst = 0.0;
  std::string worst_name;
  for (size_t i = 0; i < params.size(); ++i) {
    for (int64_t k = 0; k < params[i].value.numel(); ++k) {
      const double want = ref_of[i]->value.data<float>()[moecore::full_index(params[i].shard, k)];
      const double d = rel_diff(params[i].value.data<float>()[k], want);
      if (d > worst) worst = d, worst_name = params[i].name;
    }
  }
  check(worst <= 1e-6,
        "params after 3 steps: worst relative difference " + std::to_string(worst) + " in " + worst_name);
  check(ref_of.size() == params.size(), "every local param has a reference");
}

ParallelSizes sizes_of(const int tp, const int ep, const std::optional<int> etp) {
  ParallelSizes sizes;
  sizes.tensor_model_parallel_size = tp;
  sizes.expert_model_parallel_size = ep;
  sizes.expert_tensor_parallel_size = etp;
  return sizes;
}

DdpOptions options_of(const int64_t bucket_size, const bool overlap_grad, const bool dist_opt,
                      const bool overlap_param) {
  DdpOptions options;
  options.bucket_size = bucket_size;
  options.overlap_grad_reduce = overlap_grad;
  options.use_distributed_optimizer = dist_opt;
  options.overlap_param_gather = overlap_param;
  return options;
}

}  // namespace

int main(int argc, char** argv) {
  std::unique_ptr<parallel::MpiRuntime> mpi;
  int world_size = 1;
  if (parallel::launched_by_mpi()) {
    mpi = std::make_unique<parallel::MpiRuntime>(&argc, &argv);
    const parallel::ProcessGroup world = parallel::ProcessGroup::world();
    g_rank = world.rank();
    world_size = world.size();
  }

  std::vector<Layout> layouts;
  const auto add = [&](const std::string& name, ParallelSizes sizes) {
    sizes.world_size = world_size;
    try {
      const moecore::ParallelLayout check_layout(sizes);
      layouts.push_back({name, sizes});
    } catch (const std::exception&) {
      // the layout does not fit this world size
    }
  };
  add("dp", sizes_of(1, 1, std::nullopt));
  add("ep2", sizes_of(1, 2, std::nullopt));
  add("ep" + std::to_string(world_size), sizes_of(1, world_size, std::nullopt));
  add("tp2", sizes_of(2, 1, std::nullopt));
  add("tp2_ep2_etp1", sizes_of(2, 2, 1));
  add("tp2_etp1", sizes_of(2, 1, 1));
  if (world_size == 1) layouts.resize(1);                   // every layout above is plain DP on one rank
  if (world_size == 2) layouts.erase(layouts.begin() + 2);  // ep2 twice

  std::vector<Config> configs;
  configs.push_back({"plain", options_of(0, false, false, false)});
  configs.push_back({"overlap_grad", options_of(100, true, false, false)});
  configs.push_back({"buckets", options_of(100, false, false, false)});
  configs.push_back({"distopt", options_of(0, false, true, false)});
  configs.push_back({"distopt_buckets", options_of(150, false, true, false)});
  configs.push_back({"distopt_overlap", options_of(100, true, true, true)});

  int passed = 0, failed = 0;
  for (const Layout& layout : layouts) {
    for (const Config& config : configs) {
      g_failures = 0;
      std::string error;
      try {
        run_case(layout, config);
      } catch (const std::exception& e) {
        error = e.what();
        check(false, "exception: " + error);
      }
      // A case fails when any rank failed.
      std::vector<float> flag{static_cast<float>(g_failures > 0)};
      if (world_size > 1) parallel::ProcessGroup::world().all_reduce(std::span<float>(flag), parallel::ReduceOp::kMax);
      const bool ok = flag[0] == 0.0f;
      (ok ? passed : failed) += 1;
      if (g_rank == 0) std::printf("%s %s/%s\n", ok ? "PASS" : "FAIL", layout.name.c_str(), config.name.c_str());
    }
  }
  if (g_rank == 0) std::printf("%d passed, %d failed\n", passed, failed);
  return failed == 0 ? 0 : 1;
}
