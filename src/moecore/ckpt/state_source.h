// Loading a StateDict from stored tensors of any layout.
//
// A stored tensor is a set of pieces; a piece is a box of the global tensor (per-dimension offsets and sizes) whose
// elements are stored in row-major order, optionally only the flat range [flat_begin, flat_end) of that box (a
// distributed-optimizer slice). A rank's local tensor is described the same way (placement_boxes), so loading a
// local tensor under any placement is copying, piece by piece, the intersection of the stored boxes with the local
// ones: checkpoints saved under one layout load under any other, and a whole global tensor (an HF file) is a
// single-piece source.
#pragma once

#include <cstdint>
#include <functional>
#include <map>
#include <optional>
#include <string>
#include <vector>

#include "moecore/ckpt/state_dict.h"

namespace moecore {

// A box of a global tensor with an optional flat range of its row-major elements. Scalars: empty offsets and shape
// (one element).
struct StateBox {
  std::vector<int64_t> offsets;
  std::vector<int64_t> shape;
  int64_t flat_begin = 0;
  int64_t flat_end = -1;  // -1: the whole box
  int64_t box_numel() const;
  int64_t numel() const;  // the elements present: box_numel() or flat_end - flat_begin
  bool flat() const { return flat_end >= 0; }
};

// The boxes of a placement, in the local tensor's row-major order (local element i of box k sits at
// local_begin[k] + i): one per segment of the tensor-parallel cut, each restricted to the placement's flat range
// (boxes the range misses are left out). Throws std::logic_error for a cut of several segments along a dimension
// other than 0 (whose local order interleaves the segments; no moecore parameter has one).
struct PlacedBox {
  StateBox box;
  int64_t local_begin = 0;
};
std::vector<PlacedBox> placement_boxes(const StatePlacement& placement);

// Copies the elements `source_box` and `target_box` share from `source` (source_box.numel() elements, any floating or
// integer dtype) into `target` starting at element `target_begin` (converted to target's dtype). Returns the number
// copied; with null `source` / `target` only counts them.
int64_t copy_box_overlap(const StateBox& source_box, const Tensor* source, const StateBox& target_box, Tensor* target,
                         int64_t target_begin);

struct StoredTensorInfo {
  DType dtype = DType::kF32;
  std::vector<int64_t> global_shape;
};

// A stored piece: its box, and how to get its values (called at most once per piece and load).
struct StoredPiece {
  StateBox box;
  std::function<Tensor()> read;
};

class StateSource {
 public:
  virtual ~StateSource() = default;
  // What the source is, for messages ("checkpoint /runs/a/iter_0000100").
  virtual std::string description() const = 0;
  virtual std::optional<StoredTensorInfo> info(const std::string& key) const = 0;
  virtual std::vector<StoredPiece> pieces(const std::string& key) const = 0;
};

// Fills the local tensor of every entry of `target` that `select` accepts (all when null) from `source`, converting
// dtypes. Throws std::runtime_error "<source>: <problem> of <key>" when the source lacks a key, holds it with another
// global shape, or its pieces do not cover every element the entry needs. Keys that `rows_may_differ` accepts may
// differ in their first dimension (a vocabulary padded for another TP size, as Megatron's allow_shape_mismatch):
// the rows both have are loaded, the others keep their values.
void load_state(const StateSource& source, const StateDict& target,
                const std::function<bool(const StateEntry&)>& select = nullptr,
                const std::function<bool(const std::string&)>& rows_may_differ = nullptr);

// The whole global tensor `key` of `source` as `dtype` (every piece read).
Tensor read_global_tensor(const StateSource& source, const std::string& key, DType dtype = DType::kF32);

// A source of whole global tensors, each produced on demand (HuggingFace import, upcycling).
class GlobalTensorSource : public StateSource {
 public:
  explicit GlobalTensorSource(std::string description) : description_(std::move(description)) {}
  // `produce` returns the global tensor (shape info.global_shape); it may be called once per load of the key.
  void add(const std::string& key, StoredTensorInfo info, std::function<Tensor()> produce);
  void add_tensor(const std::string& key, const Tensor& global);
  std::vector<std::string> keys() const;

  std::string description() const override { return description_; }
  std::optional<StoredTensorInfo> info(const std::string& key) const override;
  std::vector<StoredPiece> pieces(const std::string& key) const override;

 private:
  struct Item {
    StoredTensorInfo info;
    std::function<Tensor()> produce;
  };
  std::string description_;
  std::vector<std::string> order_;
  std::map<std::string, Item> items_;
};

}  // namespace moecore
