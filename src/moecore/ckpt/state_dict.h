// A state dict: the ordered, named tensors and scalars that make up a training run's state on this rank, each with
// its GLOBAL shape (the one-process tensor) and where this rank's local tensor sits in it. It is what a checkpoint
// saves and loads, and what resharding reads (the local pieces of every rank, placed by their placements, rebuild
// the global tensors of any layout). The model's part is built here (parameters and buffers); the trainer adds the
// optimizer, scheduler and progress sections (train/training_state.h).
//
// Placement of a local tensor, in two steps (Megatron's ShardedTensor with a flattened_range):
//   1. the tensor-parallel cut: `shard` (a ParamShard: dimension, segments, num_shards, shard_index) selects this
//      rank's slice of the global tensor; num_shards 1 means the whole tensor (replicated entries);
//   2. optionally a flat range [flat_begin, flat_end) of that slice in row-major order (the distributed optimizer's
//      piece of a parameter); without it the local tensor is the whole slice.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "moecore/model/param.h"
#include "moecore/tensor/tensor.h"

namespace moecore {

struct StatePlacement {
  ParamShard shard;        // shard.full_shape is the entry's global shape
  int64_t flat_begin = 0;  // with flat_end >= 0: elements [flat_begin, flat_end) of the shard's slice
  int64_t flat_end = -1;   // -1: the whole slice
  bool flat() const { return flat_end >= 0; }
};

struct StateEntry {
  std::string key;  // global key, the same on every rank and in every layout
  DType dtype = DType::kF32;
  std::vector<int64_t> global_shape;  // [] for a scalar
  StatePlacement placement;
  // This rank's values: shard_shape(placement.shard), or [flat_end - flat_begin] with a flat range. Tensor entries
  // are views of the live state (writing them writes the model / optimizer); scalar entries are copies.
  Tensor local;
};

// Elements of a shape ([] has one) and its text "[2, 3]", for the checkpoint code's messages.
int64_t shape_numel(const std::vector<int64_t>& shape);
std::string shape_text(const std::vector<int64_t>& shape);

// Number of elements of this rank's local tensor for `placement`.
int64_t local_numel(const StatePlacement& placement);
// Row-major flat index in the global tensor of flat local element `local_index`.
int64_t global_index(const StatePlacement& placement, int64_t local_index);

class StateDict {
 public:
  // Appends `entry`; throws std::logic_error for a key already present, a placement whose global shape differs from
  // global_shape, or a local tensor of another dtype or element count than the placement gives.
  void add(StateEntry entry);
  // A tensor entry from a live tensor (a view, not a copy) placed by `placement` (global shape =
  // placement.shard.full_shape).
  void add_tensor(std::string key, const Tensor& local, const StatePlacement& placement);
  // Scalars: shape [], dtype int64 / float64, replicated.
  void add_i64(std::string key, int64_t value);
  void add_f64(std::string key, double value);

  const std::vector<StateEntry>& entries() const { return entries_; }
  size_t size() const { return entries_.size(); }
  bool contains(const std::string& key) const { return find(key) != nullptr; }
  const StateEntry* find(const std::string& key) const;  // null when absent
  const StateEntry& at(const std::string& key) const;    // throws std::out_of_range naming the key
  int64_t i64(const std::string& key) const;             // a scalar entry's value (throws for another dtype)
  double f64(const std::string& key) const;
  std::vector<std::string> keys() const;  // in entry order

 private:
  std::vector<StateEntry> entries_;
};

class GPTModel;
// Every parameter under its name (fp32, placed by Param::shard) then every buffer under its name, in the model's
// registration order. Routed-expert parameters carry their global expert index in the name, so an EP rank lists only
// its experts. The entries are views of the model's tensors.
void add_model_state(StateDict& state, const GPTModel& model);

}  // namespace moecore
