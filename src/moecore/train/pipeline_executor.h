// Runs one pipeline rank's schedule (pipeline_schedule.h) on the model: the forward and backward steps of its model
// chunks over this data-parallel rank's micro-batches, and the activations and their gradients between neighbouring
// stages by non-blocking point-to-point MPI, [S*B/CP/TP (sequence parallel) or S*B/CP, H] fp32 as Megatron sends them
// (p2p_communication.py). The same executor runs PP 1 (Megatron's forward_backward_no_pipelining), 1F1B and the
// interleaved schedule, training and forward-only (evaluation).
#pragma once

#include <cstdint>
#include <functional>

#include "moecore/data/data_loader.h"
#include "moecore/model/gpt_model.h"
#include "moecore/optim/ddp.h"
#include "moecore/parallel/parallel_state.h"
#include "moecore/pipeline/pipeline_schedule.h"
#include "moecore/train/batch_schedule.h"

namespace moecore {

struct PipelineMicrobatches {
  int64_t B = 0, S = 0;                                        // micro-batch size, sequence length
  std::function<Batch(int microbatch)> batch;                  // this DP rank's micro-batch (0..M-1)
  std::function<ForwardOptions(int microbatch)> options;       // training flag, dropout seed and stream (not chunk)
  std::function<double(int microbatch)> loss_scale = nullptr;  // backward seed per micro-batch (training only)
  // Megatron's overlap_p2p_comm: a receive is waited for when its step needs it, not at its p2p call.
  bool overlap_p2p_comm = true;
  // Packed sequences: hand the batch's position ids / document ids to the model (--reset-position-ids /
  // --reset-attention-mask).
  bool position_ids = false, document_ids = false;
};

// Runs `schedule` (whose pp rank and sizes are this rank's) and returns the token-weighted loss of the micro-batches
// whose loss this rank computed (the last stage; empty elsewhere). In training, DDP's last-micro-batch flag is set
// for each chunk's last backward, so --overlap-grad-reduce starts a chunk's buckets after it (Megatron's
// enable_grad_sync); gradient sync itself (finish_grad_sync) is the caller's. Every send has completed on return.
TokenWeightedLoss run_pipeline_schedule(const PipelineSchedule& schedule, GPTModel& model, DistributedDataParallel* ddp,
                                        const parallel::ParallelState& parallel,
                                        const PipelineMicrobatches& microbatches);

// The loss reported by every rank: the last stage's token-weighted loss summed over dp-cp (Megatron's reporting
// all-reduce), then broadcast from the last stage over the pipeline so that every rank logs and stops alike.
double reduce_pipeline_loss(const TokenWeightedLoss& local, const parallel::ParallelState& parallel);

}  // namespace moecore
