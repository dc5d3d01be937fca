#include "moecore/train/train_step.h"

#include <cmath>
#include <memory>
#include <string>

#include "moecore/train/batch_schedule.h"
#include "moecore/train/trainer.h"
#include "moecore/util/trace.h"

namespace moecore {
namespace {

// Forward and backward of this rank's micro-batches; gradients are those of the mean of the micro-batch mean losses
// (Megatron without --calculate-per-token-loss), reduced over DP by the DDP.
double forward_backward(const TrainingArgs& args, const TrainingModules& modules,
                        const parallel::ParallelState& parallel, const TrainingProgress& progress) {
  const int64_t iteration = progress.iteration + 1;
  const int64_t num_microbatches = args.global_batch_size / args.micro_batch_size;  // all DP ranks
  const std::vector<int64_t> mine = local_microbatches(num_microbatches, parallel.dp_size(), parallel.dp_rank());
  modules.ddp.zero_grad();
  TokenWeightedLoss loss;
  for (size_t m = 0; m < mine.size(); ++m) {
    const int64_t g = mine[m];
    const Batch batch = modules.data.get_batch(
        DatasetSplit::kTrain, progress.consumed_train_samples + g * args.micro_batch_size, args.micro_batch_size);
    ForwardOptions options;
    options.training = true;
    options.dropout_seed = static_cast<uint64_t>(args.seed);
    options.dropout_stream = static_cast<uint64_t>(iteration * num_microbatches + g);
    std::unique_ptr<MicroBatchContext> ctx;
    double mean_loss = 0.0;
    {
      const trace::Scope scope("forward (micro-batch ", static_cast<int64_t>(m), ")", "step");
      mean_loss = modules.model.forward(ctx, batch.tokens_BS.data(), batch.labels_BS.data(), batch.loss_mask_BS.data(),
                                        batch.B, batch.S, options);
    }
    modules.ddp.set_last_microbatch(m + 1 == mine.size());
    {
      const trace::Scope scope("backward (micro-batch ", static_cast<int64_t>(m), ")", "step");
      modules.model.backward(std::move(ctx), 1.0 / static_cast<double>(mine.size()));
    }
    loss.add(mean_loss, loss_tokens(batch));
  }
  {
    const trace::Scope scope("finish grad sync", "step");
    modules.ddp.finish_grad_sync();
  }
  return reduce_over_dp_cp(loss, parallel);
}

}  // namespace

StepResult train_step(const TrainingArgs& args, const TrainingModules& modules, const parallel::ParallelState& parallel,
                      const TrainingProgress& progress) {
  const int64_t iteration = progress.iteration + 1;
  StepResult result;
  result.lm_loss = forward_backward(args, modules, parallel, progress);
  if (!std::isfinite(result.lm_loss)) {  // after the reduction, so every rank stops together
    throw TrainingError("lm loss is " + std::string(std::isnan(result.lm_loss) ? "NaN" : "Inf") + " at iteration " +
                        std::to_string(iteration) + ": stopping; try a lower --lr or a smaller --init-method-std");
  }
  {
    const trace::Scope scope("clip grad norm", "optimizer");
    result.grad_norm = modules.optimizer.clip_grad_norm(args.clip_grad);
  }
  if (!std::isfinite(result.grad_norm)) {
    throw TrainingError("grad norm is not finite at iteration " + std::to_string(iteration) + ": stopping");
  }
  {
    const trace::Scope scope("optimizer step", "optimizer");
    modules.optimizer.step(modules.schedule.lr_at(iteration - 1));
  }
  modules.model.finish_global_batch();
  result.moe_stats = modules.model.take_moe_stats();
  return result;
}

}  // namespace moecore
