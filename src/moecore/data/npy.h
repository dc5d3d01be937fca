// Minimal NumPy .npy reader/writer for the integer index arrays Megatron caches (format 1.0 written exactly as
// numpy.save writes it; 1.0 and 2.0 read). C order, little-endian integers only.
#pragma once

#include <cstdint>
#include <string>
#include <string_view>
#include <vector>

namespace moecore {

enum class NpyDType { kI2, kI4, kI8, kU2, kU4 };  // '<i2', '<i4', '<i8', '<u2', '<u4'

struct NpyArray {
  NpyDType dtype = NpyDType::kI8;
  std::vector<int64_t> shape;
  std::vector<int64_t> values;  // widened to int64, C order
};

// The bytes numpy.save would write for this array; throws DataError when a value does not fit `dtype`.
std::string npy_encode(NpyDType dtype, const std::vector<int64_t>& shape, const std::vector<int64_t>& values);
// Parses .npy bytes; `name` (the file) only appears in error messages.
NpyArray npy_decode(std::string_view bytes, const std::string& name);

void save_npy_atomic(const std::string& path, NpyDType dtype, const std::vector<int64_t>& shape,
                     const std::vector<int64_t>& values);
NpyArray load_npy(const std::string& path);

}  // namespace moecore
