// moecore's sharded checkpoint format ("moecore_sharded", version 1), documented in docs/checkpoint-format.md.
//
// One iteration folder holds rank_NNNNN.safetensors files (only what each rank owns: no gather to one rank) and
// metadata.json, which names every global tensor (key, dtype, global shape) and its pieces: file, tensor name in
// that file, the piece's box in the global tensor (offsets and shape), an optional flat range of the box (a
// distributed-optimizer slice) and a CRC-32 of its bytes. A piece held by several ranks (a replicated tensor) is
// written once, by one of them chosen by a hash of the piece so the work spreads over the replicas (Megatron's fully
// parallel save). Any layout loads it by reading the pieces that overlap its own (state_source.h).
//
// Saving (collective over the world): every rank writes into ITER.tmp/, rank 0 then writes metadata.json, fsyncs and
// renames ITER.tmp to ITER, and only then is the tracker updated (checkpoint_dir.h): a save killed at any moment
// leaves the previous checkpoint and its tracker intact. With async, the bytes are copied first and written by a
// background thread; finalize() completes the save once every rank has written.
#pragma once

#include <atomic>
#include <cstdint>
#include <exception>
#include <map>
#include <memory>
#include <nlohmann/json.hpp>
#include <stdexcept>
#include <string>
#include <thread>
#include <vector>

#include "moecore/ckpt/checkpoint_metadata.h"
#include "moecore/ckpt/state_source.h"
#include "moecore/parallel/process_group.h"

namespace moecore {

// What metadata.json records besides the tensors.
struct CheckpointInfo {
  int64_t iteration = 0;
  nlohmann::ordered_json layout = nlohmann::ordered_json::object();  // the parallel layout of the save
  nlohmann::ordered_json args = nlohmann::ordered_json::object();    // training arguments (see train/checkpointing)
};

class ShardedSave {
 public:
  // Collective over `world`: plans which rank writes each piece of `state`, creates ROOT/iter_N.tmp (rank 0) and
  // writes this rank's file, in a background thread with `async` (the bytes copied first, so training may go on).
  // Throws parallel::GroupFailure on every rank when any rank fails (its message names the file and the OS error);
  // ITER.tmp is then removed.
  ShardedSave(const StateDict& state, const parallel::ProcessGroup& world, std::string root, CheckpointInfo info,
              bool async);
  ~ShardedSave();
  ShardedSave(const ShardedSave&) = delete;
  ShardedSave& operator=(const ShardedSave&) = delete;

  // Collective. Non-blocking: returns false while any rank is still writing. Otherwise (or blocking) waits for this
  // rank's writer, then rank 0 writes metadata.json, moves the folder into place and updates the tracker. Returns
  // true once done (and on every later call). Throws parallel::GroupFailure on every rank when any rank failed (the
  // tracker is then unchanged, ITER.tmp removed).
  bool finalize(bool blocking);
  bool finalized() const { return finalized_; }
  int64_t iteration() const { return info_.iteration; }
  std::string final_dir() const;

 private:
  struct Piece {
    std::string key;
    DType dtype = DType::kF32;
    std::vector<int64_t> global_shape;
    StateBox box;
    std::string name;  // in this rank's file
    Tensor values;     // a view of the live state, or a copy with async
    std::string crc32;
  };
  void write_file();            // this rank's pieces -> rank_NNNNN.safetensors (runs in the thread with async)
  void complete();              // every rank written: metadata.json, the folder moved into place, the tracker
  void discard_partial_save();  // after a failure: rank 0 removes ITER.tmp

  parallel::ProcessGroup world_;
  std::string root_;
  CheckpointInfo info_;
  std::vector<Piece> pieces_;
  std::string file_name_;
  std::string file_crc32_;
  int64_t bytes_written_ = 0;
  std::thread writer_;
  std::exception_ptr writer_error_;
  std::atomic<bool> writer_done_{false};
  bool finalized_ = false;
};

// A saved iteration folder, read with the checks of the format (docs/checkpoint-format.md "What a reader checks"):
// metadata.json validated field by field (checkpoint_metadata.h), every file present with its recorded size, a valid
// safetensors file whose entries are exactly the metadata's pieces, and its recorded CRC-32 consistent with its
// header and its pieces' CRC-32s; each tensor's pieces holding each element once; pieces read on demand and checked
// against their CRC-32. Every problem is a CheckpointError naming the file (and field or tensor).
class ShardedCheckpoint final : public StateSource {
 public:
  explicit ShardedCheckpoint(std::string iter_dir);

  int64_t iteration() const { return iteration_; }
  const nlohmann::ordered_json& metadata() const { return metadata_; }
  const std::string& dir() const { return dir_; }
  std::vector<std::string> keys() const { return order_; }
  // Reads every file whole and every piece: CRC-32 of each file and piece. Throws on the first damage.
  void verify() const;
  // The stored scalar `key` (shape []) as int64 / float64.
  int64_t i64(const std::string& key) const;
  double f64(const std::string& key) const;

  std::string description() const override { return "checkpoint " + dir_; }
  std::optional<StoredTensorInfo> info(const std::string& key) const override;
  std::vector<StoredPiece> pieces(const std::string& key) const override;

 private:
  struct StoredFile {
    int64_t bytes = 0;
    std::string crc32;
    int64_t data_start = 0;                                      // 8 + header length
    std::map<std::string, std::pair<int64_t, int64_t>> offsets;  // tensor name -> [begin, end) in the byte buffer
  };
  struct Piece {
    std::string file;
    std::string name;
    StateBox box;
    std::string crc32;
  };
  struct Stored {
    StoredTensorInfo info;
    std::vector<Piece> pieces;
  };
  // Each file's size, safetensors header (entries = the metadata's pieces) and recorded CRC-32.
  void check_files();
  Tensor read_piece(const std::string& key, const Stored& stored, const Piece& piece) const;
  [[noreturn]] void fail(const std::string& file, const std::string& problem) const;

  std::string dir_;
  nlohmann::ordered_json metadata_;
  int64_t iteration_ = 0;
  std::map<std::string, StoredFile> files_;
  std::vector<std::string> order_;
  std::map<std::string, Stored> tensors_;
};

}  // namespace moecore
