// Router replay recordings (Megatron's --moe-enable-routing-replay, megatron/core/transformer/moe/router_replay.py):
// the experts each MoE router chose for every token of a set of sequences, as `moecore generate --record-routing`
// writes them and `moecore train --moe-routing-replay-file` replays them. Megatron's inference engine returns the same
// information per request (RoutingMetadata: int32 [tokens - 1, MoE layers, top-k], the last token never fed) and leaves
// persisting it to the caller; this is moecore's file for it.
//
// File format (little-endian; docs/generation.md "Routing recordings"):
//   header  "MOEROUTE" (8 bytes), u32 version (1), u32 routers R, u32 topk k, u32 experts E,
//           R x u32: each router's global decoder layer number (in model order), u64 records N,
//           u32 CRC-32 of the header bytes before it
//   record  u32 tokens n, u32 routed r (<= n: the first r tokens were fed to the model), n x i32 token ids,
//           r x R x k x i32 expert ids (token-major, then router, then the router's selection order),
//           u32 CRC-32 of the record's bytes before it
// Every expert id is in [0, E) and the k ids of one token and router are distinct. A file that breaks any of this
// (wrong magic or version, a truncated record, a CRC mismatch, trailing bytes, an id out of range) is refused with
// one line naming the file and the problem.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

namespace moecore {

struct RoutingRecord {
  std::vector<int32_t> tokens;   // the sequence, prompt and generated tokens
  int64_t routed = 0;            // how many leading tokens have routing (were fed to the model)
  std::vector<int32_t> experts;  // [routed][routers][topk]
};

struct RoutingRecording {
  int64_t topk = 0, num_experts = 0;
  std::vector<int64_t> router_layers;  // each router's global decoder layer number, in model order
  std::vector<RoutingRecord> records;

  int64_t num_routers() const { return static_cast<int64_t>(router_layers.size()); }
  // The k experts router `router` chose for token `token` of record `record`.
  const int32_t* experts_of(const RoutingRecord& record, int64_t token, int64_t router) const {
    return record.experts.data() + (token * num_routers() + router) * topk;
  }
};

// Reads and checks a recording. Throws ConfigError (one line: the path and the problem) when the file is missing,
// unreadable or corrupt.
RoutingRecording read_routing_recording(const std::string& path);

// Writes `recording` to `path` atomically (util/atomic_file.h). Throws ConfigError for an inconsistent recording and
// FileWriteError when the write fails.
void write_routing_recording(const std::string& path, const RoutingRecording& recording);

// The one-line reason `recording` is inconsistent, or "" (sizes, expert ids in range and distinct per token).
std::string routing_recording_problem(const RoutingRecording& recording);

}  // namespace moecore
