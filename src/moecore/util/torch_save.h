// Writing PyTorch's torch.save files (the zip format of PyTorch >= 1.6) for the small Python values moecore hands to
// PyTorch users: None, bools, integers, strings, tuples, dicts and fp32 tensors. The file is a stored (uncompressed)
// zip archive <name>/data.pkl (a pickle, protocol 2, whose tensors are torch._utils._rebuild_tensor_v2 calls on
// persistent storages), <name>/data/<k> (each storage's little-endian bytes) and <name>/version ("3"), which
// torch.load reads.
#pragma once

#include <cstdint>
#include <memory>
#include <string>
#include <utility>
#include <vector>

namespace moecore {

class PyValue {
 public:
  enum class Kind { kNone, kBool, kInt, kString, kTuple, kDict, kFloatTensor };

  static PyValue none() { return PyValue(Kind::kNone); }
  static PyValue boolean(bool value);
  static PyValue integer(int64_t value);
  static PyValue string(std::string value);
  static PyValue tuple(std::vector<PyValue> items);
  static PyValue dict(std::vector<std::pair<PyValue, PyValue>> items);  // keys in this order
  // A contiguous fp32 tensor of `shape` (values.size() = the shape's product).
  static PyValue float_tensor(std::vector<int64_t> shape, std::vector<float> values);

  Kind kind() const { return kind_; }
  bool bool_value() const { return int_ != 0; }
  int64_t int_value() const { return int_; }
  const std::string& string_value() const { return string_; }
  const std::vector<PyValue>& items() const { return items_; }  // a tuple's items; a dict's keys and values interleaved
  const std::vector<int64_t>& shape() const { return shape_; }
  const std::vector<float>& values() const { return values_; }

 private:
  explicit PyValue(const Kind kind) : kind_(kind) {}
  Kind kind_;
  int64_t int_ = 0;
  std::string string_;
  std::vector<PyValue> items_;
  std::vector<int64_t> shape_;
  std::vector<float> values_;
};

// Writes `value` as torch.save would to `path` (atomically: util/atomic_file.h). Throws std::runtime_error naming the
// path when it cannot be written.
void write_torch_save(const std::string& path, const PyValue& value);

}  // namespace moecore
