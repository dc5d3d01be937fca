#include "moecore/util/torch_save.h"

#include <array>
#include <bit>
#include <cstring>
#include <filesystem>
#include <stdexcept>

#include "moecore/util/atomic_file.h"

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

void append_le(std::string& out, const uint64_t value, const int bytes) {
  for (int i = 0; i < bytes; ++i) out.push_back(static_cast<char>((value >> (8 * i)) & 0xFF));
}

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
      append_le(bytes, static_cast<uint64_t>(value), 1);
    } else if (value >= INT32_MIN && value <= INT32_MAX) {
      bytes += 'J';  // BININT
      append_le(bytes, static_cast<uint32_t>(static_cast<int32_t>(value)), 4);
    } else {
      bytes += '\x8a';  // LONG1: little-endian two's complement
      bytes += '\x08';
      append_le(bytes, static_cast<uint64_t>(value), 8);
    }
  }
  void string(const std::string& text) {
    bytes += 'X';  // BINUNICODE
    append_le(bytes, text.size(), 4);
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

constexpr std::array<uint32_t, 256> make_crc32_table() {
  std::array<uint32_t, 256> table{};
  for (uint32_t byte = 0; byte < 256; ++byte) {
    uint32_t crc = byte;
    for (int bit = 0; bit < 8; ++bit) crc = (crc & 1) != 0 ? (crc >> 1) ^ 0xEDB88320u : crc >> 1;
    table[byte] = crc;
  }
  return table;
}

// The zip format's CRC-32 (IEEE 802.3, reflected).
uint32_t crc32_of(const std::string& bytes) {
  static constexpr std::array<uint32_t, 256> kTable = make_crc32_table();
  uint32_t crc = 0xFFFFFFFFu;
  for (const char c : bytes) crc = kTable[(crc ^ static_cast<uint8_t>(c)) & 0xFF] ^ (crc >> 8);
  return ~crc;
}

// A stored zip archive of (name, bytes) entries: local headers, the central directory and its end record.
std::string zip_archive(const std::vector<std::pair<std::string, std::string>>& entries) {
  std::string out, directory;
  for (const auto& [name, data] : entries) {
    if (data.size() > UINT32_MAX - out.size()) throw std::runtime_error("torch.save: file over 4 GiB");
    const uint32_t crc = crc32_of(data), offset = static_cast<uint32_t>(out.size());
    const auto header = [&](std::string& to, const bool central) {
      append_le(to, central ? 0x02014b50u : 0x04034b50u, 4);
      if (central) append_le(to, 20, 2);  // version made by
      append_le(to, 20, 2);               // version needed
      append_le(to, 0, 2);                // flags
      append_le(to, 0, 2);                // method: stored
      append_le(to, 0, 4);                // time, date
      append_le(to, crc, 4);
      append_le(to, data.size(), 4);
      append_le(to, data.size(), 4);
      append_le(to, name.size(), 2);
      append_le(to, 0, 2);  // extra
      if (central) {
        append_le(to, 0, 2);  // comment
        append_le(to, 0, 2);  // disk
        append_le(to, 0, 2);  // internal attributes
        append_le(to, 0, 4);  // external attributes
        append_le(to, offset, 4);
      }
      to += name;
    };
    header(out, false);
    out += data;
    header(directory, true);
  }
  const auto directory_offset = static_cast<uint32_t>(out.size());
  out += directory;
  append_le(out, 0x06054b50u, 4);
  append_le(out, 0, 4);  // disks
  append_le(out, entries.size(), 2);
  append_le(out, entries.size(), 2);
  append_le(out, directory.size(), 4);
  append_le(out, directory_offset, 4);
  append_le(out, 0, 2);  // comment
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
    for (const float x : *pickler.storages[k]) append_le(data, std::bit_cast<uint32_t>(x), 4);
    entries.emplace_back(archive + "/data/" + std::to_string(k), std::move(data));
  }
  entries.emplace_back(archive + "/version", "3\n");
  if (const std::string problem = replace_file(path, zip_archive(entries)); !problem.empty()) {
    throw std::runtime_error(problem);
  }
}

}  // namespace moecore
