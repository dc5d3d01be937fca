// Megatron-FSDP (--use-megatron-fsdp, --data-parallel-sharding-strategy; Megatron's
// megatron/core/distributed/fsdp/mcore_fsdp_adapter.py and megatron_fsdp/*): fully sharded data parallelism over the
// flat buffers of DistributedDataParallel. Every decoder layer (TransformerLayer, dense or MoE) is one FSDP unit; the
// embedding, the final norm and the output layer sit outside every unit, as Megatron's, and keep whole parameters and
// gradients (their Adam states are sharded as the distributed optimizer's). So do the Multi-Token Prediction depths,
// whose layers Megatron shards as units (the model calls their hooks as one module with the output layer). Inside a
// unit, dense parameters are sharded over dp-cp and routed-expert parameters (names with ".experts.", so shared experts
// are dense) over expert-DP, each kind in a bucket of its own per unit; FSDP shards last, the TP / EP / ETP shard every
// rank already holds.
//
//   strategy            params (outside a unit's     gradients                  reduction of a unit's gradients
//                       forward / backward)
//   no_shard            whole                        whole                      all-reduce, last micro-batch
//   optim               whole                        whole                      reduce-scatter, last micro-batch
//   optim_grads         whole                        this rank's shard          reduce-scatter, every micro-batch
//   optim_grads_params  this rank's shard            this rank's shard          reduce-scatter, every micro-batch
//
// Adam states and main parameters: one shard per rank except with no_shard (replicated, as Megatron's no_shard).
// optim_grads_params (ZeRO-3): before a unit's forward its parameters are all-gathered (the next unit's gather is
// started then, a prefetch), after its forward they are freed; before its backward gathered again (prefetching the
// previous unit), freed after it. optim_grads / optim_grads_params: before a unit's backward a whole gradient buffer
// for the unit is allocated; after it the buffer is scaled by 1 / dp-cp (Megatron's gradient_scaling_factor, also
// for expert gradients, which hold the tokens of every EP rank), reduce-scattered over the bucket's group while the
// next unit's backward runs, added into this rank's gradient shard and freed. Gathered parameters and whole unit
// gradient buffers are transient: the memory tracker counts them as communication buffers (kComm), so kParams /
// kGrads / kOptimizer hold what stays between steps.
// 16-bit weights (Megatron-FSDP's main grads dtype "auto"): gradients in the weights' dtype, rounded after the unit's
// backward, scaled, reduce-scattered and accumulated into the shard in 16 bits (DdpOptions::grad_dtype); the weights
// are gathered in their fp32 storage.
#pragma once

#include <optional>
#include <string>
#include <string_view>

namespace moecore {

class DistributedDataParallel;

enum class ShardingStrategy { kNoShard, kOptim, kOptimGrads, kOptimGradsParams };

// Megatron's choice names: "no_shard", "optim", "optim_grads", "optim_grads_params".
std::string_view sharding_strategy_name(ShardingStrategy strategy);
std::optional<ShardingStrategy> parse_sharding_strategy(std::string_view name);

struct FsdpOptions {
  ShardingStrategy strategy = ShardingStrategy::kOptimGradsParams;
  // Modules [0, num_units) are units: the model's decoder layers (GPTModel's module numbers).
  int num_units = 0;
};

// While alive, every sharded unit's parameters are gathered whole into the model's Param::value (checkpoint saves
// and loads, gathering the model for export). On destruction with `write_back`, each rank's shard is taken from the
// (possibly rewritten) whole values; then the whole copies are freed.
class FsdpUnshardedScope {
 public:
  FsdpUnshardedScope(DistributedDataParallel& ddp, bool write_back);
  ~FsdpUnshardedScope();
  FsdpUnshardedScope(const FsdpUnshardedScope&) = delete;
  FsdpUnshardedScope& operator=(const FsdpUnshardedScope&) = delete;

 private:
  DistributedDataParallel& ddp_;
  bool write_back_;
};

}  // namespace moecore
