// MoE routing traces, as Megatron's RouterTracer (megatron/core/transformer/moe/router_trace.py) in training mode:
// each rank appends to <dir>/router_trace_rank<r>.jsonl one record per MoE layer and training forward (micro-batch)
// of the traced iterations,
//   {"step": 0, "stage": "pre_dispatch", "block": "decoder", "layer": 3, "rank": 0, "num_tokens": 128, "topk": 2,
//    "top_indices": [[12, 45], ...]}
// with Megatron's field order (an MTP depth's layer adds "mtp_idx"). top_indices are each token's experts in the
// routing map, ascending, as Megatron reads them from the map (nonzero per row); a micro-batch whose map does not give
// every token exactly top-k experts (tokens dropped by a capacity factor) has no record, as in Megatron. Optional
// sidecars: hidden_states_rank<r>.bin (the router's input, bf16 [num_tokens, hidden]) and logits_rank<r>.bin (the
// router's logits, bf16 [num_tokens, experts]), each record then naming its bytes (hs_offset / hs_bytes / hs_shape,
// logit_offset / logit_bytes / logit_shape). With dump_router_weights, finish() writes router_state_rank<r>.pt
// (torch.save's format, util/torch_save.h): per router, keyed by (block, mtp_idx or None, layer), its fp32 "weight"
// [E, H] and "expert_bias" [E] (None without one) as of its first traced forward, its "score_function" and "topk".
//
// Differences from Megatron, where its behaviour follows from Python hooks rather than intent: evaluation forwards
// and recomputation are not traced (a hook would file them under the next training step), layer numbers are the
// model's global ones under pipeline parallelism, and the logits are those the routing used (after the input jitter).
#pragma once

#include <cstdint>
#include <fstream>
#include <optional>
#include <span>
#include <string>
#include <vector>

#include "moecore/tensor/tensor.h"

namespace moecore {

struct RouterTraceOptions {
  std::string dir;                     // --moe-routing-trace-path
  int64_t max_steps = 0;               // iterations traced: --moe-routing-trace-max-training-iters, else --train-iters
  int rank = 0;                        // global rank
  bool capture_hidden_states = false;  // --moe-routing-trace-capture-hidden-states
  bool capture_logits = false;         // --moe-routing-trace-capture-logits
  bool dump_router_weights = false;    // --moe-routing-trace-dump-weights
};

// A router's state for router_state_rank<r>.pt.
struct RouterTraceWeights {
  const Tensor& weight_EH;               // any float dtype
  std::span<const float> expert_bias_E;  // empty: none
  std::string score_function;            // "softmax", "sigmoid", ...
};

// Which router a record comes from.
struct RouterTraceSite {
  bool mtp = false;                // block "mtp" (a Multi-Token Prediction depth), else "decoder"
  int64_t layer = 0;               // decoder: the global layer number; MTP: 0 (one layer per depth)
  std::optional<int64_t> mtp_idx;  // the MTP depth
};

class RouterTracer {
 public:
  // Creates the folder and empties this rank's files. Throws std::runtime_error naming the path it cannot write.
  explicit RouterTracer(RouterTraceOptions options);
  ~RouterTracer();
  RouterTracer(const RouterTracer&) = delete;
  RouterTracer& operator=(const RouterTracer&) = delete;

  // Whether training forwards are being traced (until max_steps steps have been written).
  bool active() const { return steps_written_ < options_.max_steps; }
  // One router call of a training forward: routing_map_TE kU8 [T, E]; hidden_TH [T, H] (the router's input) and
  // logits_TE [T, E] in any float dtype, read only for the sidecars asked for.
  void record(const RouterTraceSite& site, const Tensor& routing_map_TE, int64_t topk, const Tensor& hidden_TH,
              const Tensor& logits_TE, const RouterTraceWeights& weights);
  // After an iteration's forwards and backwards (Megatron's advance_step(iteration)): the buffered records are stamped
  // with `step` and written; the files are flushed. Throws std::runtime_error when a write fails.
  void advance_step(int64_t step);

  // At the end of the run: writes router_state_rank<r>.pt when asked for. Throws std::runtime_error when the write
  // fails.
  void finish();

  int64_t records_written() const { return records_written_; }
  int64_t records_left_out() const { return records_left_out_; }  // maps without top-k experts for every token

 private:
  struct Record {
    RouterTraceSite site;
    int64_t num_tokens = 0, topk = 0;
    std::vector<int32_t> top_indices;  // [num_tokens * topk]
    std::optional<int64_t> hs_offset, hs_bytes, hidden;
    std::optional<int64_t> logit_offset, logit_bytes, experts;
  };
  static int64_t append_bf16(std::ofstream& file, const std::string& path, const Tensor& x, int64_t& offset);
  void write(const Record& record, int64_t step);

  RouterTraceOptions options_;
  std::string jsonl_path_, hidden_path_, logits_path_;
  std::ofstream jsonl_, hidden_, logits_;
  int64_t hidden_offset_ = 0, logits_offset_ = 0;
  std::vector<Record> pending_;
  struct RouterState {
    RouterTraceSite site;
    std::vector<int64_t> weight_shape;
    std::vector<float> weight, expert_bias;
    std::string score_function;
    int64_t topk = 0;
  };
  std::vector<RouterState> router_states_;  // in first-record order
  int64_t steps_written_ = 0;
  int64_t records_written_ = 0, records_left_out_ = 0;
};

}  // namespace moecore
