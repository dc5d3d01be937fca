// Little-endian integers in byte strings, as the binary formats moecore writes and reads store them (TFRecord
// lengths and CRCs, zip headers, pickles).
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>
#include <string_view>

namespace moecore {

// Appends the low `bytes` bytes of `value` to `out`, least significant first.
inline void append_little_endian(std::string& out, const uint64_t value, const int bytes) {
  for (int i = 0; i < bytes; ++i) out.push_back(static_cast<char>((value >> (8 * i)) & 0xFF));
}

// The unsigned integer stored little-endian in `bytes` (at most 8 of them).
inline uint64_t read_little_endian(const std::string_view bytes) {
  uint64_t value = 0;
  for (size_t i = 0; i < bytes.size(); ++i) value |= static_cast<uint64_t>(static_cast<uint8_t>(bytes[i])) << (8 * i);
  return value;
}

}  // namespace moecore
