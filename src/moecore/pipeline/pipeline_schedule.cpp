#include "moecore/pipeline/pipeline_schedule.h"

#include <algorithm>
#include <string>
#include <utility>

#include "moecore/model/config.h"

namespace moecore {
namespace {

// Builds one rank's action list. Received tensors are labelled as Megatron's queues use them: the schedules append
// each received activation (gradient) to the list of the chunk it is for, and a chunk's forwards (backwards) take
// them in micro-batch order, so the j-th tensor received for a chunk belongs to micro-batch j.
class ActionListBuilder {
 public:
  ActionListBuilder(const int pp_size, const int pp_rank, const int vpp_size)
      : pp_size_(pp_size),
        pp_rank_(pp_rank),
        next_input_microbatch_(static_cast<size_t>(vpp_size), 0),
        next_grad_microbatch_(static_cast<size_t>(vpp_size), 0) {}

  // combined: the combined 1F1B runs this forward with the backward added next.
  void forward(const int microbatch, const int chunk, const bool combined = false) {
    PipelineAction action;
    action.op = PipelineOp::kForward;
    action.microbatch = microbatch;
    action.chunk = chunk;
    action.combined_with_next = combined;
    actions_.push_back(action);
  }
  void backward(const int microbatch, const int chunk, const bool last_of_chunk) {
    PipelineAction action;
    action.op = PipelineOp::kBackward;
    action.microbatch = microbatch;
    action.chunk = chunk;
    action.last_backward_of_chunk = last_of_chunk;
    actions_.push_back(action);
  }

  PipelineTransfer send_activation(const int microbatch, const int chunk) const {
    return {next_rank(), microbatch, chunk};
  }
  PipelineTransfer send_gradient(const int microbatch, const int chunk) const {
    return {prev_rank(), microbatch, chunk};
  }
  PipelineTransfer recv_activation(const int chunk) {
    return {prev_rank(), next_input_microbatch_[static_cast<size_t>(chunk)]++, chunk};
  }
  PipelineTransfer recv_gradient(const int chunk) {
    return {next_rank(), next_grad_microbatch_[static_cast<size_t>(chunk)]++, chunk};
  }

  // A Megatron p2p call; one with nothing to send or receive (e.g. the first stage's recv_forward) is left out.
  void p2p(const PipelineOp op, const PipelineTransfer send_next, const PipelineTransfer recv_prev,
           const PipelineTransfer send_prev, const PipelineTransfer recv_next) {
    if (!send_next.present() && !recv_prev.present() && !send_prev.present() && !recv_next.present()) return;
    PipelineAction action;
    action.op = op;
    action.send_next = send_next;
    action.recv_prev = recv_prev;
    action.send_prev = send_prev;
    action.recv_next = recv_next;
    actions_.push_back(action);
  }

  std::vector<PipelineAction> take() { return std::move(actions_); }

 private:
  int next_rank() const { return (pp_rank_ + 1) % pp_size_; }
  int prev_rank() const { return (pp_rank_ - 1 + pp_size_) % pp_size_; }

  const int pp_size_;
  const int pp_rank_;
  std::vector<int> next_input_microbatch_;  // per chunk
  std::vector<int> next_grad_microbatch_;   // per chunk
  std::vector<PipelineAction> actions_;
};

constexpr PipelineTransfer kNone{};

// forward_backward_no_pipelining: forward and backward of each micro-batch in turn; gradient sync only for the last.
void build_no_pipelining(const PipelineSchedule& s, ActionListBuilder& out) {
  if (s.combined_1f1b) {  // combined_1f1b_schedule_for_no_pipelining: F0, then F(k+1) with B(k), then B(M-1)
    out.forward(0, 0);
    for (int mb = 0; mb < s.num_microbatches; ++mb) {
      if (mb + 1 < s.num_microbatches) out.forward(mb + 1, 0, true);
      out.backward(mb, 0, mb == s.num_microbatches - 1);
    }
    return;
  }
  for (int mb = 0; mb < s.num_microbatches; ++mb) {
    out.forward(mb, 0);
    if (!s.forward_only) out.backward(mb, 0, mb == s.num_microbatches - 1);
  }
}

// forward_backward_pipelining_without_interleaving.
void build_one_f_one_b(const PipelineSchedule& s, ActionListBuilder& out) {
  const bool first = s.pp_rank == 0;
  const bool last = s.pp_rank == s.pp_size - 1;
  const int warmup = s.num_warmup;
  const int remaining = s.num_microbatches - warmup;
  const auto recv_forward = [&] {
    out.p2p(PipelineOp::kRecvForward, kNone, first ? kNone : out.recv_activation(0), kNone, kNone);
  };
  const auto send_forward = [&](const int mb) {
    out.p2p(PipelineOp::kSendForward, last ? kNone : out.send_activation(mb, 0), kNone, kNone, kNone);
  };
  const auto send_backward = [&](const int mb) {
    out.p2p(PipelineOp::kSendBackward, kNone, kNone, first ? kNone : out.send_gradient(mb, 0), kNone);
  };

  for (int i = 0; i < warmup; ++i) {
    recv_forward();
    out.forward(i, 0);
    send_forward(i);
  }
  if (remaining > 0) recv_forward();
  int backward_mb = 0;  // backwards run first-in first-out
  for (int i = 0; i < remaining; ++i) {
    const bool last_iteration = i == remaining - 1;
    const int forward_mb = i + warmup;
    out.forward(forward_mb, 0);
    if (s.forward_only) {
      send_forward(forward_mb);
      if (!last_iteration) recv_forward();
      continue;
    }
    out.p2p(PipelineOp::kSendForwardRecvBackward, last ? kNone : out.send_activation(forward_mb, 0), kNone, kNone,
            last ? kNone : out.recv_gradient(0));
    out.backward(backward_mb, 0, backward_mb == s.num_microbatches - 1);
    if (last_iteration) {
      send_backward(backward_mb);
    } else {
      out.p2p(PipelineOp::kSendBackwardRecvForward, kNone, first ? kNone : out.recv_activation(0),
              first ? kNone : out.send_gradient(backward_mb, 0), kNone);
    }
    ++backward_mb;
  }
  if (s.forward_only) return;
  for (int i = 0; i < warmup; ++i) {  // cool-down
    out.p2p(PipelineOp::kRecvBackward, kNone, kNone, kNone, last ? kNone : out.recv_gradient(0));
    out.backward(backward_mb, 0, backward_mb == s.num_microbatches - 1);
    send_backward(backward_mb);
    ++backward_mb;
  }
}

// forward_backward_pipelining_with_interleaving without overlap_p2p_comm: virtual micro-batch k is forward k of the
// schedule table in order; backward k runs the table's entry k on chunk VPP - 1 - chunk (schedules.py:
// get_model_chunk_id).
void build_interleaved(const PipelineSchedule& s, ActionListBuilder& out) {
  const int pp = s.pp_size;
  const int vpp = s.vpp_size;
  const int total = s.num_microbatches * vpp;
  const bool first = s.pp_rank == 0;
  const bool last = s.pp_rank == pp - 1;
  const std::vector<VirtualMicrobatch> table =
      pipeline_schedule_table(s.num_microbatches, vpp, s.microbatch_group_size);
  const auto chunk_of = [&](const int k, const bool forward) {
    const int chunk = table[static_cast<size_t>(k % total)].chunk;
    return forward ? chunk : vpp - 1 - chunk;
  };
  const auto microbatch_of = [&](const int k) { return table[static_cast<size_t>(k)].microbatch; };

  // schedules.py:recv_tensor_from_previous_stage: after iteration k, does this rank receive a tensor for the next
  // step in this direction, and for which chunk? The leading rank (first in forward, last in backward) receives what
  // the ending rank produced PP - 1 iterations earlier, for the following chunk.
  const auto recv_after = [&](const int k, const bool forward) -> std::pair<bool, int> {
    const bool leading = forward ? first : last;
    if (!leading) return {true, chunk_of(k + 1, forward)};
    bool recv = true;
    int chunk = 0;
    if (k < pp - 1) {
      recv = false;  // the ending rank has produced nothing yet
      chunk = chunk_of(k + 1, forward);
    } else {
      chunk = chunk_of(k - (pp - 1), forward);
    }
    if (chunk == (forward ? vpp - 1 : 0)) recv = false;  // the model's last (first) chunk sends nothing around
    return {recv, forward ? chunk + 1 : chunk - 1};
  };
  const auto output_to_send = [&](const int k) {
    const int chunk = chunk_of(k, true);
    return (last && chunk == vpp - 1) ? kNone : out.send_activation(microbatch_of(k), chunk);
  };
  const auto grad_to_send = [&](const int k) {
    const int chunk = chunk_of(k, false);
    return (first && chunk == 0) ? kNone : out.send_gradient(microbatch_of(k), chunk);
  };
  const auto backward = [&](const int k) {
    // is_last_microbatch_for_model_chunk: Megatron enables grad sync for this backward.
    out.backward(microbatch_of(k), chunk_of(k, false), microbatch_of(k) == s.num_microbatches - 1);
  };

  const int warmup = s.num_warmup;
  const int remaining = total - warmup;
  const bool all_in_warmup = warmup == total;
  out.p2p(PipelineOp::kRecvForward, kNone, first ? kNone : out.recv_activation(0), kNone, kNone);
  for (int k = 0; k < warmup; ++k) {
    auto [recv_prev, next_chunk] = recv_after(k, true);
    if (k == total - 1) recv_prev = false;
    out.forward(microbatch_of(k), chunk_of(k, true));
    const PipelineTransfer send_next = output_to_send(k);
    const PipelineTransfer input = recv_prev ? out.recv_activation(next_chunk) : kNone;
    if (k == warmup - 1 && !s.forward_only && !all_in_warmup) {
      // The last warm-up iteration also receives the gradient for the first backward (chunk VPP - 1).
      out.p2p(PipelineOp::kSendForwardBackwardRecvForwardBackward, send_next, input, kNone,
              last ? kNone : out.recv_gradient(vpp - 1));
    } else {
      out.p2p(PipelineOp::kSendForwardRecvForward, send_next, input, kNone, kNone);
    }
  }
  for (int k = 0; k < remaining; ++k) {  // steady state: forward k + warmup, backward k
    const int forward_k = k + warmup;
    out.forward(microbatch_of(forward_k), chunk_of(forward_k, true), s.combined_1f1b);
    backward(k);
    auto [recv_prev, next_forward_chunk] = recv_after(forward_k, true);
    const auto [recv_next, next_backward_chunk] = recv_after(k, false);
    if (k == remaining - 1) recv_prev = false;
    const PipelineTransfer send_next = output_to_send(forward_k);
    const PipelineTransfer send_prev = grad_to_send(k);
    const PipelineTransfer input = recv_prev ? out.recv_activation(next_forward_chunk) : kNone;
    const PipelineTransfer grad = recv_next ? out.recv_gradient(next_backward_chunk) : kNone;
    out.p2p(PipelineOp::kSendForwardBackwardRecvForwardBackward, send_next, input, send_prev, grad);
  }
  if (s.forward_only) return;
  if (all_in_warmup) out.p2p(PipelineOp::kRecvBackward, kNone, kNone, kNone, last ? kNone : out.recv_gradient(vpp - 1));
  for (int k = remaining; k < total; ++k) {  // cool-down
    auto [recv_next, next_chunk] = recv_after(k, false);
    if (k == total - 1) recv_next = false;
    backward(k);
    const PipelineTransfer send_prev = grad_to_send(k);
    out.p2p(PipelineOp::kSendBackwardRecvBackward, kNone, kNone, send_prev,
            recv_next ? out.recv_gradient(next_chunk) : kNone);
  }
}

void count_live_contexts(PipelineSchedule& s) {
  s.max_live_contexts = 0;
  s.max_live_contexts_per_chunk.assign(static_cast<size_t>(s.vpp_size), 0);
  if (s.forward_only) return;
  std::vector<int> live(static_cast<size_t>(s.vpp_size), 0);
  int live_total = 0;
  for (const PipelineAction& action : s.actions) {
    if (!action.is_compute()) continue;
    const int delta = action.op == PipelineOp::kForward ? 1 : -1;
    int& in_chunk = live[static_cast<size_t>(action.chunk)];
    in_chunk += delta;
    live_total += delta;
    int& max_in_chunk = s.max_live_contexts_per_chunk[static_cast<size_t>(action.chunk)];
    max_in_chunk = std::max(max_in_chunk, in_chunk);
    s.max_live_contexts = std::max(s.max_live_contexts, live_total);
  }
}

std::string transfer_text(const char* verb, const PipelineTransfer& t, const char* direction) {
  return std::string(verb) + " mb " + std::to_string(t.microbatch) + " chunk " + std::to_string(t.chunk) + " " +
         direction + " " + std::to_string(t.peer);
}

}  // namespace

std::vector<VirtualMicrobatch> pipeline_schedule_table(const int num_microbatches, const int vpp_size,
                                                       const int microbatch_group_size) {
  if (microbatch_group_size < 1) {
    throw ConfigError("microbatch group size per virtual pipeline stage must be positive (got " +
                      std::to_string(microbatch_group_size) + ")");
  }
  std::vector<VirtualMicrobatch> table;
  table.reserve(static_cast<size_t>(num_microbatches) * static_cast<size_t>(std::max(vpp_size, 0)));
  for (int group_start = 0; group_start < num_microbatches; group_start += microbatch_group_size) {
    const int group_end = std::min(group_start + microbatch_group_size, num_microbatches);
    for (int chunk = 0; chunk < vpp_size; ++chunk) {
      for (int mb = group_start; mb < group_end; ++mb) table.push_back({mb, chunk});
    }
  }
  return table;
}

int pipeline_warmup_microbatches(const int pp_size, const int pp_rank, const int vpp_size, const int num_microbatches,
                                 const int microbatch_group_size, const bool forward_only, const bool combined_1f1b) {
  if (pp_size == 1) return 0;
  if (vpp_size == 1) return std::min(pp_size - pp_rank - 1, num_microbatches);
  const int total = num_microbatches * vpp_size;
  if (forward_only) return total;
  const int group = microbatch_group_size > 0 ? microbatch_group_size : pp_size;
  const int extra = combined_1f1b ? 1 : 0;
  return std::min((pp_size - pp_rank - 1) * 2 + (vpp_size - 1) * group + extra, total);
}

void check_pipeline_schedule_sizes(const int pp_size, const int pp_rank, const int vpp_size,
                                   const int64_t num_microbatches, const int64_t microbatch_group_size) {
  if (pp_size < 1)
    throw ConfigError("pipeline-model-parallel size must be positive (got " + std::to_string(pp_size) + ")");
  if (pp_rank < 0 || pp_rank >= pp_size) {
    throw ConfigError("pipeline-model-parallel rank " + std::to_string(pp_rank) + " is outside [0, " +
                      std::to_string(pp_size) + ")");
  }
  if (vpp_size < 1) {
    throw ConfigError("virtual pipeline-model-parallel size must be positive (got " + std::to_string(vpp_size) + ")");
  }
  if (num_microbatches < 1) {
    throw ConfigError("number of micro-batches must be positive (got " + std::to_string(num_microbatches) + ")");
  }
  if (microbatch_group_size < 0) {
    throw ConfigError("microbatch group size per virtual pipeline stage must be positive (got " +
                      std::to_string(microbatch_group_size) + ")");
  }
  // schedules.py:forward_backward_no_pipelining takes exactly one model chunk.
  if (pp_size == 1 && vpp_size > 1) throw ConfigError("non-pipeline-parallel schedule does not support model chunking");
  if (pp_size == 1 || vpp_size == 1) return;
  // schedules.py:forward_backward_pipelining_with_interleaving (its ValueError, with the space its text lacks before
  // "should", and its RuntimeError).
  const int64_t group = microbatch_group_size > 0 ? microbatch_group_size : pp_size;
  if (group > num_microbatches || group < pp_size) {
    throw ConfigError("The number of contiguous micro-batches in a virtual pipeline stage should range in [PP=" +
                      std::to_string(pp_size) + " , M=" + std::to_string(num_microbatches) + "]");
  }
  const int64_t final_group_size = num_microbatches % group;
  if (final_group_size > 0 && final_group_size < pp_size) {
    throw ConfigError(
        "The remainder of M (the total micro-batches) divided by N (number of contiguous micro-batches in a "
        "virtual pipeline stage) should be 0, or larger than or equal to the pipeline-parallel size, but it is " +
        std::to_string(final_group_size) +
        ". Otherwise, it introduces dependency bubbles in the pipeline and reduces throughput.");
  }
}

PipelineSchedule make_schedule(const int pp_size, const int pp_rank, const int vpp_size, const int num_microbatches,
                               const int microbatch_group_size, const bool forward_only, const bool combined_1f1b) {
  check_pipeline_schedule_sizes(pp_size, pp_rank, vpp_size, num_microbatches, microbatch_group_size);
  if (combined_1f1b && !forward_only && pp_size > 1 && vpp_size == 1) {
    throw ConfigError(
        "If enabling EP A2A overlap, virtual_pipeline_model_parallel_size must be specified when "
        "pipeline_model_parallel_size > 1");
  }
  PipelineSchedule s;
  s.kind = pp_size == 1    ? PipelineScheduleKind::kNoPipelining
           : vpp_size == 1 ? PipelineScheduleKind::kOneFOneB
                           : PipelineScheduleKind::kInterleaved;
  s.pp_size = pp_size;
  s.pp_rank = pp_rank;
  s.vpp_size = vpp_size;
  s.num_microbatches = num_microbatches;
  s.microbatch_group_size = microbatch_group_size > 0 ? microbatch_group_size : pp_size;
  s.forward_only = forward_only;
  s.combined_1f1b = combined_1f1b && !forward_only;
  s.num_warmup = pipeline_warmup_microbatches(pp_size, pp_rank, vpp_size, num_microbatches, s.microbatch_group_size,
                                              forward_only, s.combined_1f1b);
  ActionListBuilder builder(pp_size, pp_rank, vpp_size);
  switch (s.kind) {
    case PipelineScheduleKind::kNoPipelining: build_no_pipelining(s, builder); break;
    case PipelineScheduleKind::kOneFOneB: build_one_f_one_b(s, builder); break;
    case PipelineScheduleKind::kInterleaved: build_interleaved(s, builder); break;
  }
  s.actions = builder.take();
  count_live_contexts(s);
  return s;
}

std::vector<PipelineSchedule> make_all_schedules(const int pp_size, const int vpp_size, const int num_microbatches,
                                                 const int microbatch_group_size, const bool forward_only,
                                                 const bool combined_1f1b) {
  check_pipeline_schedule_sizes(pp_size, 0, vpp_size, num_microbatches, microbatch_group_size);
  std::vector<PipelineSchedule> all;
  all.reserve(static_cast<size_t>(pp_size));
  for (int rank = 0; rank < pp_size; ++rank) {
    all.push_back(
        make_schedule(pp_size, rank, vpp_size, num_microbatches, microbatch_group_size, forward_only, combined_1f1b));
  }
  return all;
}

const char* pipeline_op_name(const PipelineOp op) {
  switch (op) {
    case PipelineOp::kForward: return "forward";
    case PipelineOp::kBackward: return "backward";
    case PipelineOp::kRecvForward: return "recv_forward";
    case PipelineOp::kSendForward: return "send_forward";
    case PipelineOp::kRecvBackward: return "recv_backward";
    case PipelineOp::kSendBackward: return "send_backward";
    case PipelineOp::kSendForwardRecvBackward: return "send_forward_recv_backward";
    case PipelineOp::kSendBackwardRecvForward: return "send_backward_recv_forward";
    case PipelineOp::kSendForwardRecvForward: return "send_forward_recv_forward";
    case PipelineOp::kSendBackwardRecvBackward: return "send_backward_recv_backward";
    case PipelineOp::kSendForwardBackwardRecvForwardBackward: return "send_forward_backward_recv_forward_backward";
  }
  return "?";
}

std::string describe(const PipelineAction& action) {
  if (action.is_compute()) {
    return std::string(pipeline_op_name(action.op)) + " mb " + std::to_string(action.microbatch) + " chunk " +
           std::to_string(action.chunk) + (action.last_backward_of_chunk ? " (last of chunk)" : "") +
           (action.combined_with_next ? " (combined with the next backward)" : "");
  }
  std::vector<std::string> parts;
  if (action.send_next.present()) parts.push_back(transfer_text("send activation", action.send_next, "to"));
  if (action.recv_prev.present()) parts.push_back(transfer_text("recv activation", action.recv_prev, "from"));
  if (action.send_prev.present()) parts.push_back(transfer_text("send gradient", action.send_prev, "to"));
  if (action.recv_next.present()) parts.push_back(transfer_text("recv gradient", action.recv_next, "from"));
  std::string text = std::string(pipeline_op_name(action.op)) + "(";
  for (size_t i = 0; i < parts.size(); ++i) text += (i > 0 ? ", " : "") + parts[i];
  return text + ")";
}

}  // namespace moecore
