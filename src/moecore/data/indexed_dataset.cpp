// Megatron's .idx layout (all little-endian):
//   "MMIDIDX\0\0" | u64 version = 1 | u8 dtype code | u64 sequence count S | u64 document count D
//   | i32 sequence_lengths[S] | i64 sequence_pointers[S] (byte offsets into .bin) | i64 document_indices[D]
// D counts the boundaries, so it is the number of documents + 1, and document_indices starts at 0 and ends at S.
#include "moecore/data/indexed_dataset.h"

#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <bit>
#include <cerrno>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <limits>
#include <utility>

namespace moecore {

static_assert(std::endian::native == std::endian::little, "the .idx/.bin formats are little-endian");

namespace {

constexpr char kIndexMagic[9] = {'M', 'M', 'I', 'D', 'I', 'D', 'X', '\0', '\0'};
constexpr uint64_t kIndexVersion = 1;
constexpr int64_t kIndexHeaderBytes = 9 + 8 + 1 + 8 + 8;
constexpr size_t kWriteChunkBytes = size_t{1} << 20;  // token bytes buffered before a write

std::string bin_path(const std::string& prefix) { return prefix + ".bin"; }
std::string idx_path(const std::string& prefix) { return prefix + ".idx"; }
const char* dtype_name(IndexedDType dtype) {
  switch (dtype) {
    case IndexedDType::kU8: return "uint8";
    case IndexedDType::kI8: return "int8";
    case IndexedDType::kI16: return "int16";
    case IndexedDType::kI32: return "int32";
    case IndexedDType::kI64: return "int64";
    case IndexedDType::kF64: return "float64";
    case IndexedDType::kF32: return "float32";
    case IndexedDType::kU16: return "uint16";
  }
  return "unknown";
}

int64_t dtype_bytes(IndexedDType dtype) {
  switch (dtype) {
    case IndexedDType::kU8:
    case IndexedDType::kI8: return 1;
    case IndexedDType::kI16:
    case IndexedDType::kU16: return 2;
    case IndexedDType::kI32:
    case IndexedDType::kF32: return 4;
    case IndexedDType::kI64:
    case IndexedDType::kF64: return 8;
  }
  return 0;
}

bool is_integer_dtype(IndexedDType dtype) { return dtype != IndexedDType::kF32 && dtype != IndexedDType::kF64; }

// Inclusive range of token ids the dtype can hold (token ids are int32 in memory).
std::pair<int64_t, int64_t> dtype_range(IndexedDType dtype) {
  switch (dtype) {
    case IndexedDType::kU8: return {0, 255};
    case IndexedDType::kI8: return {-128, 127};
    case IndexedDType::kI16: return {-32768, 32767};
    case IndexedDType::kU16: return {0, 65535};
    default: return {std::numeric_limits<int32_t>::min(), std::numeric_limits<int32_t>::max()};
  }
}

template <typename T>
void append_le(std::string& out, T value) {
  char bytes[sizeof(T)];
  std::memcpy(bytes, &value, sizeof(T));
  out.append(bytes, sizeof(T));
}

template <typename T>
T load(const char* ptr) {
  T value;
  std::memcpy(&value, ptr, sizeof(T));
  return value;
}

// Widens `count` elements of `dtype` at `src` to int32; int64 values outside int32 are an error.
void widen_tokens(IndexedDType dtype, const char* src, int64_t count, int32_t* dst, const std::string& path) {
  for (int64_t k = 0; k < count; ++k) {
    switch (dtype) {
      case IndexedDType::kU8: dst[k] = load<uint8_t>(src + k); break;
      case IndexedDType::kI8: dst[k] = load<int8_t>(src + k); break;
      case IndexedDType::kI16: dst[k] = load<int16_t>(src + 2 * k); break;
      case IndexedDType::kU16: dst[k] = load<uint16_t>(src + 2 * k); break;
      case IndexedDType::kI32: dst[k] = load<int32_t>(src + 4 * k); break;
      case IndexedDType::kI64: {
        const int64_t value = load<int64_t>(src + 8 * k);
        if (value < std::numeric_limits<int32_t>::min() || value > std::numeric_limits<int32_t>::max()) {
          throw DataError(path + ": token id " + std::to_string(value) + " does not fit in int32");
        }
        dst[k] = static_cast<int32_t>(value);
        break;
      }
      default: throw DataError(path + ": float dtype cannot hold token ids");
    }
  }
}

}  // namespace

IndexedDType optimal_token_dtype(int64_t vocab_size) {
  return vocab_size < 65500 ? IndexedDType::kU16 : IndexedDType::kI32;
}

// ---------------------------------------------------------------------------------------------------------------
// Writer

IndexedDatasetWriter::IndexedDatasetWriter(std::string prefix, IndexedDType dtype)
    : prefix_(std::move(prefix)), dtype_(dtype) {
  if (!is_integer_dtype(dtype_) || dtype_bytes(dtype_) == 0) {
    throw DataError(idx_path(prefix_) + ": token dtype must be an integer type, got " + dtype_name(dtype_));
  }
  try {
    bin_.emplace(bin_path(prefix_));
  } catch (const FileWriteError& e) {
    throw DataError(bin_path(prefix_) + ": " + e.what());
  }
}

// An unfinished dataset leaves no temporary behind (AtomicFile) and never touches a previous PREFIX.bin/.idx.
IndexedDatasetWriter::~IndexedDatasetWriter() = default;

void IndexedDatasetWriter::flush_pending() {
  try {
    bin_->write(pending_);
  } catch (const FileWriteError& e) {
    throw DataError(bin_path(prefix_) + ": " + e.what());
  }
  pending_.clear();
}

void IndexedDatasetWriter::add_sequence(const std::vector<int32_t>& tokens) {
  if (finalized_) throw DataError(bin_path(prefix_) + ": add_sequence after finalize");
  if (tokens.size() > static_cast<size_t>(std::numeric_limits<int32_t>::max())) {
    throw DataError(bin_path(prefix_) + ": sequence of " + std::to_string(tokens.size()) +
                    " tokens exceeds the int32 length field");
  }
  const auto [lo, hi] = dtype_range(dtype_);
  std::string& bytes = pending_;
  for (const int32_t token : tokens) {
    if (token < lo || token > hi) {
      throw DataError(bin_path(prefix_) + ": token id " + std::to_string(token) + " does not fit dtype " +
                      dtype_name(dtype_));
    }
    switch (dtype_) {
      case IndexedDType::kU8: append_le(bytes, static_cast<uint8_t>(token)); break;
      case IndexedDType::kI8: append_le(bytes, static_cast<int8_t>(token)); break;
      case IndexedDType::kI16: append_le(bytes, static_cast<int16_t>(token)); break;
      case IndexedDType::kU16: append_le(bytes, static_cast<uint16_t>(token)); break;
      case IndexedDType::kI32: append_le(bytes, static_cast<int32_t>(token)); break;
      case IndexedDType::kI64: append_le(bytes, static_cast<int64_t>(token)); break;
      default: break;  // rejected in the constructor
    }
  }
  if (pending_.size() >= kWriteChunkBytes) flush_pending();
  sequence_lengths_.push_back(static_cast<int32_t>(tokens.size()));
}

void IndexedDatasetWriter::end_document() {
  if (finalized_) throw DataError(bin_path(prefix_) + ": end_document after finalize");
  document_indices_.push_back(static_cast<int64_t>(sequence_lengths_.size()));
}

void IndexedDatasetWriter::finalize() {
  if (finalized_) return;
  flush_pending();

  const uint64_t sequence_count = sequence_lengths_.size();
  const uint64_t document_count = document_indices_.size();
  std::string header;
  header.reserve(static_cast<size_t>(kIndexHeaderBytes) + sequence_count * 12 + document_count * 8);
  header.append(kIndexMagic, sizeof(kIndexMagic));
  append_le<uint64_t>(header, kIndexVersion);
  append_le<uint8_t>(header, static_cast<uint8_t>(dtype_));
  append_le<uint64_t>(header, sequence_count);
  append_le<uint64_t>(header, document_count);
  for (const int32_t length : sequence_lengths_) append_le<int32_t>(header, length);
  int64_t pointer = 0;
  for (const int32_t length : sequence_lengths_) {
    append_le<int64_t>(header, pointer);
    pointer += static_cast<int64_t>(length) * dtype_bytes(dtype_);
  }
  for (const int64_t index : document_indices_) append_le<int64_t>(header, index);

  try {
    AtomicFile idx(idx_path(prefix_));
    idx.write(header);
    bin_->commit();
    idx.commit();
  } catch (const FileWriteError& e) {
    throw DataError(prefix_ + ": " + e.what());
  }
  finalized_ = true;
}

// ---------------------------------------------------------------------------------------------------------------
// Reader

struct IndexedDataset::Mapping {
  const char* data = nullptr;
  size_t size = 0;
  Mapping(const Mapping&) = delete;
  Mapping& operator=(const Mapping&) = delete;
  Mapping(const std::string& path, size_t expected_size) {
    const int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
    if (fd < 0) throw DataError(path + ": cannot open: " + std::strerror(errno));
    struct stat info {};
    if (::fstat(fd, &info) != 0) {
      ::close(fd);
      throw DataError(path + ": cannot stat: " + std::strerror(errno));
    }
    if (!S_ISREG(info.st_mode)) {
      ::close(fd);
      throw DataError(path + (S_ISDIR(info.st_mode) ? " is a folder" : " is not a regular file") +
                      ", not the dataset's token file");
    }
    size = static_cast<size_t>(info.st_size);
    if (size < expected_size) {
      ::close(fd);
      throw DataError(path + " is truncated: expected " + std::to_string(expected_size) + " bytes, found " +
                      std::to_string(size));
    }
    if (size > expected_size) {
      ::close(fd);
      throw DataError(path + ": has " + std::to_string(size) + " bytes but its .idx describes " +
                      std::to_string(expected_size) + " (index and data files do not belong together)");
    }
    if (size > 0) {
      void* mapped = ::mmap(nullptr, size, PROT_READ, MAP_SHARED, fd, 0);
      if (mapped == MAP_FAILED) {
        ::close(fd);
        throw DataError(path + ": mmap failed: " + std::strerror(errno));
      }
      data = static_cast<const char*>(mapped);
    }
    ::close(fd);  // the mapping stays valid without the descriptor
  }
  ~Mapping() {
    if (data != nullptr) ::munmap(const_cast<char*>(data), size);
  }
};

IndexedDataset::IndexedDataset(const std::string& prefix) : prefix_(prefix) {
  const std::string path = idx_path(prefix_);
  if (std::error_code ec; std::filesystem::exists(path, ec) && !std::filesystem::is_regular_file(path, ec)) {
    throw DataError(path + (std::filesystem::is_directory(path, ec) ? " is a folder" : " is not a regular file") +
                    ", not the dataset's index file");
  }
  std::ifstream idx(path, std::ios::binary | std::ios::ate);
  if (!idx) throw DataError(path + ": cannot open: " + std::strerror(errno));
  const int64_t file_size = static_cast<int64_t>(idx.tellg());
  idx.seekg(0);
  // The header first; the arrays are read straight into their vectors once the sizes are known to fit.
  std::string bytes(static_cast<size_t>(std::min<int64_t>(file_size, kIndexHeaderBytes)), '\0');
  idx.read(bytes.data(), static_cast<std::streamsize>(bytes.size()));
  if (!idx) throw DataError(path + ": read failed");

  if (file_size < 9 || std::memcmp(bytes.data(), kIndexMagic, 9) != 0) {
    throw DataError(path + ": bad magic (not a Megatron MMIDIDX index)");
  }
  if (file_size < kIndexHeaderBytes) {
    throw DataError(path + " is truncated: expected at least " + std::to_string(kIndexHeaderBytes) +
                    " header bytes, found " + std::to_string(file_size));
  }
  const uint64_t version = load<uint64_t>(bytes.data() + 9);
  if (version != kIndexVersion) {
    throw DataError(path + ": unsupported version " + std::to_string(version) + " (expected 1)");
  }
  const uint8_t code = load<uint8_t>(bytes.data() + 17);
  if (code < 1 || code > 8) throw DataError(path + ": unknown dtype code " + std::to_string(code));
  dtype_ = static_cast<IndexedDType>(code);
  if (!is_integer_dtype(dtype_)) {
    throw DataError(path + ": dtype " + std::string(dtype_name(dtype_)) + " cannot hold token ids");
  }
  const uint64_t sequence_count = load<uint64_t>(bytes.data() + 18);
  const uint64_t document_count = load<uint64_t>(bytes.data() + 26);
  // Guard the size arithmetic below against absurd counts from a corrupt header.
  constexpr uint64_t kMaxCount = uint64_t{1} << 56;
  if (sequence_count > kMaxCount || document_count > kMaxCount) {
    throw DataError(path + ": corrupt header (sequence count " + std::to_string(sequence_count) + ", document count " +
                    std::to_string(document_count) + ")");
  }
  const int64_t num_sequences = static_cast<int64_t>(sequence_count);
  const int64_t num_boundaries = static_cast<int64_t>(document_count);
  const int64_t expected_size = kIndexHeaderBytes + num_sequences * (4 + 8) + num_boundaries * 8;
  if (file_size < expected_size) {
    throw DataError(path + " is truncated: expected " + std::to_string(expected_size) + " bytes for " +
                    std::to_string(num_sequences) + " sequences and " + std::to_string(num_boundaries) +
                    " document indices, found " + std::to_string(file_size));
  }
  if (file_size > expected_size) {
    throw DataError(path + ": size mismatch: expected " + std::to_string(expected_size) + " bytes for " +
                    std::to_string(num_sequences) + " sequences and " + std::to_string(num_boundaries) +
                    " document indices, found " + std::to_string(file_size));
  }

  const auto read_array = [&](auto& values, int64_t count) {
    values.resize(static_cast<size_t>(count));
    idx.read(reinterpret_cast<char*>(values.data()),
             static_cast<std::streamsize>(count * static_cast<int64_t>(sizeof(values[0]))));
    if (!idx) throw DataError(path + ": read failed");
  };
  read_array(sequence_lengths_, num_sequences);
  read_array(sequence_pointers_, num_sequences);
  read_array(document_indices_, num_boundaries);

  // Sequences are stored back to back, so the pointers are the running byte sums of the lengths.
  const int64_t item_bytes = dtype_bytes(dtype_);
  int64_t expected_pointer = 0;
  for (int64_t i = 0; i < num_sequences; ++i) {
    const int32_t length = sequence_lengths_[static_cast<size_t>(i)];
    if (length < 0) throw DataError(path + ": sequence " + std::to_string(i) + " has negative length");
    if (sequence_pointers_[static_cast<size_t>(i)] != expected_pointer) {
      throw DataError(path + ": sequence " + std::to_string(i) + " pointer is " +
                      std::to_string(sequence_pointers_[static_cast<size_t>(i)]) + ", expected " +
                      std::to_string(expected_pointer) + " from the lengths before it");
    }
    expected_pointer += static_cast<int64_t>(length) * item_bytes;
  }
  if (num_boundaries < 1 || document_indices_.front() != 0) {
    throw DataError(path + ": document indices must start at 0");
  }
  for (int64_t d = 1; d < num_boundaries; ++d) {
    if (document_indices_[static_cast<size_t>(d)] < document_indices_[static_cast<size_t>(d - 1)]) {
      throw DataError(path + ": document indices are not monotone at entry " + std::to_string(d));
    }
  }
  if (document_indices_.back() != num_sequences) {
    throw DataError(path + ": last document index is " + std::to_string(document_indices_.back()) +
                    ", expected the sequence count " + std::to_string(num_sequences));
  }
  bin_ = std::make_unique<Mapping>(bin_path(prefix_), static_cast<size_t>(expected_pointer));
}

IndexedDataset::~IndexedDataset() = default;

std::vector<int32_t> IndexedDataset::get(int64_t i, int64_t offset, int64_t length) const {
  if (i < 0 || i >= num_sequences()) {
    throw DataError(bin_path(prefix_) + ": sequence " + std::to_string(i) + " out of range [0, " +
                    std::to_string(num_sequences()) + ")");
  }
  const int64_t sequence_length = sequence_lengths_[static_cast<size_t>(i)];
  if (length < 0) length = sequence_length - offset;
  if (offset < 0 || length < 0 || offset + length > sequence_length) {
    throw DataError(bin_path(prefix_) + ": tokens [" + std::to_string(offset) + ", " + std::to_string(offset + length) +
                    ") out of range for sequence " + std::to_string(i) + " of length " +
                    std::to_string(sequence_length));
  }
  std::vector<int32_t> tokens(static_cast<size_t>(length));
  if (length > 0) {
    const int64_t item_bytes = dtype_bytes(dtype_);
    const char* src = bin_->data + sequence_pointers_[static_cast<size_t>(i)] + offset * item_bytes;
    widen_tokens(dtype_, src, length, tokens.data(), bin_path(prefix_));
  }
  return tokens;
}

}  // namespace moecore
