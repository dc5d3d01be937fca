#include "moecore/model/vocab_parallel.h"

#include <stdexcept>
#include <string>

#include "moecore/model/config.h"
#include "moecore/ops/loss.h"
#include "moecore/ops/precision.h"

namespace moecore {

VocabParallelEmbedding::VocabParallelEmbedding(const std::string& name, const int64_t V, const int64_t H,
                                               const TensorParallel& tp, ParamStore& params)
    : tp_(tp), V_(V), H_(H) {
  if (V % tp.size() != 0) {
    throw ConfigError("the padded vocabulary (" + std::to_string(V) +
                      ") must be divisible by --tensor-model-parallel-size (" + std::to_string(tp.size()) + ")");
  }
  vocab_begin_ = tp.rank() * (V / tp.size());
  const ParamShard shard{0, 1, tp.size(), tp.rank(), {V, H}};
  weight_ = &params.push_back(make_sharded_param(name, shard, InitKind::kNormal));
}

Tensor VocabParallelEmbedding::forward(const std::span<const int32_t> ids_T) const {
  const auto T = static_cast<int64_t>(ids_T.size());
  Tensor partial_TH = ops::activation_tensor({T, H_});
  ops::embedding_forward(partial_TH, ids_T, weight_->value, V_, vocab_begin_);
  if (tp_.sequence_sharded()) return tp_.reduce_scatter_rows(partial_TH);
  tp_.all_reduce_activations_(partial_TH);
  return partial_TH;
}

void VocabParallelEmbedding::backward(const Tensor& dout_TH, const std::span<const int32_t> ids_T) const {
  // Backward of the reduce-scatter: every token's gradient; of the all-reduce: the (replicated) gradient itself.
  const Tensor dfull_TH = tp_.sequence_sharded() ? tp_.all_gather_rows(dout_TH) : dout_TH;
  ops::embedding_backward(weight_->grad, dfull_TH, ids_T, vocab_begin_);
}

void VocabParallelCrossEntropy::forward(Tensor& losses_T, Tensor& lse_T, const Tensor& logits_TVl,
                                        const std::span<const int32_t> targets_T) const {
  if (tp_.size() == 1) {
    ops::cross_entropy_forward(losses_T, lse_T, logits_TVl, targets_T);
    return;
  }
  const auto T = static_cast<int64_t>(targets_T.size());
  Tensor max_T = Tensor({T}, DType::kF32, MemCategory::kActivations);
  ops::vocab_ce_local_max(max_T, logits_TVl);
  tp_.all_reduce_(max_T, parallel::ReduceOp::kMax);
  Tensor stats_2T = Tensor({2 * T}, DType::kF32, MemCategory::kActivations);
  ops::vocab_ce_local_stats(stats_2T, logits_TVl, max_T, targets_T, V_, vocab_begin_);
  tp_.all_reduce_(stats_2T);
  ops::vocab_ce_finish(losses_T, lse_T, max_T, stats_2T);
}

void VocabParallelCrossEntropy::backward(Tensor& dlogits_TVl, const Tensor& dlosses_T, const Tensor& logits_TVl,
                                         const Tensor& lse_T, const std::span<const int32_t> targets_T) const {
  if (tp_.size() == 1) {
    ops::cross_entropy_backward(dlogits_TVl, dlosses_T, logits_TVl, lse_T, targets_T);
    return;
  }
  ops::vocab_ce_backward(dlogits_TVl, dlosses_T, logits_TVl, lse_T, targets_T, vocab_begin_);
}

ops::VocabShard VocabParallelCrossEntropy::shard() const {
  ops::VocabShard shard{V_, vocab_begin_, {}, {}};
  if (tp_.size() == 1) return shard;
  const TensorParallel tp = tp_;
  shard.reduce_max = [tp](Tensor& max_n) { tp.all_reduce_(max_n, parallel::ReduceOp::kMax); };
  shard.reduce_sum = [tp](Tensor& stats_2n) { tp.all_reduce_(stats_2n); };
  return shard;
}

int64_t fused_logits_chunk_rows(const int64_t T, const Tensor& weight_VH, const ops::VocabShard& shard) {
  constexpr int64_t kF32ChunkBytes = int64_t{64} << 20;
  const auto activation_bytes = static_cast<int64_t>(dtype_size(ops::activation_dtype()));
  return ops::linear_cross_entropy_chunk_rows(
      T, weight_VH.dim(0), kF32ChunkBytes * activation_bytes / 4,
      ops::linear_cross_entropy_logit_bytes(weight_VH, shard.reduce_max != nullptr));
}

void check_fused_backward_seed(const double forward_seed, const double loss_scale) {
  if (loss_scale == forward_seed) return;
  throw std::logic_error("backward's loss scale " + std::to_string(loss_scale) + " differs from the backward seed " +
                         std::to_string(forward_seed) +
                         " its forward formed the fused output layer's gradients with (ForwardOptions::backward_seed)");
}

}  // namespace moecore
