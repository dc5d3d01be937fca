#include "moecore/train/tensorboard_log.h"

#include <unistd.h>

#include <cmath>
#include <fstream>
#include <string>

#include "moecore/tensor/memory_tracker.h"

namespace moecore {
namespace {

// The process's resident set (/proc/self/statm's second field, in pages): the CPU's counterpart of the bytes the
// CUDA caching allocator holds (Megatron's mem-reserved-bytes). nullopt where /proc is not there.
std::optional<double> resident_bytes() {
  std::ifstream statm("/proc/self/statm");
  int64_t size_pages = 0, resident_pages = 0;
  if (!(statm >> size_pages >> resident_pages)) return std::nullopt;
  return static_cast<double>(resident_pages) * static_cast<double>(sysconf(_SC_PAGESIZE));
}

}  // namespace

TensorBoardLog::TensorBoardLog(const TrainingArgs& args, const parallel::ParallelState& parallel)
    : args_(args), world_size_(parallel.world.size()) {
  if (args.tensorboard_dir.empty() || parallel.rank != parallel.world.size() - 1) return;
  writer_ = std::make_unique<TensorBoardWriter>(args.tensorboard_dir, args.tensorboard_queue_size);
}

void TensorBoardLog::scalar_with_samples(const std::string& tag, const double value, const int64_t iteration,
                                         const int64_t consumed_samples) {
  writer_->add_scalar(tag, value, iteration);
  writer_->add_scalar(tag + " vs samples", value, consumed_samples);
}

void TensorBoardLog::iteration(const TensorBoardIteration& step) {
  if (!writer_) return;
  const int64_t it = step.iteration, samples = step.consumed_samples;
  if (it % args_.tensorboard_log_interval == 0) {
    scalar_with_samples("learning-rate", step.learning_rate, it, samples);
    scalar_with_samples("batch-size", static_cast<double>(args_.global_batch_size), it, samples);
    if (!step.skipped) scalar_with_samples("lm loss", step.lm_loss, it, samples);
    if (args_.log_loss_scale_to_tensorboard) scalar_with_samples("loss-scale", step.loss_scale, it, samples);
    if (args_.log_world_size_to_tensorboard) {
      scalar_with_samples("world-size", static_cast<double>(world_size_), it, samples);
    }
    if (!step.skipped) scalar_with_samples("grad-norm", step.grad_norm, it, samples);
    if (step.num_zeros_in_grad) {
      scalar_with_samples("num-zeros", static_cast<double>(*step.num_zeros_in_grad), it, samples);
    }
    if (step.params_norm) scalar_with_samples("params-norm", *step.params_norm, it, samples);
    if (args_.log_memory_to_tensorboard) {
      const MemoryTracker& memory = MemoryTracker::instance();
      if (const std::optional<double> resident = resident_bytes())
        writer_->add_scalar("mem-reserved-bytes", *resident, it);
      writer_->add_scalar("mem-allocated-bytes", static_cast<double>(memory.current_total()), it);
      writer_->add_scalar("mem-max-allocated-bytes", static_cast<double>(memory.peak_total()), it);
      for (const MemCategory category : {MemCategory::kParams, MemCategory::kGrads, MemCategory::kOptimizer,
                                         MemCategory::kActivations, MemCategory::kOther}) {
        const std::string name(mem_category_name(category));
        writer_->add_scalar("mem-" + name + "-bytes", static_cast<double>(memory.current(category)), it);
        writer_->add_scalar("mem-max-" + name + "-bytes", static_cast<double>(memory.peak(category)), it);
      }
    }
  }
  // Megatron's MoE tracker and MTP helper write every iteration, outside the interval's test.
  for (const auto& [tag, value] : step.moe_losses) writer_->add_scalar(tag, value, it);
  for (const auto& [tag, value] : step.mtp_losses) writer_->add_scalar(tag, value, it);
}

void TensorBoardLog::timers(const int64_t iteration, const double seconds_per_iteration,
                            const std::optional<double>& throughput) {
  if (!writer_ || !args_.log_timers_to_tensorboard) return;
  writer_->add_scalar("iteration-time", seconds_per_iteration, iteration);
  if (throughput) writer_->add_scalar("throughput", *throughput, iteration);
}

void TensorBoardLog::validation(const int64_t iteration, const int64_t consumed_samples, const double lm_loss) {
  if (!writer_) return;
  scalar_with_samples("lm loss validation", lm_loss, iteration, consumed_samples);
  if (args_.log_validation_ppl_to_tensorboard) {
    scalar_with_samples("lm loss validation ppl", std::exp(std::min(20.0, lm_loss)), iteration, consumed_samples);
  }
  writer_->flush();
}

void TensorBoardLog::expert_load(const int64_t iteration, const std::vector<LayerLoad>& loads) {
  if (!writer_) return;
  for (const LayerLoad& load : loads) {
    const std::string layer = "_layer_" + std::to_string(load.layer);
    writer_->add_scalar("moe/min_load_ratio" + layer, load.min_load_ratio, iteration);
    writer_->add_scalar("moe/max_load_ratio" + layer, load.max_load_ratio, iteration);
    writer_->add_scalar("moe/collapsed_experts" + layer, static_cast<double>(load.collapsed), iteration);
    if (args_.moe_collapse_max_load_ratio > 0.0) {
      writer_->add_scalar("moe/overloaded_experts" + layer, static_cast<double>(load.overloaded), iteration);
    }
  }
}

void TensorBoardLog::flush() {
  if (writer_) writer_->flush();
}

}  // namespace moecore
