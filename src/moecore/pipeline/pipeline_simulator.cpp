#include "moecore/pipeline/pipeline_simulator.h"

#include <algorithm>
#include <map>
#include <string>
#include <tuple>
#include <utility>

namespace moecore {
namespace {

enum class TensorKind { kActivation, kGradient };

// One end of a transfer, as a rank posted it.
struct Post {
  double time = 0.0;
  int rank = 0;
  int action = 0;
  PipelineTransfer tensor;
};

// The in-order match queue of one (sender, receiver, kind): the k-th send meets the k-th receive.
struct Channel {
  std::vector<Post> sends;
  std::vector<Post> recvs;
};

// A transfer of the action a rank is in: where it was posted and whether the action waits for it.
struct PendingPart {
  Channel* channel = nullptr;
  size_t index = 0;
  bool is_send = false;
  bool waited = false;
  TensorKind kind = TensorKind::kActivation;
  PipelineTransfer tensor;
};

// What one rank has done so far, per chunk and micro-batch.
struct RankState {
  size_t pc = 0;
  double clock = 0.0;
  bool posted = false;  // the current p2p action's transfers are posted
  std::vector<PendingPart> pending;
  std::vector<std::vector<char>> forwarded, backwarded, input_received, grad_received;  // [chunk][microbatch]
};

class Simulator {
 public:
  Simulator(const std::vector<PipelineSchedule>& schedules, const PipelineCosts& costs, const SendCompletion sends)
      : schedules_(schedules), costs_(costs), sends_(sends), pp_(static_cast<int>(schedules.size())) {}

  PipelineSimulation run() {
    PipelineSimulation result;
    if (schedules_.empty()) {
      result.error = "no schedules";
      return result;
    }
    const PipelineSchedule& first = schedules_.front();
    vpp_ = first.vpp_size;
    num_microbatches_ = first.num_microbatches;
    forward_only_ = first.forward_only;
    for (int r = 0; r < pp_; ++r) {
      const PipelineSchedule& s = schedules_[static_cast<size_t>(r)];
      if (s.pp_rank != r || s.pp_size != pp_ || s.vpp_size != vpp_ || s.num_microbatches != num_microbatches_ ||
          s.forward_only != forward_only_) {
        result.error = "schedule " + std::to_string(r) + " is not pp rank " + std::to_string(r) + " of the same run";
        return result;
      }
    }
    ranks_.assign(static_cast<size_t>(pp_), RankState{});
    result.busy.assign(static_cast<size_t>(pp_), 0.0);
    result.timings.resize(static_cast<size_t>(pp_));
    for (int r = 0; r < pp_; ++r) {
      RankState& state = ranks_[static_cast<size_t>(r)];
      for (auto* table : {&state.forwarded, &state.backwarded, &state.input_received, &state.grad_received}) {
        table->assign(static_cast<size_t>(vpp_), std::vector<char>(static_cast<size_t>(num_microbatches_), 0));
      }
      result.timings[static_cast<size_t>(r)].resize(schedules_[static_cast<size_t>(r)].actions.size());
    }

    // Advance every rank as far as it can go until all are done; a sweep in which no rank moves is a deadlock.
    while (error_.empty()) {
      bool moved = false;
      bool all_done = true;
      for (int r = 0; r < pp_ && error_.empty(); ++r) {
        moved |= advance(r, result);
        all_done &= done(r);
      }
      if (!error_.empty() || all_done) break;
      if (!moved) {
        error_ = "deadlock:";
        for (int r = 0; r < pp_; ++r) {
          if (done(r)) continue;
          const RankState& state = ranks_[static_cast<size_t>(r)];
          error_ += " rank " + std::to_string(r) + " waits in action " + std::to_string(state.pc) + " " +
                    describe(schedules_[static_cast<size_t>(r)].actions[state.pc]) + ";";
        }
      }
    }
    if (error_.empty()) check_complete(result);
    result.error = error_;
    result.completed = error_.empty();

    result.finish.resize(static_cast<size_t>(pp_));
    for (int r = 0; r < pp_; ++r) {
      result.finish[static_cast<size_t>(r)] = ranks_[static_cast<size_t>(r)].clock;
      result.makespan = std::max(result.makespan, ranks_[static_cast<size_t>(r)].clock);
    }
    if (result.makespan > 0.0) {
      double idle = 0.0;
      for (const double busy : result.busy) idle += result.makespan - busy;
      result.bubble_fraction = idle / (result.makespan * pp_);
    }
    return result;
  }

 private:
  bool done(const int r) const {
    return ranks_[static_cast<size_t>(r)].pc == schedules_[static_cast<size_t>(r)].actions.size();
  }
  int next_rank(const int r) const { return (r + 1) % pp_; }
  int prev_rank(const int r) const { return (r - 1 + pp_) % pp_; }

  std::string where(const int r, const size_t action) const {
    return "rank " + std::to_string(r) + " action " + std::to_string(action) + " " +
           describe(schedules_[static_cast<size_t>(r)].actions[action]);
  }
  bool fail(std::string message) {
    if (error_.empty()) error_ = std::move(message);
    return false;
  }
  bool in_range(const int microbatch, const int chunk) const {
    return microbatch >= 0 && microbatch < num_microbatches_ && chunk >= 0 && chunk < vpp_;
  }
  static char& at(std::vector<std::vector<char>>& table, const int microbatch, const int chunk) {
    return table[static_cast<size_t>(chunk)][static_cast<size_t>(microbatch)];
  }

  // Runs rank r's actions until it blocks or finishes; true when it moved.
  bool advance(const int r, PipelineSimulation& result) {
    RankState& state = ranks_[static_cast<size_t>(r)];
    const std::vector<PipelineAction>& actions = schedules_[static_cast<size_t>(r)].actions;
    bool moved = false;
    while (state.pc < actions.size() && error_.empty()) {
      const PipelineAction& action = actions[state.pc];
      PipelineActionTiming& timing = result.timings[static_cast<size_t>(r)][state.pc];
      if (action.is_compute()) {
        if (!run_compute(r, action)) return moved;
        const double cost = action.op == PipelineOp::kForward ? costs_.forward : costs_.backward;
        timing.start = state.clock;
        state.clock += cost;
        timing.end = state.clock;
        result.busy[static_cast<size_t>(r)] += cost;
        ++state.pc;
        moved = true;
        continue;
      }
      if (!state.posted) {
        timing.start = state.clock;
        if (!post(r, action)) return moved;
        state.posted = true;
        moved = true;
      }
      // Complete when every waited transfer has both ends posted.
      double end = state.clock;
      for (const PendingPart& part : state.pending) {
        if (!part.waited) continue;
        const std::vector<Post>& other = part.is_send ? part.channel->recvs : part.channel->sends;
        if (part.index >= other.size()) return moved;
        const Post& mine = (part.is_send ? part.channel->sends : part.channel->recvs)[part.index];
        end = std::max(end, std::max(mine.time, other[part.index].time) + costs_.p2p_latency);
      }
      for (const PendingPart& part : state.pending) {
        if (part.is_send) continue;
        char& received = at(part.kind == TensorKind::kActivation ? state.input_received : state.grad_received,
                            part.tensor.microbatch, part.tensor.chunk);
        if (received) return fail(where(r, state.pc) + ": this tensor was already received");
        received = 1;
      }
      state.pending.clear();
      state.posted = false;
      state.clock = end;
      timing.end = end;
      ++state.pc;
      moved = true;
    }
    return moved;
  }

  bool run_compute(const int r, const PipelineAction& action) {
    RankState& state = ranks_[static_cast<size_t>(r)];
    const int mb = action.microbatch;
    const int chunk = action.chunk;
    if (!in_range(mb, chunk)) return fail(where(r, state.pc) + ": micro-batch or chunk out of range");
    if (action.op == PipelineOp::kForward) {
      if (at(state.forwarded, mb, chunk)) return fail(where(r, state.pc) + ": forwarded twice");
      const bool model_input = r == 0 && chunk == 0;  // the first virtual stage reads tokens
      if (!model_input && !at(state.input_received, mb, chunk)) {
        return fail(where(r, state.pc) + ": its input activation has not been received");
      }
      at(state.forwarded, mb, chunk) = 1;
      return true;
    }
    if (forward_only_) return fail(where(r, state.pc) + ": backward in a forward-only schedule");
    if (!at(state.forwarded, mb, chunk)) return fail(where(r, state.pc) + ": backward before its forward");
    if (at(state.backwarded, mb, chunk)) return fail(where(r, state.pc) + ": backwarded twice");
    const bool loss = r == pp_ - 1 && chunk == vpp_ - 1;  // the last virtual stage starts from the loss
    if (!loss && !at(state.grad_received, mb, chunk)) {
      return fail(where(r, state.pc) + ": its output gradient has not been received");
    }
    at(state.backwarded, mb, chunk) = 1;
    return true;
  }

  // Posts every present transfer of a p2p action; checks peers and that sent tensors exist.
  bool post(const int r, const PipelineAction& action) {
    RankState& state = ranks_[static_cast<size_t>(r)];
    struct Slot {
      const PipelineTransfer& tensor;
      bool is_send;
      TensorKind kind;
      int peer;
      const char* name;
    };
    const Slot slots[] = {
        {action.send_next, true, TensorKind::kActivation, next_rank(r), "send_next"},
        {action.recv_prev, false, TensorKind::kActivation, prev_rank(r), "recv_prev"},
        {action.send_prev, true, TensorKind::kGradient, prev_rank(r), "send_prev"},
        {action.recv_next, false, TensorKind::kGradient, next_rank(r), "recv_next"},
    };
    bool any = false;
    for (const Slot& slot : slots) {
      if (!slot.tensor.present()) continue;
      any = true;
      const PipelineTransfer& t = slot.tensor;
      if (t.peer != slot.peer) {
        return fail(where(r, state.pc) + ": " + slot.name + " names peer " + std::to_string(t.peer) + ", expected " +
                    std::to_string(slot.peer));
      }
      if (!in_range(t.microbatch, t.chunk)) return fail(where(r, state.pc) + ": micro-batch or chunk out of range");
      if (slot.is_send) {
        const bool is_activation = slot.kind == TensorKind::kActivation;
        if (is_activation && r == pp_ - 1 && t.chunk == vpp_ - 1) {
          return fail(where(r, state.pc) + ": the last virtual stage has no activation to send");
        }
        if (!is_activation && r == 0 && t.chunk == 0) {
          return fail(where(r, state.pc) + ": the first virtual stage has no gradient to send");
        }
        if (!at(is_activation ? state.forwarded : state.backwarded, t.microbatch, t.chunk)) {
          return fail(where(r, state.pc) + ": sends a tensor not computed yet");
        }
      }
      const int sender = slot.is_send ? r : slot.peer;
      const int receiver = slot.is_send ? slot.peer : r;
      Channel& channel = channels_[{sender, receiver, static_cast<int>(slot.kind)}];
      std::vector<Post>& mine = slot.is_send ? channel.sends : channel.recvs;
      const size_t index = mine.size();
      mine.push_back(Post{state.clock, r, static_cast<int>(state.pc), t});
      const bool waited = !slot.is_send || sends_ == SendCompletion::kRendezvous;
      state.pending.push_back(PendingPart{&channel, index, slot.is_send, waited, slot.kind, t});
      const std::vector<Post>& other = slot.is_send ? channel.recvs : channel.sends;
      if (index < other.size()) {
        const Post& send = slot.is_send ? mine[index] : other[index];
        const Post& recv = slot.is_send ? other[index] : mine[index];
        if (!check_match(sender, slot.kind, send, recv)) return false;
      }
    }
    if (!any) return fail(where(r, state.pc) + ": a p2p call with nothing to send or receive");
    return true;
  }

  // The receive must be for the tensor the send carries: same micro-batch, and the chunk of the next virtual stage
  // (activation) or the previous one (gradient); crossing between the last and the first rank changes the chunk.
  bool check_match(const int sender, const TensorKind kind, const Post& send, const Post& recv) {
    int expected_chunk = send.tensor.chunk;
    if (kind == TensorKind::kActivation && sender == pp_ - 1) expected_chunk += 1;
    if (kind == TensorKind::kGradient && sender == 0) expected_chunk -= 1;
    if (recv.tensor.microbatch != send.tensor.microbatch || recv.tensor.chunk != expected_chunk) {
      return fail(where(recv.rank, static_cast<size_t>(recv.action)) + " is matched with " +
                  where(send.rank, static_cast<size_t>(send.action)) + ": the received tensor is not the one sent");
    }
    ++transfers_;
    return true;
  }

  void check_complete(PipelineSimulation& result) {
    for (const auto& [key, channel] : channels_) {
      if (channel.sends.size() != channel.recvs.size()) {
        const auto [sender, receiver, kind] = key;
        fail(std::string(kind == static_cast<int>(TensorKind::kActivation) ? "activations" : "gradients") +
             " from rank " + std::to_string(sender) + " to rank " + std::to_string(receiver) + ": " +
             std::to_string(channel.sends.size()) + " sent, " + std::to_string(channel.recvs.size()) + " received");
        return;
      }
    }
    for (int r = 0; r < pp_; ++r) {
      RankState& state = ranks_[static_cast<size_t>(r)];
      for (int chunk = 0; chunk < vpp_; ++chunk) {
        for (int mb = 0; mb < num_microbatches_; ++mb) {
          if (!at(state.forwarded, mb, chunk) || (!forward_only_ && !at(state.backwarded, mb, chunk))) {
            fail("rank " + std::to_string(r) + " never " +
                 (at(state.forwarded, mb, chunk) ? "backwarded" : "forwarded") + " mb " + std::to_string(mb) +
                 " chunk " + std::to_string(chunk));
            return;
          }
        }
      }
    }
    result.transfers = transfers_;
  }

  const std::vector<PipelineSchedule>& schedules_;
  const PipelineCosts costs_;
  const SendCompletion sends_;
  const int pp_;
  int vpp_ = 1;
  int num_microbatches_ = 0;
  bool forward_only_ = false;
  std::vector<RankState> ranks_;
  std::map<std::tuple<int, int, int>, Channel> channels_;  // (sender, receiver, kind)
  std::string error_;
  int64_t transfers_ = 0;
};

}  // namespace

PipelineSimulation simulate_pipeline(const std::vector<PipelineSchedule>& schedules, const PipelineCosts& costs,
                                     const SendCompletion sends) {
  return Simulator(schedules, costs, sends).run();
}

double analytic_bubble_fraction(const int pp_size, const int vpp_size, const int num_microbatches) {
  const double bubble = pp_size - 1;
  return bubble / (static_cast<double>(vpp_size) * num_microbatches + bubble);
}

}  // namespace moecore
