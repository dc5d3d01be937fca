#include "moecore/ckpt/state_source.h"

#include <algorithm>
#include <cstring>
#include <stdexcept>
#include <utility>

namespace moecore {
namespace {

double load_as_double(const std::byte* base, const DType dtype, const int64_t i) {
  switch (dtype) {
    case DType::kF32: return reinterpret_cast<const float*>(base)[i];
    case DType::kF64: return reinterpret_cast<const double*>(base)[i];
    case DType::kBF16: return bf16_to_fp32(reinterpret_cast<const uint16_t*>(base)[i]);
    case DType::kF16: return fp16_to_fp32(reinterpret_cast<const uint16_t*>(base)[i]);
    case DType::kI32: return reinterpret_cast<const int32_t*>(base)[i];
    case DType::kI64: return static_cast<double>(reinterpret_cast<const int64_t*>(base)[i]);
    case DType::kU8: return reinterpret_cast<const uint8_t*>(base)[i];
  }
  return 0.0;
}

void store_double(std::byte* base, const DType dtype, const int64_t i, const double v) {
  switch (dtype) {
    case DType::kF32: reinterpret_cast<float*>(base)[i] = static_cast<float>(v); return;
    case DType::kF64: reinterpret_cast<double*>(base)[i] = v; return;
    case DType::kBF16: reinterpret_cast<uint16_t*>(base)[i] = fp32_to_bf16(static_cast<float>(v)); return;
    case DType::kF16: reinterpret_cast<uint16_t*>(base)[i] = fp32_to_fp16(static_cast<float>(v)); return;
    case DType::kI32: reinterpret_cast<int32_t*>(base)[i] = static_cast<int32_t>(v); return;
    case DType::kI64: reinterpret_cast<int64_t*>(base)[i] = static_cast<int64_t>(v); return;
    case DType::kU8: reinterpret_cast<uint8_t*>(base)[i] = static_cast<uint8_t>(v); return;
  }
}

// Copies n elements from source[s] to target[t]: bytes when the dtypes agree, else converted element by element.
void copy_run(const Tensor& source, const int64_t s, Tensor& target, const int64_t t, const int64_t n) {
  const auto* src = source.data<std::byte>();
  auto* dst = target.data<std::byte>();
  if (source.dtype() == target.dtype()) {
    const size_t size = dtype_size(source.dtype());
    std::memcpy(dst + t * size, src + s * size, static_cast<size_t>(n) * size);
    return;
  }
  for (int64_t i = 0; i < n; ++i) store_double(dst, target.dtype(), t + i, load_as_double(src, source.dtype(), s + i));
}

}  // namespace

int64_t StateBox::box_numel() const { return shape_numel(shape); }
int64_t StateBox::numel() const { return flat() ? flat_end - flat_begin : box_numel(); }

std::vector<PlacedBox> placement_boxes(const StatePlacement& placement) {
  const ParamShard& shard = placement.shard;
  const std::vector<int64_t>& full = shard.full_shape;
  std::vector<StateBox> boxes;
  if (full.empty() || shard.num_shards == 1) {
    boxes.push_back(StateBox{std::vector<int64_t>(full.size(), 0), full});
  } else {
    if (shard.segments > 1 && shard.dim != 0) {
      throw std::logic_error("a state placement of several segments along dimension " + std::to_string(shard.dim) +
                             " has no box decomposition");
    }
    const auto dim = static_cast<size_t>(shard.dim);
    const int64_t segment_extent = full[dim] / shard.segments;
    const int64_t chunk = segment_extent / shard.num_shards;
    for (int s = 0; s < shard.segments; ++s) {
      StateBox box{std::vector<int64_t>(full.size(), 0), full};
      box.offsets[dim] = s * segment_extent + shard.shard_index * chunk;
      box.shape[dim] = chunk;
      boxes.push_back(std::move(box));
    }
  }
  std::vector<PlacedBox> out;
  int64_t begin = 0;  // of the box in the local slice's row-major order
  for (StateBox& box : boxes) {
    const int64_t n = box.box_numel();
    if (!placement.flat()) {
      out.push_back(PlacedBox{std::move(box), begin});
    } else {
      const int64_t lo = std::max(begin, placement.flat_begin);
      const int64_t hi = std::min(begin + n, placement.flat_end);
      if (lo < hi) {
        box.flat_begin = lo - begin;
        box.flat_end = hi - begin;
        out.push_back(PlacedBox{std::move(box), lo - placement.flat_begin});
      }
    }
    begin += n;
  }
  return out;
}

int64_t copy_box_overlap(const StateBox& source_box, const Tensor* source, const StateBox& target_box, Tensor* target,
                         const int64_t target_begin) {
  const size_t rank = target_box.shape.size();
  if (source_box.shape.size() != rank) throw std::logic_error("copy_box_overlap: boxes of different ranks");
  if (rank == 0) {  // scalars
    if (source && target) copy_run(*source, 0, *target, target_begin, 1);
    return 1;
  }
  std::vector<int64_t> lo(rank), hi(rank);
  for (size_t d = 0; d < rank; ++d) {
    lo[d] = std::max(source_box.offsets[d], target_box.offsets[d]);
    hi[d] = std::min(source_box.offsets[d] + source_box.shape[d], target_box.offsets[d] + target_box.shape[d]);
    if (lo[d] >= hi[d]) return 0;
  }
  const int64_t s_first = source_box.flat() ? source_box.flat_begin : 0;
  const int64_t s_end = source_box.flat() ? source_box.flat_end : source_box.box_numel();
  const int64_t t_first = target_box.flat() ? target_box.flat_begin : 0;
  const int64_t t_end = target_box.flat() ? target_box.flat_end : target_box.box_numel();
  // Walk the rows of the overlap (every dimension but the last); each row is one run in both boxes.
  std::vector<int64_t> at = lo;
  const int64_t run = hi[rank - 1] - lo[rank - 1];
  int64_t copied = 0;
  while (true) {
    int64_t s_index = 0, t_index = 0;  // row-major index of `at` in each box
    for (size_t d = 0; d < rank; ++d) {
      s_index = s_index * source_box.shape[d] + (at[d] - source_box.offsets[d]);
      t_index = t_index * target_box.shape[d] + (at[d] - target_box.offsets[d]);
    }
    // Clip the run to both flat ranges: positions k in [0, run) with s_index + k and t_index + k inside them.
    const int64_t k_lo = std::max({int64_t{0}, s_first - s_index, t_first - t_index});
    const int64_t k_hi = std::min({run, s_end - s_index, t_end - t_index});
    if (k_lo < k_hi) {
      if (source && target) {
        copy_run(*source, s_index + k_lo - s_first, *target, target_begin + t_index + k_lo - t_first, k_hi - k_lo);
      }
      copied += k_hi - k_lo;
    }
    int d = static_cast<int>(rank) - 2;
    for (; d >= 0; --d) {
      if (++at[static_cast<size_t>(d)] < hi[static_cast<size_t>(d)]) break;
      at[static_cast<size_t>(d)] = lo[static_cast<size_t>(d)];
    }
    if (d < 0) break;
  }
  return copied;
}

void load_state(const StateSource& source, const StateDict& target,
                const std::function<bool(const StateEntry&)>& select,
                const std::function<bool(const std::string&)>& rows_may_differ) {
  for (const StateEntry& entry : target.entries()) {
    if (select && !select(entry)) continue;
    const auto fail = [&](const std::string& problem) {
      throw std::runtime_error(source.description() + ": " + problem + " of " + entry.key);
    };
    const std::optional<StoredTensorInfo> info = source.info(entry.key);
    if (!info) fail("no tensor");
    const std::vector<int64_t>& stored_shape = info->global_shape;
    bool rows_differ = false;
    if (stored_shape != entry.global_shape) {
      rows_differ = rows_may_differ && rows_may_differ(entry.key) && !stored_shape.empty() &&
                    stored_shape.size() == entry.global_shape.size() &&
                    std::equal(stored_shape.begin() + 1, stored_shape.end(), entry.global_shape.begin() + 1);
      if (!rows_differ)
        fail("global shape " + shape_text(stored_shape) + " instead of " + shape_text(entry.global_shape));
    }
    const std::vector<PlacedBox> wanted = placement_boxes(entry.placement);
    int64_t needed = 0;  // the wanted elements inside the stored tensor
    const StateBox stored_whole{std::vector<int64_t>(stored_shape.size(), 0), stored_shape};
    for (const PlacedBox& w : wanted) {
      needed += rows_differ ? copy_box_overlap(stored_whole, nullptr, w.box, nullptr, 0) : w.box.numel();
    }
    if (needed == 0) continue;
    Tensor local = entry.local;  // a view: writing it writes the live state
    int64_t copied = 0;
    for (const StoredPiece& piece : source.pieces(entry.key)) {
      bool overlaps = false;
      for (const PlacedBox& w : wanted) {
        bool disjoint = false;
        for (size_t d = 0; d < w.box.shape.size(); ++d) {
          disjoint |= piece.box.offsets[d] >= w.box.offsets[d] + w.box.shape[d] ||
                      w.box.offsets[d] >= piece.box.offsets[d] + piece.box.shape[d];
        }
        overlaps |= !disjoint;
      }
      if (!overlaps) continue;
      const Tensor values = piece.read();
      if (values.numel() != piece.box.numel()) fail("a stored piece of the wrong size");
      for (const PlacedBox& w : wanted) copied += copy_box_overlap(piece.box, &values, w.box, &local, w.local_begin);
    }
    // Stored pieces never overlap (each element is written once), so the count says whether all were found.
    if (copied != needed) {
      fail(std::to_string(copied) + " of the " + std::to_string(needed) + " elements this rank needs (pieces missing)");
    }
  }
}

Tensor read_global_tensor(const StateSource& source, const std::string& key, const DType dtype) {
  const std::optional<StoredTensorInfo> info = source.info(key);
  if (!info) throw std::runtime_error(source.description() + ": no tensor " + key);
  StateDict one;
  StatePlacement whole;
  whole.shard.full_shape = info->global_shape;
  one.add_tensor(key, Tensor(info->global_shape, dtype), whole);
  load_state(source, one);
  return one.entries().front().local;
}

void GlobalTensorSource::add(const std::string& key, StoredTensorInfo info, std::function<Tensor()> produce) {
  if (items_.contains(key)) throw std::logic_error(description_ + ": tensor " + key + " added twice");
  order_.push_back(key);
  items_.emplace(key, Item{std::move(info), std::move(produce)});
}

void GlobalTensorSource::add_tensor(const std::string& key, const Tensor& global) {
  add(key, StoredTensorInfo{global.dtype(), global.shape()}, [global] { return global; });
}

std::vector<std::string> GlobalTensorSource::keys() const { return order_; }

std::optional<StoredTensorInfo> GlobalTensorSource::info(const std::string& key) const {
  const auto it = items_.find(key);
  if (it == items_.end()) return std::nullopt;
  return it->second.info;
}

std::vector<StoredPiece> GlobalTensorSource::pieces(const std::string& key) const {
  const auto it = items_.find(key);
  if (it == items_.end()) return {};
  const Item& item = it->second;
  StoredPiece piece;
  piece.box.offsets.assign(item.info.global_shape.size(), 0);
  piece.box.shape = item.info.global_shape;
  piece.read = [this, key, produce = item.produce, shape = item.info.global_shape] {
    Tensor t = produce();
    if (t.shape() != shape) {
      throw std::runtime_error(description_ + ": " + key + " came out as " + shape_text(t.shape()) + " instead of " +
                               shape_text(shape));
    }
    return t;
  };
  return {piece};
}

}  // namespace moecore
