#include "moecore/train/pipeline_executor.h"

#include <algorithm>
#include <any>
#include <cstring>
#include <map>
#include <memory>
#include <span>
#include <stdexcept>
#include <string>
#include <utility>
#include <vector>

#include "moecore/ops/convert.h"
#include "moecore/ops/precision.h"
#include "moecore/ops/scoped_state.h"
#include "moecore/parallel/comm_stats.h"
#include "moecore/parallel/turn_taking.h"
#include "moecore/util/trace.h"

namespace moecore {
namespace {

// Activations and gradients travel under their own tags: with PP 2 and several chunks both kinds cross between the
// same two ranks in both directions, and MPI keeps the order of each (peer, tag) pair, which is the schedule's.
constexpr int kActivationTag = 1;
constexpr int kGradientTag = 2;

using Key = std::pair<int, int>;  // (micro-batch, chunk)

class Executor {
 public:
  Executor(const PipelineSchedule& schedule, GPTModel& model, DistributedDataParallel* ddp,
           const parallel::ParallelState& parallel, const PipelineMicrobatches& microbatches)
      : schedule_(schedule), model_(model), ddp_(ddp), parallel_(parallel), microbatches_(microbatches) {
    if (schedule.pp_size != parallel.pp_size() || schedule.pp_rank != parallel.pp_rank() ||
        schedule.vpp_size != model.num_chunks()) {
      throw std::logic_error("pipeline schedule for pp rank " + std::to_string(schedule.pp_rank) + " of " +
                             std::to_string(schedule.pp_size) + " with " + std::to_string(schedule.vpp_size) +
                             " chunks run on pp rank " + std::to_string(parallel.pp_rank()) + " of " +
                             std::to_string(parallel.pp_size()) + " with " + std::to_string(model.num_chunks()));
    }
    const int tp = parallel.tp_size();
    const int64_t tokens = microbatches.S * microbatches.B / parallel.cp_size();
    rows_ = parallel.sequence_parallel && tp > 1 ? tokens / tp : tokens;
  }

  TokenWeightedLoss run() {
    const std::vector<PipelineAction>& actions = schedule_.actions;
    for (size_t i = 0; i < actions.size(); ++i) {
      const PipelineAction& action = actions[i];
      if (action.combined_with_next && i + 1 < actions.size() && actions[i + 1].op == PipelineOp::kBackward) {
        combined_step(action, actions[i + 1]);
        ++i;
        continue;
      }
      switch (action.op) {
        case PipelineOp::kForward: forward(action.microbatch, action.chunk); break;
        case PipelineOp::kBackward: backward(action); break;
        default: communicate(action); break;
      }
    }
    {
      const parallel::CommTimer timer(parallel::CommKind::kPipelineP2P);
      for (auto& [work, tensor] : sends_) work.wait();
    }
    sends_.clear();
    if (!contexts_.empty() || !inputs_.empty() || !output_grads_.empty() || !outputs_.empty() ||
        !pending_inputs_.empty() || !pending_grads_.empty() || !input_grads_.empty()) {
      throw std::logic_error("pipeline schedule left micro-batch state behind");
    }
    if (max_live_ > schedule_.max_live_contexts) {  // the schedule's memory bound, which the executor must keep
      throw std::logic_error("pipeline executor kept " + std::to_string(max_live_) + " micro-batch contexts, the " +
                             "schedule needs " + std::to_string(schedule_.max_live_contexts));
    }
    return loss_;
  }

 private:
  std::string step_name(const char* what, const int microbatch, const int chunk) const {
    std::string name = std::string(what) + " (micro-batch " + std::to_string(microbatch);
    if (schedule_.vpp_size > 1) name += ", chunk " + std::to_string(chunk);
    return name + ")";
  }

  // The received tensor for key, waiting for its transfer first if it is still in flight. Receives are waited for
  // only here, when the step that consumes them comes (Megatron's overlap_p2p_comm): until then they travel while
  // this rank computes.
  Tensor take_received(std::map<Key, Tensor>& tensors, std::map<Key, parallel::Work>& pending, const Key& key,
                       const char* what) {
    const auto it = pending.find(key);
    if (it != pending.end()) {
      const parallel::CommTimer wait(parallel::CommKind::kPipelineWait);
      it->second.wait();
      pending.erase(it);
    }
    return take(tensors, key, what);
  }

  static Tensor take(std::map<Key, Tensor>& tensors, const Key& key, const char* what) {
    const auto it = tensors.find(key);
    if (it == tensors.end()) {
      throw std::logic_error(std::string("pipeline schedule: no ") + what + " for micro-batch " +
                             std::to_string(key.first) + " chunk " + std::to_string(key.second));
    }
    Tensor t = std::move(it->second);
    tensors.erase(it);
    return t;
  }

  void forward(const int microbatch, const int chunk) {
    const StageSpec& stage = model_.stage(chunk);
    const Key key{microbatch, chunk};
    ForwardOptions options = microbatches_.options(microbatch);
    options.chunk = chunk;
    // Megatron's is_first_microbatch_for_model_chunk: the chunk's first micro-batch of this forward_backward call.
    options.is_first_microbatch = microbatch == 0;
    if (!stage.pre_process) {
      model_.set_input_tensor(take_received(inputs_, pending_inputs_, key, "received activation"), chunk);
    }
    // The stages that embed or compute the loss read the data (Megatron's get_batch on first and last stage); with
    // packed sequences every stage does, for the position and document ids its attention needs.
    const bool packed = microbatches_.position_ids || microbatches_.document_ids;
    const Batch data = stage.pre_process || stage.post_process || packed ? microbatches_.batch(microbatch) : Batch{};
    std::unique_ptr<MicroBatchContext> ctx;
    double mean_loss = 0.0, tokens = 0.0;
    options.loss_tokens = &tokens;
    if (microbatches_.position_ids) options.position_ids_BS = data.position_ids_BS.data();
    if (microbatches_.document_ids) options.document_ids_BS = data.document_ids_BS.data();
    {
      const trace::Scope scope(step_name("forward", microbatch, chunk), "step");
      // The loss stage reads the tokens too: the Multi-Token Prediction depths embed them.
      mean_loss = model_.forward(ctx, stage.pre_process || stage.post_process ? data.tokens_BS.data() : nullptr,
                                 stage.post_process ? data.labels_BS.data() : nullptr,
                                 stage.post_process ? data.loss_mask_BS.data() : nullptr, microbatches_.B,
                                 microbatches_.S, options);
    }
    if (stage.post_process) {
      loss_.add(mean_loss, tokens);  // this rank's tokens: a context-parallel rank's share of the sequence
    } else {
      outputs_[key] = std::move(ctx->output_TH);  // sent by a later step; backward does not need it
    }
    if (options.training) {
      contexts_[key] = std::move(ctx);
      max_live_ = std::max(max_live_, static_cast<int>(contexts_.size()));
    }
  }

  // Megatron's combined_forward_backward_step: the backward of one micro-batch and the forward of another take turns
  // on the cores, each handing them over while its expert all-to-all travels (parallel/turn_taking.h); the backward
  // runs on this thread, the forward on the helper lane. Each computes what it would alone, in the same order.
  void combined_step(const PipelineAction& forward_action, const PipelineAction& backward_action) {
    const trace::Scope scope(step_name("combined forward", forward_action.microbatch, forward_action.chunk) + " + " +
                                 step_name("backward", backward_action.microbatch, backward_action.chunk),
                             "step");
    // Each lane keeps its own ops scopes (activation dtype, quantization) while the other runs.
    const parallel::LaneState ops_scopes{
        [] { return std::any(ops::current_scoped_state()); },
        [](const std::any& state) { ops::restore_scoped_state(std::any_cast<const ops::ScopedState&>(state)); }};
    parallel::run_taking_turns([&] { backward(backward_action); },
                               [&] { forward(forward_action.microbatch, forward_action.chunk); }, ops_scopes);
  }

  void backward(const PipelineAction& action) {
    const Key key{action.microbatch, action.chunk};
    const StageSpec& stage = model_.stage(action.chunk);
    const auto it = contexts_.find(key);
    if (it == contexts_.end()) {
      throw std::logic_error("pipeline schedule: backward of micro-batch " + std::to_string(key.first) + " chunk " +
                             std::to_string(key.second) + " before its forward");
    }
    std::unique_ptr<MicroBatchContext> ctx = std::move(it->second);
    contexts_.erase(it);
    Tensor output_grad;
    if (!stage.post_process) output_grad = take_received(output_grads_, pending_grads_, key, "received gradient");
    if (ddp_ != nullptr) ddp_->set_last_microbatch(action.last_backward_of_chunk);
    Tensor input_grad;
    {
      const trace::Scope scope(step_name("backward", action.microbatch, action.chunk), "step");
      input_grad = model_.backward(std::move(ctx), microbatches_.loss_scale(action.microbatch),
                                   stage.post_process ? nullptr : &output_grad);
    }
    if (ddp_ != nullptr) ddp_->set_last_microbatch(false);
    if (!stage.pre_process) input_grads_[key] = std::move(input_grad);
  }

  // Activations and their gradients travel between stages in the model's activation storage dtype (bf16 / fp16
  // under --bf16 / --fp16, ops/precision.h; their values are already rounded to it, so narrowing is exact).
  DType wire_dtype() const {
    const ModelConfig& config = model_.config();
    return config.activation_storage == ops::ActivationStorage::k16Bit ? config.params_dtype : DType::kF32;
  }

  void send(std::map<Key, Tensor>& tensors, const PipelineTransfer& transfer, const int tag, const char* what) {
    Tensor t = take(tensors, {transfer.microbatch, transfer.chunk}, what);
    if (t.dtype() != wire_dtype()) {
      Tensor bits(t.shape(), wire_dtype(), MemCategory::kActivations, t.device());
      ops::convert(bits, t);
      t = std::move(bits);
    }
    parallel::Work work = parallel_.pp.send_async(t, transfer.peer, tag);
    sends_.emplace_back(std::move(work), std::move(t));
  }

  void communicate(const PipelineAction& action) {
    const parallel::CommTimer timer(parallel::CommKind::kPipelineP2P);
    const auto receive = [&](std::map<Key, Tensor>& into, std::map<Key, parallel::Work>& pending,
                             const PipelineTransfer& transfer, const int tag) {
      Tensor t({rows_, model_.config().hidden_size}, wire_dtype(), MemCategory::kActivations);
      const Key key{transfer.microbatch, transfer.chunk};
      pending[key] = parallel_.pp.recv_async(t, transfer.peer, tag);
      into[key] = std::move(t);
    };
    if (action.recv_prev.present()) receive(inputs_, pending_inputs_, action.recv_prev, kActivationTag);
    if (action.recv_next.present()) receive(output_grads_, pending_grads_, action.recv_next, kGradientTag);
    if (action.send_next.present()) send(outputs_, action.send_next, kActivationTag, "activation to send");
    if (action.send_prev.present()) send(input_grads_, action.send_prev, kGradientTag, "gradient to send");
    // Sends that have completed give their buffers back now rather than at the end of the step.
    std::erase_if(sends_, [](auto& sent) { return sent.first.test(); });
    if (!microbatches_.overlap_p2p_comm) {
      const parallel::CommTimer wait(parallel::CommKind::kPipelineWait);
      for (auto* pending : {&pending_inputs_, &pending_grads_}) {
        for (auto& [key, work] : *pending) work.wait();
        pending->clear();
      }
    }
  }

  const PipelineSchedule& schedule_;
  GPTModel& model_;
  DistributedDataParallel* ddp_;
  const parallel::ParallelState& parallel_;
  const PipelineMicrobatches& microbatches_;
  int64_t rows_ = 0;
  std::map<Key, std::unique_ptr<MicroBatchContext>> contexts_;
  std::map<Key, Tensor> inputs_, output_grads_;                   // received (or in flight), waiting for their step
  std::map<Key, parallel::Work> pending_inputs_, pending_grads_;  // receives in flight
  std::map<Key, Tensor> outputs_, input_grads_;                   // computed, waiting for their send
  std::vector<std::pair<parallel::Work, Tensor>> sends_;
  TokenWeightedLoss loss_;
  int max_live_ = 0;
};

}  // namespace

TokenWeightedLoss run_pipeline_schedule(const PipelineSchedule& schedule, GPTModel& model, DistributedDataParallel* ddp,
                                        const parallel::ParallelState& parallel,
                                        const PipelineMicrobatches& microbatches) {
  return Executor(schedule, model, ddp, parallel, microbatches).run();
}

double reduce_pipeline_loss(const TokenWeightedLoss& local, const parallel::ParallelState& parallel) {
  double loss = reduce_over_dp_cp(local, parallel);  // every stage's dp-cp group reduces; only the last one's counts
  if (parallel.pp_size() > 1) {
    const parallel::CommTimer timer(parallel::CommKind::kOther);
    float value[2];
    std::memcpy(value, &loss, sizeof loss);
    parallel.pp.broadcast(std::span<float>(value, 2), parallel.pp_size() - 1);
    std::memcpy(&loss, value, sizeof loss);
  }
  return loss;
}

}  // namespace moecore
