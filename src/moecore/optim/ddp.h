// Megatron-style data parallelism (DistributedDataParallel + the distributed optimizer's buffers): every Param's
// gradient (and, with the distributed optimizer, its value) becomes a view into one flat fp32 buffer per group
// (dense params reduced over dp-cp, routed-expert params over expert-DP). Each buffer is cut into buckets of
// whole params in backward order; a bucket is all-reduced (or reduce-scattered with the distributed optimizer) as
// one collective, optionally launched as soon as the backward of its last module is done.
//
// Quantized parameter all-gather (Megatron's --fp8-param-gather / --fp4-param-gather, distributed optimizer only):
// the weights the FP8 / FP4 GEMMs quantize (Param::weight_quantization) get groups of their own, dense and expert,
// reduced over the same process groups. This follows Megatron, which keys its buffers by (param dtype, grad dtype)
// and keeps FP8 params in a uint8 param buffer (megatron/core/distributed/param_and_grad_buffer.py,
// distributed_data_parallel.py): a bucket then holds one kind of parameter only, so its all-gather moves one element
// type (one byte per FP8 code, two E2M1 codes per byte) and never mixes codes with 16-bit values. After the
// optimizer step the parameter buffer's shard holds the updated main parameters rounded to the weights' dtype (TE
// casts the master weight to the model dtype first, transformer_engine/pytorch/tensor/utils.py
// quantize_master_weights); start_param_gather then quantizes each such bucket's shard (quant/
// sharded_weight_quantizer.h): block amaxes of the shard, MAX-reduced over the bucket's group (one small all-reduce
// per bucket, counted as parameter all-gather bytes), the scales every rank derives alike (delayed scaling: the
// weight's current scale, the amax recorded into its history), the shard's codes; it
// all-gathers the codes and decodes them into the parameter buffer. The model thus holds the decoded weights, which
// are exactly the whole weight's quantization whatever the shard cut; its GEMMs quantize them again, which
// reproduces them for power-of-2 scales (blockwise, MXFP8) and up to the fp32 rounding of the scale for tensorwise
// and NVFP4 (tests/unit/quant_sharded_weight_test.cpp). Differences from TE: the GEMM's column-wise (dgrad) copy of
// an MXFP8 weight is quantized from the decoded row-wise weight (TE casts both copies from the master weight), and
// Megatron's MXFP8 path all-gathers through the gradient buffer in high precision
// (--reuse-grad-buf-for-mxfp8-param-ag) where moecore gathers the row-wise codes.
#pragma once

#include <cstdint>
#include <span>
#include <vector>

#include "moecore/model/model_hooks.h"
#include "moecore/model/param.h"
#include "moecore/optim/fsdp.h"
#include "moecore/parallel/parallel_state.h"
#include "moecore/parallel/process_group.h"
#include "moecore/quant/sharded_weight_quantizer.h"

namespace moecore {

struct DdpOptions {
  // Elements per bucket (Megatron's --ddp-bucket-size). 0: Megatron's default, max(40M, 1M * dp size) with
  // overlap_grad_reduce and one bucket per group without it.
  int64_t bucket_size = 0;
  bool overlap_grad_reduce = false;
  bool use_distributed_optimizer = false;
  bool overlap_param_gather = false;  // with the distributed optimizer only
  // The gradient buffer's dtype (Megatron's grad_dtype: fp32 with accumulate_allreduce_grads_in_fp32, else the 16-bit
  // weights' dtype: --grad-reduce-in-bf16 or --main-grads-dtype bf16 under --bf16, and --fp16 without
  // --accumulate-allreduce-grads-in-fp32). 16-bit: the buffer holds 16-bit values in fp32 storage and follows
  // Megatron's order (param_and_grad_buffer.py): each micro-batch's weight gradients are added into it and the sum
  // rounded to 16 bits after the module's backward (the gradient-accumulation fusion's GEMM into main_grad), so the
  // accumulation over micro-batches is 16-bit (fp16 can overflow to Inf); start_grad_sync multiplies the bucket by
  // the 1/dp-cp gradient_scaling_factor in 16 bits; the all-reduce / reduce-scatter sums in 16 bits on the wire; the
  // TP and embedding-group sums too. The optimizer reads the result as fp32 values.
  DType grad_dtype = DType::kF32;
  // The dtype of the distributed optimizer's parameter all-gather: the model weights' dtype (16-bit weights travel in
  // 16 bits, exactly).
  DType param_gather_dtype = DType::kF32;
  // --fp8-param-gather / --fp4-param-gather: params with Param::weight_quantization get their own groups and are
  // all-gathered as codes (see above). Needs the distributed optimizer.
  bool quantized_param_gather = false;
  // Megatron-FSDP (optim/fsdp.h): one bucket per module and group kind, the units' parameters and gradients sharded
  // by the strategy. use_distributed_optimizer must be true except with no_shard; no quantized parameter all-gather.
  std::optional<FsdpOptions> fsdp;
  // Megatron's --calculate-per-token-loss: no 1 / dp-cp scaling before the reduction (DDP's gradient_scaling_factor
  // 1.0); the trainer divides by the global loss tokens afterwards (scale_gradients). Not with fsdp.
  bool per_token_loss = false;
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
    bool decode_gather = false;  // a 16-bit or coded parameter all-gather waits to be decoded into the parameter buffer
    // Quantized groups: the all-gather's codes (kU8; FP4 two per byte, the even element in the low nibble) of the
    // bucket [(end - begin) / elements_per_byte] and of this rank's shard, and each param's quantizer (with the
    // scales of the last gather), parallel to `params`.
    Tensor codes;
    Tensor code_shard;
    std::vector<quant::ShardedWeightQuantizer> quantizers;
    parallel::Work grad_work;
    parallel::Work param_work;
    bool grad_launched = false;
    bool param_in_flight = false;
    // Megatron-FSDP: a unit's bucket whose gradients / parameters are kept as this rank's shard only; the group's
    // buffers then hold [shard_size] elements for it at grad_store / param_store (else [end - begin]; without FSDP
    // grad_store = param_store = begin).
    bool unit = false;
    bool grads_sharded = false;
    bool params_sharded = false;
    int64_t grad_store = 0, param_store = 0;
    Tensor unit_params;  // the gathered whole parameters [end - begin] (kComm) between gather and free
    Tensor unit_grads;   // the unit's whole gradients [end - begin] (kComm) from before_backward to their reduction
    parallel::Work unit_gather;
    bool unit_gather_in_flight = false;
    bool unit_reduce_in_flight = false;
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
    bool quantized = false;  // the weights of quantized linear layers, all-gathered as codes
    parallel::ProcessGroup pg = parallel::ProcessGroup::self();  // the gradient-reduction group
    Tensor grad_buffer;                                          // [numel], kGrads
    Tensor param_buffer;                                         // [numel], kParams (distributed optimizer only)
    std::vector<int> buckets;
  };

  // Rebinds every Param::grad (and with the distributed optimizer Param::value) to views of the flat buffers,
  // copying the current contents. `params` must outlive this object and keep its size.
  DistributedDataParallel(ParamStore& params, const parallel::ParallelState& parallel, const DdpOptions& options);
  ~DistributedDataParallel() override;
  DistributedDataParallel(const DistributedDataParallel&) = delete;
  DistributedDataParallel& operator=(const DistributedDataParallel&) = delete;

  // Zeroes every gradient buffer and starts a new gradient-sync round. After grads_zeroed (an optimizer step that
  // left every Param::grad zero) it only starts the round: the buffers hold zeros but where no param lies, which
  // nothing writes.
  void zero_grad();
  void grads_zeroed() { grads_zeroed_ = !options_.fsdp; }
  // Reductions start only during the backward of the last micro-batch (default true).
  void set_last_microbatch(bool last) { last_microbatch_ = last; }
  // overlap_param_gather: waits for the all-gathers of the buckets holding module's params. FSDP optim_grads_params:
  // gathers the unit's parameters (waiting for a prefetch) and starts the next unit's gather.
  void before_forward(int module) override;
  // FSDP optim_grads_params: frees the unit's gathered parameters.
  void after_forward(int module) override;
  // FSDP optim_grads_params: gathers the unit's parameters (waiting for the prefetch of the unit after it) and starts
  // no prefetch: the next unit's backward is done. They stay gathered through the unit's backward (Megatron-FSDP
  // reshards post-backward under recompute).
  void before_recompute(int module) override;
  // FSDP: gathers the unit's parameters again (prefetching the previous unit's) with optim_grads_params; with sharded
  // gradients binds its params' gradients to a fresh zeroed whole buffer.
  void before_backward(int module) override;
  // A 16-bit grad_dtype: rounds module's gradients to it (every micro-batch; a module's gradients must be handed over
  // here before the next micro-batch adds to them). overlap_grad_reduce on the last
  // micro-batch: TP sums of module's grad_sum_over_tp params, then launches every bucket whose modules are all done.
  // FSDP with sharded gradients (every micro-batch): the unit's TP sums, the 1 / dp-cp scaling and the reduce-scatter
  // into this rank's gradient shard (completed during the next unit's backward); optim_grads_params frees the
  // parameters.
  void after_backward(int module) override;
  // Launches whatever has not been launched, waits for all. Afterwards every Param::grad holds the gradient summed
  // over the group and divided by the dp-cp size; with the distributed optimizer only this rank's shard of each
  // bucket does. Then the tied embedding's copies (Param::sum_over_embedding_group) are summed over the pipeline's
  // embedding group, as Megatron's finalize_model_grads.
  void finish_grad_sync();
  // Every gradient this rank holds times `factor` (Megatron's scale_gradients in finalize_model_grads), in the
  // gradient buffers' dtype. After finish_grad_sync; not under Megatron-FSDP.
  void scale_gradients(double factor);
  // Distributed optimizer: all-gathers every bucket's updated shard (asynchronously with overlap_param_gather).
  void start_param_gather();
  // Finishes any in-flight all-gather (before evaluation / export / the next step).
  void wait_param_gather();
  // Quantized groups: the all-gather of the quantized buckets only, synchronously (after the optimizer rewrote the
  // parameter buffer's shards from loaded main parameters).
  void gather_quantized_params();
  // Quantized groups: every quantized weight, replicated whole on every rank (the initial or loaded model), replaced
  // by its decoded quantization, computed locally (the same values a gather of its shards gives). Megatron creates
  // such weights quantized (fp8_model_init) and the main parameters from their high-precision values.
  void quantize_replicated_weights();
  bool has_quantized_groups() const;

  // A bucket's elements [lo, hi) (buffer coordinates, inside what the bucket stores: its shard when sharded) of the
  // group's gradient / parameter storage, as a view.
  Tensor grad_view(int bucket, int64_t lo, int64_t hi) const;
  Tensor param_view(int bucket, int64_t lo, int64_t hi) const;
  // Rounds every parameter value this rank stores (whole params and FSDP parameter shards) to `dtype`.
  void round_params_(DType dtype);
  // FSDP optim_grads_params: true while some unit's parameters are held as shards only (Param::value undefined).
  bool shards_params() const;
  // FSDP: gathers every sharded unit's parameters into Param::value (FsdpUnshardedScope); reshard_all frees them,
  // first taking this rank's shard from the whole values with write_back.
  void unshard_all();
  void reshard_all(bool write_back);
  const DdpOptions& options() const { return options_; }
  const parallel::ParallelState& parallel() const { return parallel_; }
  ParamStore& params() { return params_; }
  const std::vector<Group>& groups() const { return groups_; }
  std::vector<Group>& groups() { return groups_; }
  const std::vector<Bucket>& buckets() const { return buckets_; }
  const std::vector<Slot>& slots() const { return slots_; }
  // Elements after which a bucket is closed (0: one bucket per group).
  int64_t bucket_size() const { return bucket_size_; }

 private:
  void build(bool expert, bool quantized, const std::vector<int>& param_indices);
  void start_bucket_gather(int bucket_index);
  void quantize_shard(Bucket& bucket);  // the amax all-reduce and this rank's codes into bucket.code_shard
  void decode_codes(Bucket& bucket);
  void tp_sum(int param_index);
  void launch(int bucket_index);
  void all_reduce_grads(const parallel::ProcessGroup& pg, Tensor& grads);  // in grad_dtype
  void allreduce_embedding_grads();
  void wait_bucket_gather(Bucket& bucket);
  void decode_param_gather(Bucket& bucket);  // a finished 16-bit all-gather into the parameter buffer
  void reset_round();
  // FSDP (optim/fsdp.cpp).
  bool fsdp_zero3() const;
  bool fsdp_sharded_grads() const;
  const std::vector<int>& buckets_of(int module) const;
  void start_unit_gather(int module);
  void bind_unit_params(int module);  // waits for the unit's gathers, then Param::value views of them
  void free_unit_params(int module);
  void free_bucket_params(Bucket& bucket);
  void bind_unit_grads(int module);
  void reduce_unit_grads(int module);
  void complete_unit_reduces();  // waits for the reduce-scatters in flight, adds them into the gradient shards
  void bind_param_value(int param_index, const Tensor& whole);
  static constexpr int kNoModule = -1000000;
  int unit_in_backward_ = kNoModule;          // the module between before_backward and after_backward
  std::vector<std::vector<int64_t>> shapes_;  // [param] -> its local shape (values and gradients may be unbound)

  ParamStore& params_;
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
  bool grads_zeroed_ = false;                     // see grads_zeroed
  std::vector<char> tp_summed_;                   // [param]
  bool last_microbatch_ = true;
};

}  // namespace moecore
