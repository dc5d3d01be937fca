#include "moecore/util/torch_save.h"

#include <bit>
#include <cstring>
#include <filesystem>
#include <span>
#include <stdexcept>

#include "moecore/util/atomic_file.h"
#include "moecore/util/checksum.h"
#include "moecore/util/little_endian.h"

namespace moecore {

PyValue PyValue::boolean(const bool value) {
  PyValue out(Kind::kBool);
  out.int_ = value ? 1 : 0;
  return out;
}

PyValue PyValue::integer(const int64_t value) {
  PyValue out(Kind::kInt);
  out.int_ = value;
  return out;
}

PyValue PyValue::string(std::string value) {
  PyValue out(Kind::kString);
  out.string_ = std::move(value);
  return out;
}

PyValue PyValue::tuple(std::vector<PyValue> items) {
  PyValue out(Kind::kTuple);
  out.items_ = std::move(items);
  return out;
}

PyValue PyValue::dict(std::vector<std::pair<PyValue, PyValue>> items) {
  PyValue out(Kind::kDict);
  for (auto& [key, value] : items) {
    out.items_.push_back(std::move(key));
    out.items_.push_back(std::move(value));
  }
  return out;
}

PyValue PyValue::float_tensor(std::vector<int64_t> shape, std::vector<float> values) {
  int64_t count = 1;
  for (const int64_t extent : shape) count *= extent;
  if (count != static_cast<int64_t>(values.size())) {
    throw std::invalid_argument("torch tensor: " + std::to_string(values.size()) + " values for a shape of " +
                                std::to_string(count));
  }
  PyValue out(Kind::kFloatTensor);
  out.shape_ = std::move(shape);
  out.values_ = std::move(values);
  return out;
}

namespace {

// Pickle protocol 2 (Python's pickle module: the opcodes below are those of its pickletools listing).
class Pickler {
 public:
  std::string bytes = std::string("\x80\x02", 2);   // PROTO 2
  std::vector<const std::vector<float>*> storages;  // data/<k> in order

  void value(const PyValue& v) {
    switch (v.kind()) {
      case PyValue::Kind::kNone: bytes += 'N'; return;
      case PyValue::Kind::kBool: bytes += v.bool_value() ? '\x88' : '\x89'; return;
      case PyValue::Kind::kInt: integer(v.int_value()); return;
      case PyValue::Kind::kString: string(v.string_value()); return;
      case PyValue::Kind::kTuple: tuple(v.items()); return;
      case PyValue::Kind::kDict:
        bytes += '}';  // EMPTY_DICT
        if (v.items().empty()) return;
        bytes += '(';  // MARK
        for (const PyValue& item : v.items()) value(item);
        bytes += 'u';  // SETITEMS
        return;
      case PyValue::Kind::kFloatTensor: tensor(v); return;
    }
  }

 private:
  void integer(const int64_t value) {
    if (value >= 0 && value < 256) {
      bytes += 'K';  // BININT1
      append_little_endian(bytes, static_cast<uint64_t>(value), 1);
    } else if (value >= INT32_MIN && value <= INT32_MAX) {
      bytes += 'J';  // BININT
      append_little_endian(bytes, static_cast<uint32_t>(static_cast<int32_t>(value)), 4);
    } else {
      bytes += '\x8a';  // LONG1: little-endian two's complement
      bytes += '\x08';
      append_little_endian(bytes, static_cast<uint64_t>(value), 8);
    }
  }
  void string(const std::string& text) {
    bytes += 'X';  // BINUNICODE
    append_little_endian(bytes, text.size(), 4);
    bytes += text;
  }
  void global(const char* module, const char* name) {
    bytes += 'c';  // GLOBAL
    bytes += module;
    bytes += '\n';
    bytes += name;
    bytes += '\n';
  }
  void tuple(const std::vector<PyValue>& items) {
    if (items.empty()) {
      bytes += ')';  // EMPTY_TUPLE
      return;
    }
    bytes += '(';
    for (const PyValue& item : items) value(item);
    bytes += 't';  // TUPLE
  }
  void ints(const std::vector<int64_t>& values) {
    bytes += '(';
    for (const int64_t v : values) integer(v);
    bytes += 't';
  }
  // torch._utils._rebuild_tensor_v2(storage, 0, size, stride, False, OrderedDict())
  void tensor(const PyValue& v) {
    global("torch._utils", "_rebuild_tensor_v2");
    bytes += '(';
    bytes += '(';  // the storage's persistent id: ('storage', torch.FloatStorage, key, 'cpu', numel)
    string("storage");
    global("torch", "FloatStorage");
    string(std::to_string(storages.size()));
    string("cpu");
    integer(static_cast<int64_t>(v.values().size()));
    bytes += 't';
    bytes += 'Q';  // BINPERSID
    storages.push_back(&v.values());
    integer(0);
    ints(v.shape());
    std::vector<int64_t> stride(v.shape().size(), 1);
    for (size_t i = v.shape().size(); i-- > 1;) stride[i - 1] = stride[i] * v.shape()[i];
    ints(stride);
    bytes += '\x89';  // False
    global("collections", "OrderedDict");
    bytes += ')';
    bytes += 'R';  // REDUCE
    bytes += 't';
    bytes += 'R';
  }
};

// A stored zip archive of (name, bytes) entries: local headers, the central directory and its end record.
std::string zip_archive(const std::vector<std::pair<std::string, std::string>>& entries) {
  std::string out, directory;
  for (const auto& [name, data] : entries) {
    if (data.size() > UINT32_MAX - out.size()) throw std::runtime_error("torch.save: file over 4 GiB");
    const uint32_t crc = crc32_of(std::as_bytes(std::span(data.data(), data.size()))),
                   offset = static_cast<uint32_t>(out.size());
    const auto header = [&](std::string& to, const bool central) {
      append_little_endian(to, central ? 0x02014b50u : 0x04034b50u, 4);
      if (central) append_little_endian(to, 20, 2);  // version made by
      append_little_endian(to, 20, 2);               // version needed
      append_little_endian(to, 0, 2);                // flags
      append_little_endian(to, 0, 2);                // method: stored
      append_little_endian(to, 0, 4);                // time, date
      append_little_endian(to, crc, 4);
      append_little_endian(to, data.size(), 4);
      append_little_endian(to, data.size(), 4);
      append_little_endian(to, name.size(), 2);
      append_little_endian(to, 0, 2);  // extra
      if (central) {
        append_little_endian(to, 0, 2);  // comment
        append_little_endian(to, 0, 2);  // disk
        append_little_endian(to, 0, 2);  // internal attributes
        append_little_endian(to, 0, 4);  // external attributes
        append_little_endian(to, offset, 4);
      }
      to += name;
    };
    header(out, false);
    out += data;
    header(directory, true);
  }
  const auto directory_offset = static_cast<uint32_t>(out.size());
  out += directory;
  append_little_endian(out, 0x06054b50u, 4);
  append_little_endian(out, 0, 4);  // disks
  append_little_endian(out, entries.size(), 2);
  append_little_endian(out, entries.size(), 2);
  append_little_endian(out, directory.size(), 4);
  append_little_endian(out, directory_offset, 4);
  append_little_endian(out, 0, 2);  // comment
  return out;
}

}  // namespace

void write_torch_save(const std::string& path, const PyValue& value) {
  Pickler pickler;
  pickler.value(value);
  pickler.bytes += '.';  // STOP
  const std::string archive = std::filesystem::path(path).stem().string();
  std::vector<std::pair<std::string, std::string>> entries;
  entries.emplace_back(archive + "/data.pkl", pickler.bytes);
  for (size_t k = 0; k < pickler.storages.size(); ++k) {
    std::string data;
    data.reserve(pickler.storages[k]->size() * 4);
    for (const float x : *pickler.storages[k]) append_little_endian(data, std::bit_cast<uint32_t>(x), 4);
    entries.emplace_back(archive + "/data/" + std::to_string(k), std::move(data));
  }
  entries.emplace_back(archive + "/version", "3\n");
  if (const std::string problem = replace_file(path, zip_archive(entries)); !problem.empty()) {
    throw std::runtime_error(problem);
  }
}

}  // namespace moecore
