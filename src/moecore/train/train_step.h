// One training iteration (Megatron's train_step): forward and backward over this rank's micro-batches of the global
// batch, gradient reduction, clipping, the AdamW step and the end-of-batch expert-bias update.
#pragma once

#include <optional>

#include "moecore/config/arguments.h"
#include "moecore/data/data_loader.h"
#include "moecore/model/gpt_model.h"
#include "moecore/ops/weight_casts.h"
#include "moecore/optim/ddp.h"
#include "moecore/optim/distributed_optimizer.h"
#include "moecore/optim/grad_scaler.h"
#include "moecore/optim/lr_schedule.h"
#include "moecore/parallel/parallel_state.h"
#include "moecore/train/hybrid_cp_groups.h"
#include "moecore/train/packed_samples.h"
#include "moecore/train/training_progress.h"

namespace moecore {

struct StepResult {
  double lm_loss = 0.0;    // token-weighted over the global batch (every micro-batch of every DP rank)
  double grad_norm = 0.0;  // before clipping
  MoEStats moe_stats;      // this rank's router statistics of the iteration (not yet reduced over ranks)
  // --mtp-num-layers: each depth's unscaled loss averaged over the global batch's micro-batches (Megatron's
  // MTPLossLoggingHelper: summed over micro-batches x 1 / num_microbatches, averaged over DP x CP); every rank.
  std::vector<double> mtp_losses;
  // With --reset-attention-mask: the documents of the global batch (every DP rank's micro-batches), which the
  // FLOPs count and the log's real-token count use, as Megatron does for packed (THD) batches.
  std::optional<SeqlenStats> seqlen_stats;
  // --sample-data-path: the step's bins over every rank (padding bins apart) and their padding tokens.
  struct Packing {
    int64_t bins = 0, padding_bins = 0, padding_tokens = 0;
  };
  std::optional<Packing> packing;
  // Loss scaling: the iteration's gradients were not finite, so it made no update (Megatron's skipped_iter).
  bool skipped = false;
  double loss_scale = 1.0;  // the scale after this iteration's update (the log's "loss scale")
  // Asked for by StepStatistics: the gradient's zero elements (not for a skipped iteration, as Megatron's None) and
  // the parameters' norm after the update.
  std::optional<int64_t> num_zeros_in_grad;
  std::optional<double> params_norm;
};

// The optional statistics of an iteration whose figures are logged (collectives: every rank asks alike).
struct StepStatistics {
  bool num_zeros_in_grad = false;  // --log-num-zeros-in-grad
  bool params_norm = false;        // --log-params-norm
};

struct TrainingModules {
  GPTModel& model;
  DistributedDataParallel& ddp;
  DistributedAdamW& optimizer;
  LRSchedule& schedule;
  const GPTDataProvider& data;
  LossScalers& loss_scalers;  // --fp16's dynamic scalers or a constant --loss-scale; empty: no loss scaling
  // The 16-bit weight casts carried from step to step (ops/weight_casts.h); null: each step casts its own.
  ops::WeightCastCarry* weight_casts = nullptr;
  // --moe-routing-replay-file: the recording the training forwards route by (null: the routers choose).
  const RoutingReplaySource* routing_replay = nullptr;
  // --sample-data-path: the whole samples each step packs into its micro-batches (null: the GPT dataset's samples).
  const PackedSamples* packed_samples = nullptr;
  // --hybrid-context-parallel: the blocks of data- and context-parallel ranks samples run on (null: the layout's CP).
  const HybridCpGroups* hybrid_cp = nullptr;
};

// Iteration progress.iteration + 1 on training samples [consumed_train_samples, + global batch): throws
// NonFiniteStep (train/nonfinite_diagnosis.h; on every rank together) when a norm of any rank overflowed in the
// forwards (model/norm_overflow.h), or the loss or the gradient norm is not finite; with loss scaling an iteration
// whose gradients are not finite is skipped instead (result.skipped). The update uses the scheduler's learning rate
// and weight decay; a successful update steps the scheduler by the global batch size (Megatron's train_step). Does
// not advance `progress`.
StepResult train_step(const TrainingArgs& args, const TrainingModules& modules, const parallel::ParallelState& parallel,
                      const TrainingProgress& progress, StepStatistics statistics = {});

}  // namespace moecore
