// Megatron's indexed dataset: PREFIX.bin holds the token ids of every sequence back to back; PREFIX.idx
// (header "MMIDIDX\0\0", version 1) holds the token dtype, sequence lengths, byte pointers and document
// boundaries. Files written here load in Megatron unchanged and vice versa.
#pragma once

#include <cstdint>
#include <memory>
#include <optional>
#include <stdexcept>
#include <string>
#include <vector>

#include "moecore/util/atomic_file.h"

namespace moecore {

// Missing, truncated or corrupt dataset files: one line naming the file and the problem.
class DataError : public std::runtime_error {
 public:
  using std::runtime_error::runtime_error;
};

// Megatron's DType codes in the .idx header.
enum class IndexedDType : uint8_t { kU8 = 1, kI8 = 2, kI16 = 3, kI32 = 4, kI64 = 5, kF64 = 6, kF32 = 7, kU16 = 8 };

// uint16 when the vocabulary fits (Megatron: vocab_size < 65500), else int32.
IndexedDType optimal_token_dtype(int64_t vocab_size);

class IndexedDatasetWriter {
 public:
  IndexedDatasetWriter(std::string prefix, IndexedDType dtype);  // opens PREFIX.bin for writing
  ~IndexedDatasetWriter();  // without finalize(): removes the temporary, leaves any old PREFIX.bin/.idx alone
  IndexedDatasetWriter(IndexedDatasetWriter&&) = default;
  IndexedDatasetWriter& operator=(IndexedDatasetWriter&&) = default;
  void add_sequence(const std::vector<int32_t>& tokens);  // one sequence (sentence)
  void end_document();                                    // closes the current document
  void add_document(const std::vector<int32_t>& tokens) {
    add_sequence(tokens);
    end_document();
  }
  // Writes PREFIX.idx. Both files are written to temporaries and renamed into place here, atomically.
  void finalize();

 private:
  std::string prefix_;
  IndexedDType dtype_;
  std::optional<AtomicFile> bin_;  // PREFIX.bin, put in place by finalize()
  std::string pending_;            // token bytes not yet written
  std::vector<int32_t> sequence_lengths_;
  std::vector<int64_t> document_indices_{0};
  bool finalized_ = false;

  void flush_pending();
};

// Memory-mapped reader. Validates the header, sizes and pointers on open; throws DataError.
class IndexedDataset {
 public:
  explicit IndexedDataset(const std::string& prefix);
  ~IndexedDataset();
  IndexedDataset(const IndexedDataset&) = delete;
  IndexedDataset& operator=(const IndexedDataset&) = delete;

  const std::string& prefix() const { return prefix_; }
  int64_t num_sequences() const { return static_cast<int64_t>(sequence_lengths_.size()); }
  // Boundaries into the sequences: document d is sequences [document_indices[d], document_indices[d+1]).
  const std::vector<int64_t>& document_indices() const { return document_indices_; }
  const std::vector<int32_t>& sequence_lengths() const { return sequence_lengths_; }
  IndexedDType dtype() const { return dtype_; }
  // Tokens [offset, offset + length) of sequence i, widened to int32; throws DataError when out of range.
  std::vector<int32_t> get(int64_t i, int64_t offset = 0, int64_t length = -1) const;

 private:
  std::string prefix_;
  IndexedDType dtype_ = IndexedDType::kU16;
  std::vector<int32_t> sequence_lengths_;
  std::vector<int64_t> sequence_pointers_;
  std::vector<int64_t> document_indices_;
  struct Mapping;
  std::unique_ptr<Mapping> bin_;
};

}  // namespace moecore
