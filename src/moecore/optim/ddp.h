// Megatron-style data parallelism (DistributedDataParallel + the distributed optimizer's buffers): every Param's
// gradient (and, with the distributed optimizer, its value) becomes a view into one flat fp32 buffer per group
// (dense params reduced over dp-cp, routed-expert params over expert-DP). Each buffer is cut into buckets of
// whole params in backward order; a bucket is all-reduced (or reduce-scattered with the distributed optimizer) as
// one collective, optionally launched as soon as the backward of its last module is done.
#pragma once

#include <cstdint>
#include <vector>

#include "moecore/model/model_hooks.h"
#include "moecore/model/param.h"
#include "moecore/parallel/parallel_state.h"
#include "moecore/parallel/process_group.h"

namespace moecore {

struct DdpOptions {
  // Elements per bucket (Megatron's --ddp-bucket-size). 0: Megatron's default, max(40M, 1M * dp size) with
  // overlap_grad_reduce and one bucket per group without it.
  int64_t bucket_size = 0;
  bool overlap_grad_reduce = false;
  bool use_distributed_optimizer = false;
  bool overlap_param_gather = false;  // with the distributed optimizer only
  // The dtype gradients travel in: fp32, or bf16 / fp16 (the fp32 bucket is rounded into a 16-bit buffer, reduced in
  // 16 bits and widened back: Megatron's --grad-reduce-in-bf16, and fp16 without --accumulate-allreduce-grads-in-fp32).
  DType grad_reduce_dtype = DType::kF32;
  // The values the gradient buffer holds (Megatron's main_grad dtype): fp32, or bf16 (--main-grads-dtype bf16 with
  // the precision-aware optimizer; give grad_reduce_dtype bf16 too). The buffer keeps fp32 storage, but after every
  // micro-batch's backward of a module its gradients are rounded to bf16, so they accumulate over micro-batches in
  // bf16 as in Megatron's bf16 buffer (which adds each micro-batch's gradient into bf16 main_grad).
  DType main_grad_dtype = DType::kF32;
  // The dtype of the distributed optimizer's parameter all-gather: the model weights' dtype (16-bit weights travel in
  // 16 bits, exactly).
  DType param_gather_dtype = DType::kF32;
};

class DistributedDataParallel : public ModelHooks {
 public:
  // One contiguous run of whole params inside a group's buffer. [begin, end) includes the padding that makes the
  // size a multiple of the group size with the distributed optimizer; rank r owns [shard_begin, shard_begin +
  // shard_size) with shard_begin = begin + r * shard_size.
  struct Bucket {
    int group = 0;
    int64_t begin = 0, end = 0;
    int64_t shard_begin = 0, shard_size = 0;
    std::vector<int> params;     // indices into the params vector, in buffer order
    std::vector<int> modules;    // sorted, unique
    Tensor comm_shard;           // distributed optimizer: reduce-scatter output and all-gather input [shard_size]
    Tensor wire;                 // 16-bit communication: the bucket's elements [end - begin]
    Tensor wire_shard;           // 16-bit communication with the distributed optimizer: this rank's shard
    bool decode_gather = false;  // a 16-bit parameter all-gather waits to be widened into the parameter buffer
    parallel::Work grad_work;
    parallel::Work param_work;
    bool grad_launched = false;
    bool param_in_flight = false;
  };
  // Where a param lives: its group, bucket and element offset in the group's buffer.
  struct Slot {
    int group = 0;
    int bucket = 0;
    int64_t offset = 0;
    int64_t numel = 0;
  };
  struct Group {
    bool expert = false;
    parallel::ProcessGroup pg = parallel::ProcessGroup::self();  // the gradient-reduction group
    Tensor grad_buffer;                                          // [numel], kGrads
    Tensor param_buffer;                                         // [numel], kParams (distributed optimizer only)
    std::vector<int> buckets;
  };

  // Rebinds every Param::grad (and with the distributed optimizer Param::value) to views of the flat buffers,
  // copying the current contents. `params` must outlive this object and keep its size.
  DistributedDataParallel(std::vector<Param>& params, const parallel::ParallelState& parallel,
                          const DdpOptions& options);
  ~DistributedDataParallel() override;
  DistributedDataParallel(const DistributedDataParallel&) = delete;
  DistributedDataParallel& operator=(const DistributedDataParallel&) = delete;

  // Zeroes every gradient buffer and starts a new gradient-sync round.
  void zero_grad();
  // Reductions start only during the backward of the last micro-batch (default true).
  void set_last_microbatch(bool last) { last_microbatch_ = last; }
  // overlap_param_gather: waits for the all-gathers of the buckets holding module's params.
  void before_forward(int module) override;
  // main_grad_dtype bf16: rounds module's gradients to bf16 (every micro-batch). overlap_grad_reduce on the last
  // micro-batch: TP sums of module's grad_sum_over_tp params, then launches every bucket whose modules are all done.
  void after_backward(int module) override;
  // Launches whatever has not been launched, waits for all. Afterwards every Param::grad holds the gradient summed
  // over the group and divided by the dp-cp size; with the distributed optimizer only this rank's shard of each
  // bucket does. Then the tied embedding's copies (Param::sum_over_embedding_group) are summed over the pipeline's
  // embedding group, as Megatron's finalize_model_grads.
  void finish_grad_sync();
  // Distributed optimizer: all-gathers every bucket's updated shard (asynchronously with overlap_param_gather).
  void start_param_gather();
  // Finishes any in-flight all-gather (before evaluation / export / the next step).
  void wait_param_gather();

  const DdpOptions& options() const { return options_; }
  const parallel::ParallelState& parallel() const { return parallel_; }
  std::vector<Param>& params() { return params_; }
  const std::vector<Group>& groups() const { return groups_; }
  std::vector<Group>& groups() { return groups_; }
  const std::vector<Bucket>& buckets() const { return buckets_; }
  const std::vector<Slot>& slots() const { return slots_; }
  // Elements after which a bucket is closed (0: one bucket per group).
  int64_t bucket_size() const { return bucket_size_; }

 private:
  void build(bool expert, const std::vector<int>& param_indices);
  void tp_sum(int param_index);
  void launch(int bucket_index);
  void allreduce_embedding_grads();
  void wait_bucket_gather(Bucket& bucket);
  void decode_param_gather(Bucket& bucket);  // a finished 16-bit all-gather into the parameter buffer
  void reset_round();

  std::vector<Param>& params_;
  parallel::ParallelState parallel_;
  DdpOptions options_;
  int64_t bucket_size_ = 0;  // 0: unlimited
  std::vector<Group> groups_;
  std::vector<Bucket> buckets_;
  std::vector<Slot> slots_;
  int min_module_ = 0;
  std::vector<std::vector<int>> module_buckets_;  // [module - min_module_] -> buckets holding its params
  std::vector<std::vector<int>> module_params_;   // [module - min_module_] -> its params
  std::vector<char> module_done_;                 // [module - min_module_]
  std::vector<char> tp_summed_;                   // [param]
  bool last_microbatch_ = true;
};

}  // namespace moecore
