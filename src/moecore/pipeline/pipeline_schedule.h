// Megatron's pipeline schedules (megatron/core/pipeline_parallel/schedules.py) as plain data: for one pipeline rank,
// the ordered list of forward steps, backward steps and point-to-point transfers the executor performs. Pure
// functions, no MPI and no model; pipeline_simulator.h runs every rank's list together to check and time them.
//
// Executing a list, in order:
//   kForward   run model chunk `chunk` forward on micro-batch `microbatch` (keep its context for the backward,
//              unless the schedule is forward-only). Its input is the activation received earlier with the same
//              (microbatch, chunk), or the micro-batch's tokens on the first stage (pp rank 0, chunk 0).
//   kBackward  run that chunk's backward for that micro-batch, seeded by the gradient received earlier with the same
//              (microbatch, chunk), or by the loss on the last stage (pp rank PP-1, chunk VPP-1). When
//              `last_backward_of_chunk` is set this is the chunk's last backward: its gradients are complete after
//              it, so data-parallel gradient reduction of that chunk may start (Megatron enables grad sync for that
//              backward step: `enable_grad_sync` in the interleaved schedule's backward_step_helper_preprocess, the
//              last micro-batch outside `no_sync` in the other two).
//   any other  a point-to-point operation (one of p2p_communication.py's P2PCommunicator methods): post every
//              present transfer (sends non-blocking), then wait for its receives. Sends must complete (their buffers
//              stay alive) before the executor frees them; a schedule never waits on a send itself.
// The tensors: an activation travels forward from (rank r, chunk c) to the next rank, (r+1, c), or from the last rank
// to (0, c+1); a gradient travels backward the same way reversed. Each transfer names the peer pp rank and the
// (microbatch, chunk) on THIS rank: the chunk that produced a sent tensor, or the chunk that will consume a received
// one. Matching is in order per (sender, receiver, kind): use one message tag for activations and another for
// gradients (with PP 2 and VPP > 1 both kinds travel between the same two ranks in both directions).
#pragma once

#include <cstdint>
#include <string>
#include <vector>

namespace moecore {

// Which of Megatron's three schedules (schedules.py:get_forward_backward_func) a rank runs.
enum class PipelineScheduleKind {
  kNoPipelining,  // PP 1: forward_backward_no_pipelining
  kOneFOneB,      // PP > 1, VPP 1: forward_backward_pipelining_without_interleaving
  kInterleaved,   // PP > 1, VPP > 1: forward_backward_pipelining_with_interleaving
};

// One step of a schedule; the p2p ones are named after the P2PCommunicator method Megatron calls there.
enum class PipelineOp : uint8_t {
  kForward,
  kBackward,
  kRecvForward,                            // recv_forward: activation from the previous rank
  kSendForward,                            // send_forward: activation to the next rank
  kRecvBackward,                           // recv_backward: gradient from the next rank
  kSendBackward,                           // send_backward: gradient to the previous rank
  kSendForwardRecvBackward,                // send_forward_recv_backward (1F1B steady state)
  kSendBackwardRecvForward,                // send_backward_recv_forward (1F1B steady state)
  kSendForwardRecvForward,                 // send_forward_recv_forward (interleaved warm-up)
  kSendBackwardRecvBackward,               // send_backward_recv_backward (interleaved cool-down)
  kSendForwardBackwardRecvForwardBackward  // send_forward_backward_recv_forward_backward (interleaved steady state)
};

// One tensor crossing to or from a neighbouring pp rank. Absent (peer < 0) when the Megatron call had nothing to
// send or receive in that slot (e.g. the last stage's output, or no activation to prefetch in the last iteration).
struct PipelineTransfer {
  int peer = -1;        // pp rank on the other end: (r+1) % PP for *_next, (r-1+PP) % PP for *_prev
  int microbatch = -1;  // micro-batch whose tensor travels
  int chunk = -1;       // model chunk on this rank that produced it (send) or will consume it (recv)
  bool present() const { return peer >= 0; }
};

struct PipelineAction {
  PipelineOp op = PipelineOp::kForward;
  int microbatch = -1;                  // kForward / kBackward
  int chunk = -1;                       // kForward / kBackward: model chunk on this rank (virtual stage chunk*PP + r)
  bool last_backward_of_chunk = false;  // kBackward: the chunk's gradients are complete after this step
  bool combined_with_next = false;      // kForward under the combined 1F1B: one step with the kBackward after it
  PipelineTransfer send_next;           // activation output of (microbatch, chunk), to the next rank
  PipelineTransfer recv_prev;           // activation input of (microbatch, chunk), from the previous rank
  PipelineTransfer send_prev;           // gradient of the input of (microbatch, chunk), to the previous rank
  PipelineTransfer recv_next;           // gradient of the output of (microbatch, chunk), from the next rank
  bool is_compute() const { return op == PipelineOp::kForward || op == PipelineOp::kBackward; }
};

// Everything one pp rank does in one forward-backward pass (one optimizer step's micro-batches).
struct PipelineSchedule {
  PipelineScheduleKind kind = PipelineScheduleKind::kNoPipelining;
  int pp_size = 1;
  int pp_rank = 0;
  int vpp_size = 1;               // model chunks on this rank
  int num_microbatches = 0;       // M, per chunk
  int microbatch_group_size = 0;  // N (interleaved only; PP unless given)
  bool forward_only = false;
  // Megatron's combined 1F1B (--overlap-moe-expert-parallel-comm, pipeline_parallel/combined_1f1b.py): a kForward
  // marked combined_with_next and the kBackward right after it are one combined step whose two halves the executor
  // runs taking turns (parallel/turn_taking.h). Without pipelining the list is F0, F1 B0, F2 B1, ..., B(M-1);
  // interleaved, the steady state pairs forward k + warm-up with backward k after one extra warm-up forward, so the two
  // halves of a step never depend on each other.
  bool combined_1f1b = false;
  // Megatron's num_warmup_microbatches: forwards before the first backward (virtual micro-batches when interleaved).
  int num_warmup = 0;
  std::vector<PipelineAction> actions;
  // Most micro-batch contexts alive at once (forward done, backward not yet), over all chunks and per chunk (each
  // chunk's own maximum). 0 when forward-only: no context is kept for a backward.
  int max_live_contexts = 0;
  std::vector<int> max_live_contexts_per_chunk;
};

// One entry of Megatron's schedule table: virtual micro-batch k runs `chunk` on `microbatch`.
struct VirtualMicrobatch {
  int microbatch = 0;
  int chunk = 0;
  bool operator==(const VirtualMicrobatch&) const = default;
};

// schedules.py:get_schedule_table: micro-batches in groups of N ([g, g+N), the last group [g, M)), each group run
// through chunk 0, then chunk 1, ... For PP2 VPP2 M5 N3: micro-batches 0 1 2 0 1 2 3 4 3 4, chunks 0 0 0 1 1 1 0 0 1 1.
std::vector<VirtualMicrobatch> pipeline_schedule_table(int num_microbatches, int vpp_size, int microbatch_group_size);

// Forwards before the first backward, as Megatron counts them: 1F1B min(PP - r - 1, M); interleaved
// (PP - r - 1) * 2 + (VPP - 1) * N capped at M * VPP (schedules.py:get_pp_rank_microbatches); no pipelining 0;
// forward-only interleaved: all M * VPP (1F1B keeps its count: its steady state then runs forward-only); one more
// when interleaved under the combined 1F1B schedule (schedules.py: get_pp_rank_microbatches).
int pipeline_warmup_microbatches(int pp_size, int pp_rank, int vpp_size, int num_microbatches,
                                 int microbatch_group_size, bool forward_only, bool combined_1f1b = false);

// Megatron's checks on the schedule's sizes (get_forward_backward_func, forward_backward_no_pipelining,
// forward_backward_pipelining_with_interleaving); throws ConfigError with Megatron's text. microbatch_group_size 0
// means the default, PP (ModelParallelConfig.__post_init__); it is checked only for the interleaved schedule, as
// Megatron does.
void check_pipeline_schedule_sizes(int pp_size, int pp_rank, int vpp_size, int64_t num_microbatches,
                                   int64_t microbatch_group_size);

// The schedule of pp rank `pp_rank`: no pipelining for PP 1, 1F1B for VPP 1, else the interleaved schedule as
// Megatron runs it with --no-overlap-p2p-communication: one combined p2p call per steady-state iteration, which waits
// for both the next forward's input and the next backward's gradient. (Megatron's default, overlap_p2p_comm, moves the
// same transfers into a send_forward_recv_forward after each forward and a send_backward_recv_backward after each
// backward, waited on just before the step that needs them. Megatron's validate_args asks for PP > 2 on the
// non-overlapped path "to avoid having multiple p2p sends and recvs between same 2 ranks per communication batch";
// an executor that matches by tag, as these lists ask, has no such limit, so PP 2 is allowed.)
// combined_1f1b: Megatron's combined 1F1B schedule (PP 1, or interleaved; 1F1B without virtual stages throws
// Megatron's ConfigError); ignored when forward-only, as Megatron runs evaluation on the plain schedules.
PipelineSchedule make_schedule(int pp_size, int pp_rank, int vpp_size, int num_microbatches,
                               int microbatch_group_size = 0, bool forward_only = false, bool combined_1f1b = false);

// Every rank's schedule, indexed by pp rank.
std::vector<PipelineSchedule> make_all_schedules(int pp_size, int vpp_size, int num_microbatches,
                                                 int microbatch_group_size = 0, bool forward_only = false,
                                                 bool combined_1f1b = false);

// Megatron's method name of a p2p op ("send_forward_recv_backward"), or "forward" / "backward".
const char* pipeline_op_name(PipelineOp op);
// One line: "forward mb 3 chunk 1", "send_forward_recv_backward(send mb 2 chunk 0 to 1, recv mb 0 chunk 0 from 1)".
std::string describe(const PipelineAction& action);

}  // namespace moecore
