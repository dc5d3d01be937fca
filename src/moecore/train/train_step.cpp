#include "moecore/train/train_step.h"

#include <algorithm>
#include <array>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <optional>
#include <span>
#include <string>
#include <utility>
#include <vector>

#include "moecore/data/hybrid_cp_schedule.h"
#include "moecore/ops/device.h"
#include "moecore/ops/weight_casts.h"
#include "moecore/parallel/comm_stats.h"
#include "moecore/pipeline/pipeline_schedule.h"
#include "moecore/train/batch_schedule.h"
#include "moecore/train/nonfinite_diagnosis.h"
#include "moecore/train/norm_overflow_check.h"
#include "moecore/train/pipeline_executor.h"
#include "moecore/train/trainer.h"
#include "moecore/util/trace.h"

namespace moecore {
namespace {

// Megatron's hybrid_context_parallel_forward_backward: the step's whole samples scheduled over the N data- and
// context-parallel ranks by BalancedCPScheduler (data/hybrid_cp_schedule.h), round by round; each rank runs the
// samples of its group, each as a micro-batch of its own padded to a multiple of 2 x the group size, with the group as
// its context-parallel group. Gradients: per-token, summed over every rank by the caller's finish_grad_sync.
double hybrid_cp_forward_backward(const TrainingArgs& args, const TrainingModules& modules,
                                  const parallel::ParallelState& parallel, const TrainingProgress& progress,
                                  std::optional<SeqlenStats>& global_stats) {
  const int64_t iteration = progress.iteration + 1;
  const PackedSamples& samples = *modules.packed_samples;
  const std::vector<int64_t> indices = samples.step_samples(progress.consumed_train_samples, args.global_batch_size);
  std::vector<CpSample> lengths;
  SeqlenStats stats;
  for (size_t k = 0; k < indices.size(); ++k) {
    const int64_t length = samples.sample_length(indices[k]);
    lengths.push_back(CpSample{static_cast<int64_t>(k), length});
    stats.tokens += length;
    stats.squared_sum += length * length;
  }
  global_stats = stats;
  const int rank = parallel.dp_cp.rank();
  const std::vector<HybridCpRound> rounds =
      schedule_hybrid_cp(lengths, parallel.dp_cp.size(), args.max_seqlen_per_dp_cp_rank);
  const double grad_scale = modules.loss_scalers.backward_scale();
  modules.ddp.zero_grad();
  TokenWeightedLoss total;
  const PipelineSchedule schedule = make_schedule(1, 0, 1, 1, 0, false, false);
  for (const HybridCpRound& round : rounds) {
    for (const int64_t k : round.sample_ids_per_rank[static_cast<size_t>(rank)]) {
      const auto placement = std::find_if(round.placements.begin(), round.placements.end(),
                                          [&](const CpPlacement& p) { return p.sample_id == k; });
      const parallel::ProcessGroup& group = modules.hybrid_cp->group(placement->first_rank, placement->cp_size);
      const int64_t align = placement->cp_size > 1 ? 2 * placement->cp_size : 1;
      const int64_t length = (placement->length + align - 1) / align * align;
      const Batch batch = samples.sample_batch(indices[static_cast<size_t>(k)], length);
      PipelineMicrobatches one;
      one.B = 1;
      one.S = length;
      one.batch = [&](int) { return batch; };
      one.options = [&](int) {
        ForwardOptions options;
        options.backward_seed = grad_scale;
        options.per_token_loss = true;
        options.training = true;
        options.dropout_seed = static_cast<uint64_t>(args.seed);
        options.dropout_stream = static_cast<uint64_t>(iteration * args.global_batch_size + k);
        options.context_parallel = &group;
        return options;
      };
      one.loss_scale = [grad_scale](int) { return grad_scale; };
      one.overlap_p2p_comm = false;
      one.position_ids = one.document_ids = true;
      const ops::ScopedWeightCasts weight_casts(modules.weight_casts);
      const TokenWeightedLoss loss = run_pipeline_schedule(schedule, modules.model, &modules.ddp, parallel, one);
      total.loss_sum += loss.loss_sum;
      total.tokens += loss.tokens;
    }
  }
  ops::synchronize(Device::kCPU);
  {
    const trace::Scope scope("finish grad sync", "step");
    modules.ddp.finish_grad_sync();
  }
  const parallel::CommTimer timer(parallel::CommKind::kOther);
  const double global_tokens = parallel::sum_double(parallel.dp_cp, total.tokens);
  modules.ddp.scale_gradients(1.0 / std::max(global_tokens, 1.0));
  return reduce_pipeline_loss(total, parallel);
}

// Router replay: every rank looks up the whole global batch, so a sample without a record stops all ranks alike; then
// each of this rank's micro-batches (`mine`, of `num_microbatches` over every rank) gets its table.
std::vector<RoutingReplayBatch> routing_replay_tables(const TrainingArgs& args, const TrainingModules& modules,
                                                      const TrainingProgress& progress,
                                                      const std::optional<PackedStep>& packed,
                                                      const std::vector<int64_t>& mine,
                                                      const int64_t num_microbatches) {
  std::vector<RoutingReplayBatch> tables;
  const RoutingReplaySource& replay = *modules.routing_replay;
  if (packed) {
    if (const std::string problem = modules.packed_samples->replay_missing(*packed, replay); !problem.empty()) {
      throw ConfigError(problem);
    }
    for (int64_t m = 0; m < static_cast<int64_t>(mine.size()); ++m) {
      tables.push_back(modules.packed_samples->replay_batch(*packed, m, replay));
    }
    return tables;
  }
  const int64_t mbs = args.micro_batch_size;
  std::string missing;
  for (int64_t m = 0; m < num_microbatches && missing.empty(); ++m) {
    const int64_t first = progress.consumed_train_samples + m * mbs;
    missing = replay.missing(modules.data.get_batch(DatasetSplit::kTrain, first, mbs).tokens_BS, mbs, first);
  }
  if (!missing.empty()) throw ConfigError(missing);
  for (const int64_t m : mine) {
    const int64_t first = progress.consumed_train_samples + m * mbs;
    tables.push_back(replay.batch(modules.data.get_batch(DatasetSplit::kTrain, first, mbs).tokens_BS, mbs, first));
  }
  return tables;
}

// Forward and backward of this rank's micro-batches through its pipeline schedule (PP 1: one micro-batch after the
// other); gradients are those of the mean of the micro-batch mean losses (Megatron without
// --calculate-per-token-loss), reduced over DP by the DDP.
double forward_backward(const TrainingArgs& args, const TrainingModules& modules,
                        const parallel::ParallelState& parallel, const TrainingProgress& progress,
                        std::optional<SeqlenStats>& global_stats, std::optional<StepResult::Packing>& packing) {
  const int64_t iteration = progress.iteration + 1;
  // Whole samples: the step's bins decide the micro-batches (each rank as many, padding bins included).
  std::optional<PackedStep> packed;
  if (modules.packed_samples != nullptr) {
    packed = modules.packed_samples->step(progress.consumed_train_samples, args.global_batch_size, parallel.dp_size(),
                                          parallel.dp_rank());
    packing =
        StepResult::Packing{static_cast<int64_t>(packed->bins.size()), packed->padding_bins, packed->padding_tokens};
    global_stats = SeqlenStats{packed->real_tokens, packed->squared_lengths};
  }
  const int64_t num_microbatches =  // all DP ranks
      packed ? packed->bins_per_rank * parallel.dp_size() : args.global_batch_size / args.micro_batch_size;
  const std::vector<int64_t> mine = local_microbatches(num_microbatches, parallel.dp_size(), parallel.dp_rank());
  const PipelineSchedule schedule =
      make_schedule(parallel.pp_size(), parallel.pp_rank(), modules.model.num_chunks(), static_cast<int>(mine.size()),
                    static_cast<int>(args.microbatch_group_size_per_vp_stage), false, args.model.moe.overlap_ep_comm);
  PipelineMicrobatches microbatches;
  microbatches.B = args.micro_batch_size;
  microbatches.S = args.model.seq_length;
  // A stage may read a micro-batch more than once (forward and backward); its documents count once.
  std::vector<char> counted(mine.size(), 0);
  SeqlenStats local_stats;
  microbatches.batch = [&](const int m) {
    if (packed) return modules.packed_samples->batch(*packed, m);
    Batch batch = modules.data.get_batch(
        DatasetSplit::kTrain, progress.consumed_train_samples + mine[static_cast<size_t>(m)] * args.micro_batch_size,
        args.micro_batch_size);
    if (args.reset_attention_mask && counted[static_cast<size_t>(m)] == 0) {
      counted[static_cast<size_t>(m)] = 1;
      local_stats += moecore::seqlen_stats(batch.document_ids_BS, batch.B, batch.S);
    }
    return batch;
  };
  // The backward seed of each micro-batch's mean loss (Megatron's schedules.py: loss / num_microbatches, times the
  // loss scale in backward_step via optimizer.scale_loss).
  const double grad_scale = modules.loss_scalers.backward_scale();
  // --calculate-per-token-loss: no division by the micro-batches (the gradients are divided by the global tokens
  // after the reduction, below).
  const bool per_token = args.calculate_per_token_loss;
  const double loss_scale = per_token ? grad_scale : grad_scale / static_cast<double>(mine.size());
  const std::vector<RoutingReplayBatch> replay_tables =
      modules.routing_replay != nullptr ? routing_replay_tables(args, modules, progress, packed, mine, num_microbatches)
                                        : std::vector<RoutingReplayBatch>{};
  microbatches.options = [&](const int m) {
    ForwardOptions options;
    if (!replay_tables.empty()) options.routing_replay = &replay_tables[static_cast<size_t>(m)];
    options.backward_seed = loss_scale;
    options.per_token_loss = per_token;
    options.training = true;
    options.dropout_seed = static_cast<uint64_t>(args.seed);
    options.dropout_stream = static_cast<uint64_t>(iteration * num_microbatches + mine[static_cast<size_t>(m)]);
    return options;
  };
  microbatches.loss_scale = [loss_scale](int) { return loss_scale; };
  // Megatron turns overlap_p2p_comm off without virtual stages (arguments.py validate_args).
  microbatches.overlap_p2p_comm = args.pipeline_split.overlap_p2p_comm && modules.model.num_chunks() > 1;
  microbatches.position_ids = args.reset_position_ids || packed.has_value();
  microbatches.document_ids = args.reset_attention_mask || packed.has_value();
  modules.ddp.zero_grad();
  // No weight changes until the optimizer step: the native 16-bit GEMMs cast each weight once for all micro-batches
  // (or not at all, given the casts the last step's optimizer refreshed).
  const TokenWeightedLoss loss = [&] {
    const ops::ScopedWeightCasts weight_casts(modules.weight_casts);
    return run_pipeline_schedule(schedule, modules.model, &modules.ddp, parallel, microbatches);
  }();
  // The step's kernels are done before the collectives read the gradients on the host (the model's device is the
  // CPU, where this returns at once).
  ops::synchronize(Device::kCPU);
  {
    const trace::Scope scope("finish grad sync", "step");
    modules.ddp.finish_grad_sync();
  }
  if (per_token) {
    // Megatron's finalize_model_grads: the loss tokens of the last stage's micro-batches, broadcast over the
    // pipeline and summed over dp-cp, divide every gradient (at least 1).
    const parallel::CommTimer timer(parallel::CommKind::kOther);
    double tokens = loss.tokens;
    if (parallel.pp_size() > 1) {  // the double's bits, as reduce_pipeline_loss broadcasts the loss
      std::array<float, 2> bits{};
      std::memcpy(bits.data(), &tokens, sizeof tokens);
      parallel.pp.broadcast(std::span<float>(bits), parallel.pp_size() - 1);
      std::memcpy(&tokens, bits.data(), sizeof tokens);
    }
    const double global_tokens = parallel::sum_double(parallel.dp_cp, tokens);
    modules.ddp.scale_gradients(1.0 / std::max(global_tokens, 1.0));
  }
  if (args.reset_attention_mask) {
    // Every model-parallel rank of a replica read the same samples: summing over DP covers the global batch once.
    const parallel::CommTimer timer(parallel::CommKind::kOther);
    std::array<int64_t, 2> sums = {local_stats.tokens, local_stats.squared_sum};
    parallel.dp.all_reduce(std::span<int64_t>(sums), parallel::ReduceOp::kSum);
    global_stats = SeqlenStats{sums[0], sums[1]};
  }
  return reduce_pipeline_loss(loss, parallel);
}

// Fault injection for the overflow tests: MOECORE_INJECT_GRAD_OVERFLOW_AT=<iteration> puts +Inf into a gradient
// of that iteration after the reduction, as an fp16 overflow would.
int64_t injected_overflow_iteration() {
  static const int64_t at = [] {
    const char* text = std::getenv("MOECORE_INJECT_GRAD_OVERFLOW_AT");
    if (text == nullptr) return int64_t{-1};
    char* end = nullptr;
    const long long value = std::strtoll(text, &end, 10);
    if (end == text || *end != '\0' || value < 1) {
      throw ConfigError(std::string("MOECORE_INJECT_GRAD_OVERFLOW_AT must be an iteration number, got '") + text + "'");
    }
    return static_cast<int64_t>(value);
  }();
  return at;
}

// The depths' losses as Megatron logs them: the loss stage's ranks hold their micro-batches' sums (every TP rank the
// same), the others nothing; the sum over the world divided by the forwards summed alike is the mean over every
// micro-batch.
std::vector<double> reduce_mtp_losses(const MtpStats& stats, const int64_t depths,
                                      const parallel::ParallelState& parallel) {
  std::vector<double> losses;
  if (depths == 0) return losses;
  const parallel::CommTimer timer(parallel::CommKind::kOther);
  const double forwards = parallel::sum_double(parallel.world, static_cast<double>(stats.num_forwards));
  for (size_t k = 0; k < static_cast<size_t>(depths); ++k) {
    const double local = k < stats.loss_sums.size() ? stats.loss_sums[k] : 0.0;
    losses.push_back(parallel::sum_double(parallel.world, local) / std::max(forwards, 1.0));
  }
  return losses;
}

}  // namespace

StepResult train_step(const TrainingArgs& args, const TrainingModules& modules, const parallel::ParallelState& parallel,
                      const TrainingProgress& progress, const StepStatistics statistics) {
  const int64_t iteration = progress.iteration + 1;
  StepResult result;
  result.lm_loss = modules.hybrid_cp != nullptr
                       ? hybrid_cp_forward_backward(args, modules, parallel, progress, result.seqlen_stats)
                       : forward_backward(args, modules, parallel, progress, result.seqlen_stats, result.packing);
  // With dynamic loss scaling a non-finite loss is the scaler's signal, not an error (Megatron turns
  // check_for_nan_in_loss_and_grad off): its gradients are not finite either, so the iteration is skipped.
  LossScalers& scalers = modules.loss_scalers;
  const bool dynamic_scaling = scalers.dynamic();
  // The lr this iteration's update uses (for the message when it stops).
  const double learning_rate = modules.schedule.lr();
  // A norm that overflowed output zeros: the loss is finite but meaningless (agreed over every rank).
  if (std::optional<NormOverflow> overflow = agree_on_norm_overflow(modules.model, parallel.world)) {
    throw NonFiniteStep(
        NonFiniteStepFacts{iteration, result.lm_loss, std::nullopt, learning_rate, std::move(overflow)});
  }
  if (!std::isfinite(result.lm_loss) && !dynamic_scaling) {  // after the reduction, so every rank stops together
    throw NonFiniteStep(NonFiniteStepFacts{iteration, result.lm_loss, std::nullopt, learning_rate});
  }
  if (iteration == injected_overflow_iteration()) modules.optimizer.inject_nonfinite_grad();
  if (scalers.enabled()) {
    const trace::Scope scope("unscale grads", "optimizer");
    const GradScaler& expert = scalers.expert ? *scalers.expert : *scalers.dense;
    const DistributedAdamW::NonFiniteGrads found =
        modules.optimizer.unscale_grads_and_check_for_nan(scalers.dense->inv_scale(), expert.inv_scale());
    scalers.dense->update(found.dense);
    if (scalers.expert) scalers.expert->update(found.expert);
    result.loss_scale = scalers.dense->scale();
    // Only the dynamic scaler skips an overflowing iteration; under a constant --loss-scale Megatron keeps
    // check_for_nan_in_loss_and_grad, so non-finite gradients stop the run (at the grad norm below).
    result.skipped = (found.dense || found.expert) && scalers.dynamic();
  }
  // A skipped iteration (Megatron's optimizer.step returns update_successful = False) makes no clipping and no
  // update, and the scheduler stays; the expert-bias update belongs to the gradient finalization
  // (finalize_model_grads), which ran.
  if (!result.skipped) {
    {
      const trace::Scope scope("clip grad norm", "optimizer");
      result.grad_norm = modules.optimizer.grad_norm();
    }
    if (!std::isfinite(result.grad_norm)) {  // reduced over every rank
      throw NonFiniteStep(NonFiniteStepFacts{iteration, result.lm_loss, result.grad_norm, learning_rate});
    }
    // Before the update, which consumes the gradients; clipping (applied as the update reads them) keeps every zero.
    if (statistics.num_zeros_in_grad) result.num_zeros_in_grad = modules.optimizer.count_zero_grads();
    const trace::Scope scope("optimizer step", "optimizer");
    modules.optimizer.set_weight_decay(modules.schedule.weight_decay());
    // Megatron's clip_grad_by_total_norm_fp32 scales the gradients before the update; the update applies the
    // coefficient as it reads them (the same values, one pass over the gradients less).
    // The update zeroes the gradients as it reads them (replicated AdamW), sparing the next step's zero_grad a pass.
    modules.optimizer.step(learning_rate, clip_coefficient(args.clip_grad, result.grad_norm).value_or(1.0f),
                           /*consume_grads=*/true, modules.weight_casts);
    modules.schedule.step(args.global_batch_size);
  }
  if (modules.weight_casts != nullptr) modules.weight_casts->drop_stale();
  // Megatron computes calc_params_l2_norm after train_step, skipped iterations included.
  if (statistics.params_norm) result.params_norm = modules.optimizer.params_norm();
  modules.model.finish_global_batch();
  result.moe_stats = modules.model.take_moe_stats();
  result.mtp_losses = reduce_mtp_losses(modules.model.take_mtp_stats(), args.model.mtp_num_layers, parallel);
  // The micro-batches this rank ran (a stage without MoE layers counts them too, so the statistics reduced over the
  // pipeline divide by the same number everywhere).
  if (args.model.moe.enabled()) {
    result.moe_stats.num_forwards = static_cast<int64_t>(
        local_microbatches(args.global_batch_size / args.micro_batch_size, parallel.dp_size(), parallel.dp_rank())
            .size());
  }
  return result;
}

}  // namespace moecore
