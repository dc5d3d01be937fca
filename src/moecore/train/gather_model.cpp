#include "moecore/train/gather_model.h"

#include <cstring>
#include <map>
#include <span>
#include <stdexcept>
#include <string>
#include <utility>
#include <vector>

#include "moecore/parallel/comm_stats.h"

namespace moecore {
namespace {

// The one-process tensor from the shards of every rank of `group` (all-gathered; shard index = group rank).
std::vector<float> gather_shards(const Param& p, const parallel::ProcessGroup& group) {
  const auto n = static_cast<size_t>(p.value.numel());
  const auto size = static_cast<size_t>(group.size());
  Tensor all({static_cast<int64_t>(n * size)}, DType::kF32);
  group.all_gather(p.value, all);
  const float* gathered = all.data<float>();
  std::vector<float> full(n * size);
  ParamShard shard = p.shard;
  for (size_t r = 0; r < size; ++r) {
    shard.shard_index = static_cast<int>(r);
    for (size_t i = 0; i < n; ++i)
      full[static_cast<size_t>(full_index(shard, static_cast<int64_t>(i)))] = gathered[r * n + i];
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

// The tensors of one pipeline stage, one-process shaped, assembled on the stage's root (the rank of that stage at
// world rank 0's place in the other dimensions): TP / expert-TP shards all-gathered (collectives over the stage's
// groups), the experts of the other EP ranks sent by them. Returns the stage model on the root, null elsewhere.
std::unique_ptr<GPTModel> gather_stage(const GPTModel& model, const uint64_t seed, const int stage_root) {
  const parallel::ParallelState& par = model.parallel();
  const bool root = par.rank == stage_root;
  std::map<std::string, std::vector<float>> full_values;
  const bool expert_sender = !root && par.etp_rank() == 0 && par.edp.rank() == 0 && par.ep_rank() != 0;
  for (const Param& p : model.params()) {
    const bool keep = root || (expert_sender && p.is_expert);
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
      par.world.send(std::span<const float>(full_values.at(p.name)), stage_root);
    }
    return nullptr;
  }
  if (!root) return nullptr;

  // This stage's layers in one process; experts of other EP ranks arrive in their parameter order.
  std::vector<StageSpec> chunks;
  for (int c = 0; c < model.num_chunks(); ++c) chunks.push_back(model.stage(c));
  auto stage = std::make_unique<GPTModel>(model.config(), seed, parallel::ParallelState::single_process(), chunks);
  const int64_t E = model.config().moe.num_experts;
  const int64_t experts_per_rank = par.ep_size() > 0 && E > 0 ? E / par.ep_size() : 1;
  const RankGroups& ep_groups = par.layout.expert().ep;
  const std::vector<int>& my_ep_group = ep_groups[static_cast<size_t>(group_index_of(ep_groups, stage_root))];
  for (Param& p : stage->params()) {
    const auto n = static_cast<size_t>(p.value.numel());
    const bool expert = p.name.find("local_experts.") != std::string::npos;
    const int64_t owner = expert ? expert_of(p.name) / experts_per_rank : 0;
    if (owner == 0) {
      const std::vector<float>& src = full_values.at(p.name);
      if (src.size() != n) throw std::logic_error("gathered " + p.name + " has the wrong size");
      std::memcpy(p.value.data<float>(), src.data(), n * sizeof(float));
    } else {
      par.world.recv(p.value, my_ep_group[static_cast<size_t>(owner)]);
    }
  }
  for (const Buffer& b : model.named_buffers()) stage->buffer(b.name).value.copy_from(b.value);  // replicated
  return stage;
}

// Every named tensor of a stage model (parameters, then buffers), in order.
std::vector<std::pair<std::string, Tensor>> named_tensors(GPTModel& model) {
  std::vector<std::pair<std::string, Tensor>> out;
  for (const Param& p : model.params()) out.emplace_back(p.name, p.value);
  for (const Buffer& b : model.named_buffers()) out.emplace_back(b.name, b.value);
  return out;
}

}  // namespace

std::unique_ptr<GPTModel> gather_full_model(const GPTModel& model, const uint64_t seed) {
  const parallel::ParallelState& par = model.parallel();
  const parallel::CommTimer timer(parallel::CommKind::kOther);
  // Stage roots: world rank 0's pipeline, stage by stage.
  const RankGroups& pipelines = par.layout.dense().pp;
  const std::vector<int> roots =
      par.world.size() == 1 ? std::vector<int>{0} : pipelines[static_cast<size_t>(group_index_of(pipelines, 0))];
  const int my_root = roots[static_cast<size_t>(par.pp_rank())];
  std::unique_ptr<GPTModel> stage = gather_stage(model, seed, my_root);
  if (stage && par.rank != 0) {  // another stage's root: its tensors go to rank 0, name and values
    for (auto& [name, value] : named_tensors(*stage)) {
      const std::vector<int32_t> chars(name.begin(), name.end());
      const int64_t sizes[2] = {static_cast<int64_t>(chars.size()), value.numel()};
      par.world.send(std::span<const int64_t>(sizes, 2), 0);
      par.world.send(std::span<const int32_t>(chars), 0);
      par.world.send(value, 0);
    }
    const int64_t end[2] = {-1, -1};
    par.world.send(std::span<const int64_t>(end, 2), 0);
    return nullptr;
  }
  if (par.rank != 0) return nullptr;
  if (roots.size() == 1) return stage;  // no pipeline: the stage is the whole model
  // Rank 0: the whole model from every stage's tensors (the tied embedding's last-stage copy equals stage 0's).
  auto full = std::make_unique<GPTModel>(model.config(), seed);
  std::map<std::string, Tensor> targets;
  for (auto& [name, value] : named_tensors(*full)) targets.emplace(name, value);
  std::map<std::string, bool> filled;
  const auto fill = [&](const std::string& name, const std::span<const float> values) {
    const auto it = targets.find(name);
    if (it == targets.end() || static_cast<size_t>(it->second.numel()) != values.size()) {
      throw std::logic_error("gathered " + name + " does not fit the one-process model");
    }
    if (filled[name]) return;
    std::memcpy(it->second.data<float>(), values.data(), values.size() * sizeof(float));
    filled[name] = true;
  };
  for (auto& [name, value] : named_tensors(*stage)) fill(name, std::as_const(value).span<float>());
  for (size_t s = 1; s < roots.size(); ++s) {
    for (;;) {
      int64_t sizes[2];
      par.world.recv(std::span<int64_t>(sizes, 2), roots[s]);
      if (sizes[0] < 0) break;
      std::vector<int32_t> chars(static_cast<size_t>(sizes[0]));
      par.world.recv(std::span<int32_t>(chars), roots[s]);
      std::vector<float> values(static_cast<size_t>(sizes[1]));
      par.world.recv(std::span<float>(values), roots[s]);
      fill(std::string(chars.begin(), chars.end()), values);
    }
  }
  if (filled.size() != targets.size()) throw std::logic_error("the pipeline stages did not cover the whole model");
  return full;
}

}  // namespace moecore
