// Megatron's vocabulary-parallel pieces (megatron/core/tensor_parallel/layers.py VocabParallelEmbedding,
// cross_entropy.py vocab_parallel_cross_entropy): TP rank r holds vocabulary rows [vocab_begin, vocab_begin +
// V/TP) of the embedding and of the output layer, and the full logits [T, V] are never gathered.
#pragma once

#include <cstdint>
#include <span>
#include <string>
#include <vector>

#include "moecore/model/param.h"
#include "moecore/model/tensor_parallel.h"
#include "moecore/ops/linear_cross_entropy.h"
#include "moecore/tensor/tensor.h"

namespace moecore {

class VocabParallelEmbedding {
 public:
  VocabParallelEmbedding() = default;
  // Registers `name` [V/TP, H] (this rank's rows of [V, H]).
  VocabParallelEmbedding(const std::string& name, int64_t V, int64_t H, const TensorParallel& tp, ParamStore& params);

  // ids_T (all T tokens of the micro-batch) -> out_TH: this rank's rows (sequence shard under sequence parallelism),
  // the embedding rows summed over TP. Ids outside [0, V) anywhere throw std::out_of_range.
  Tensor forward(std::span<const int32_t> ids_T) const;
  // The weight gradient from dout_TH (this rank's rows).
  void backward(const Tensor& dout_TH, std::span<const int32_t> ids_T) const;

  int64_t vocab_begin() const { return vocab_begin_; }
  Param& weight() const { return *weight_; }

 private:
  TensorParallel tp_;
  int64_t V_ = 0, H_ = 0, vocab_begin_ = 0;
  Param* weight_ = nullptr;
};

// Softmax cross-entropy over the vocabulary split over TP: logits_TVl holds this rank's columns starting at
// vocab_begin. Collective over TP (two all-reduces forward, none backward).
class VocabParallelCrossEntropy {
 public:
  VocabParallelCrossEntropy() = default;
  VocabParallelCrossEntropy(const TensorParallel& tp, int64_t V, int64_t vocab_begin)
      : tp_(tp), V_(V), vocab_begin_(vocab_begin) {}

  // losses_T = logsumexp over the whole vocabulary - logit of the target (overwrite); lse_T keeps the global
  // log-sum-exp for backward.
  void forward(Tensor& losses_T, Tensor& lse_T, const Tensor& logits_TVl, std::span<const int32_t> targets_T) const;
  // OVERWRITES dlogits_TVl = dlosses_T * (softmax - onehot(target)) on this rank's columns; may be logits_TVl.
  void backward(Tensor& dlogits_TVl, const Tensor& dlosses_T, const Tensor& logits_TVl, const Tensor& lse_T,
                std::span<const int32_t> targets_T) const;
  // This rank's columns and the group's reductions, for ops::linear_cross_entropy (no reductions on one rank).
  ops::VocabShard shard() const;

 private:
  TensorParallel tp_;
  int64_t V_ = 0, vocab_begin_ = 0;
};

// Rows per logits chunk of the fused output layer + loss (ops::linear_cross_entropy) over T tokens and the weight's
// V_local vocabulary rows. The chunk is a workspace of 64 MiB under fp32 activations, big enough that its GEMMs
// (M = rows, and K = rows for the weight gradient) run near the machine's GEMM rate (bench/bench_output_layer.cpp).
// Under --bf16 / --fp16 the budget is 32 MiB, what the fp32 chunk's 16 Mi logits take in 16 bits: the workspace
// halves with the activation dtype as every activation does, by holding 16-bit logits (the native 16-bit GEMMs
// without a vocabulary split: the same rows) or half the rows of fp32 ones.
int64_t fused_logits_chunk_rows(int64_t T, const Tensor& weight_VH, const ops::VocabShard& shard);

// The fused output layer forms its gradients during the forward, scaled by the forward's backward seed, and adds the
// weight gradient to the main gradient there: std::logic_error unless the backward's loss scale is that seed.
void check_fused_backward_seed(double forward_seed, double loss_scale);

}  // namespace moecore
