// Router replay (Megatron's --moe-enable-routing-replay, megatron/core/transformer/moe/router_replay.py): recording the
// experts each router chose, and routing later forwards by a recording instead of by the scores.
//
// Megatron's actions on tensors moecore keeps per micro-batch:
//   RECORD           moecore generate --record-routing: RoutingRecorder collects each decoder MoE router's top-k
//                    selection (before capacity dropping, in selection order) for every position fed to the model;
//   REPLAY_FORWARD   moecore train --moe-routing-replay-file: each training micro-batch gets a RoutingReplayBatch,
//                    the recorded experts of its tokens; the router takes them as its top-k selection and gathers
//                    their probabilities from its live scores (normalisation and scaling as usual), so the router
//                    weights still learn (moe_utils.py topk_routing_with_score_function's compute_topk);
//   REPLAY_BACKWARD  a recompute (--recompute-modules moe, full recomputation) routes by the same recorded experts:
//                    they stay with the router's saved activations.
// Routers are numbered in model order over the decoder's MoE layers (Megatron's global_router_replay_instances;
// MTP depths are not recorded by inference, so replay refuses --mtp-num-layers).
#pragma once

#include <cstdint>
#include <span>
#include <string>
#include <unordered_map>
#include <vector>

#include "moecore/model/config.h"
#include "moecore/model/token_rows.h"
#include "moecore/moe/routing_recording.h"
#include "moecore/tensor/tensor.h"

namespace moecore {

// The global decoder layer numbers of the MoE layers, in model order (router r is layer router_layers[r]).
std::vector<int64_t> moe_router_layers(const ModelConfig& config);

// The recorded experts of one micro-batch, every router: [S * B one-process rows t = s * B + b][routers][topk].
struct RoutingReplayBatch {
  int64_t S = 0, B = 0, routers = 0, topk = 0;
  std::vector<int32_t> experts;

  // Router `router`'s selection for the local rows `rows` (empty: rows 0..T-1) of T: kI32 [T, topk].
  Tensor local_selection(int64_t router, const TokenRows& rows, int64_t T) const;
};

// A recording indexed for training samples. Fixed-length samples of S input tokens: sample x (x_0 .. x_{S-1}) replays
// the first record (in file order) whose first S tokens are x and which has routing for at least S of them. Whole
// samples (--sample-data-path): a sample replays the first record whose tokens are exactly the sample's (RL: the
// rollout as the inference engine generated it); its positions the record did not route (the last token, never fed
// in inference) select from the scores.
class RoutingReplaySource {
 public:
  // Reads `path` and checks it against the model: the same MoE layers, top-k and experts. ConfigError (one line)
  // otherwise.
  RoutingReplaySource(const std::string& path, const ModelConfig& config, bool whole_samples = false);

  // The table of a micro-batch of B samples (tokens_BS sample-major, S each). ConfigError naming the first sample
  // without a record (its index `first_sample` + b in the training samples).
  RoutingReplayBatch batch(std::span<const int32_t> tokens_BS, int64_t B, int64_t first_sample) const;
  // "" when every sample of tokens_BS has a record, else the one-line reason (no exception: for agreeing ranks).
  std::string missing(std::span<const int32_t> tokens_BS, int64_t B, int64_t first_sample) const;

  int64_t num_records() const { return static_cast<int64_t>(recording_.records.size()); }
  const RoutingRecording& recording() const { return recording_; }
  const std::string& path() const { return path_; }
  // Whole samples: the record of exactly these tokens (null: none).
  const RoutingRecord* find_sample(std::span<const int32_t> tokens) const;

 private:
  const RoutingRecord* find(std::span<const int32_t> tokens_S) const;

  std::string path_;
  int64_t S_ = 0;
  RoutingRecording recording_;
  std::unordered_multimap<uint64_t, size_t> by_prefix_;  // FNV-1a of a record's first S tokens -> record
  std::unordered_multimap<uint64_t, size_t> by_tokens_;  // whole samples: FNV-1a of a record's tokens -> record
};

// `moecore generate --record-routing`: one sequence's routing as the model's forwards produce it. Before each forward
// the caller says which sequence position its first row is; each MoE router of the forward reports its selection, and
// the first routing of every position is kept (a re-run of the context, without the key / value cache, routes the
// earlier positions again).
class RoutingRecorder {
 public:
  explicit RoutingRecorder(const ModelConfig& config);

  void begin_forward(int64_t first_position) { first_position_ = first_position; }
  // selected_TK kI32 [T, topk]: the router's top-k selection for rows first_position .. first_position + T - 1.
  void record(int64_t router, const Tensor& selected_TK);
  // The record of `tokens`: routing for the positions every router has reported from 0 on.
  RoutingRecord finish(std::vector<int32_t> tokens) const;
  // A recording holding no record yet, of this model's routers.
  RoutingRecording empty_recording() const;

 private:
  int64_t topk_ = 0, num_experts_ = 0;
  std::vector<int64_t> router_layers_;
  int64_t first_position_ = 0;
  std::vector<std::vector<int32_t>> experts_;  // per router: [positions][topk]
};

// Appends `record` to the recording at `path` (a new file when there is none), atomically. ConfigError when the file
// exists but is corrupt or records another model's routers.
void append_routing_record(const std::string& path, const RoutingRecording& empty, RoutingRecord record);

}  // namespace moecore
