#include "moecore/train/gather_model.h"

#include <cstring>
#include <map>
#include <span>
#include <stdexcept>
#include <string>
#include <vector>

#include "moecore/parallel/comm_stats.h"

namespace moecore {
namespace {

// The one-process tensor from the shards of every rank of `group` (all-gathered; shard index = group rank).
std::vector<float> gather_shards(const Param& p, const parallel::ProcessGroup& group) {
  const auto n = static_cast<size_t>(p.value.numel());
  const auto size = static_cast<size_t>(group.size());
  std::vector<float> all(n * size);
  group.all_gather(p.value.span<float>(), std::span<float>(all));
  std::vector<float> full(n * size);
  ParamShard shard = p.shard;
  for (size_t r = 0; r < size; ++r) {
    shard.shard_index = static_cast<int>(r);
    for (size_t i = 0; i < n; ++i)
      full[static_cast<size_t>(full_index(shard, static_cast<int64_t>(i)))] = all[r * n + i];
  }
  return full;
}

// Global expert index of an expert parameter ("...mlp.experts.local_experts.{e}....").
int64_t expert_of(const std::string& name) {
  const std::string key = "local_experts.";
  const size_t at = name.find(key);
  if (at == std::string::npos) throw std::logic_error("not an expert parameter: " + name);
  return std::stoll(name.substr(at + key.size()));
}

}  // namespace

std::unique_ptr<GPTModel> gather_full_model(const GPTModel& model, const uint64_t seed) {
  const parallel::ParallelState& par = model.parallel();
  const parallel::CommTimer timer(parallel::CommKind::kOther);
  // Phase 1 (collectives only, in parameter order on every rank): assemble each tensor-parallel shard.
  std::map<std::string, std::vector<float>> full_values;
  std::vector<const std::vector<float>*> to_send;  // this rank's experts, in order, when it sends them
  const bool expert_sender = par.rank != 0 && par.etp_rank() == 0 && par.edp.rank() == 0 && par.ep_rank() != 0;
  for (const Param& p : model.params()) {
    const bool keep = par.rank == 0 || (expert_sender && p.is_expert);
    if (p.tensor_sharded()) {
      std::vector<float> full = gather_shards(p, p.is_expert ? par.etp : par.tp);  // collective: every rank
      if (keep) full_values[p.name] = std::move(full);
    } else if (keep) {
      const std::span<const float> v = p.value.span<float>();
      full_values[p.name].assign(v.begin(), v.end());
    }
  }
  if (expert_sender) {
    for (const Param& p : model.params()) {
      if (!p.is_expert) continue;
      par.world.send(std::span<const float>(full_values.at(p.name)), 0);
    }
    return nullptr;
  }
  if (par.rank != 0) return nullptr;

  // Phase 2 on rank 0: a one-process model; experts of other EP ranks arrive in their parameter order.
  auto full = std::make_unique<GPTModel>(model.config(), seed);
  const int64_t E = model.config().moe.num_experts;
  const int64_t experts_per_rank = par.ep_size() > 0 && E > 0 ? E / par.ep_size() : 1;
  const RankGroups& ep_groups = par.layout.expert().ep;
  const std::vector<int>& my_ep_group = ep_groups[static_cast<size_t>(group_index_of(ep_groups, 0))];
  for (Param& p : full->params()) {
    float* dst = p.value.data<float>();
    const auto n = static_cast<size_t>(p.value.numel());
    const bool expert = p.name.find("local_experts.") != std::string::npos;
    const int64_t owner = expert ? expert_of(p.name) / experts_per_rank : 0;
    if (owner == 0) {
      const std::vector<float>& src = full_values.at(p.name);
      if (src.size() != n) throw std::logic_error("gathered " + p.name + " has the wrong size");
      std::memcpy(dst, src.data(), n * sizeof(float));
    } else {
      par.world.recv(std::span<float>(dst, n), my_ep_group[static_cast<size_t>(owner)]);
    }
  }
  for (const Buffer& b : model.named_buffers()) full->buffer(b.name).value.copy_from(b.value);  // replicated
  return full;
}

}  // namespace moecore
