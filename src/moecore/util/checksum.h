// CRC-32 (ISO-HDLC, the polynomial of zlib, gzip and PNG: Python's zlib.crc32 gives the same value), as the 8-digit
// lowercase hex text a checkpoint's metadata stores.
#pragma once

#include <cstddef>
#include <cstdint>
#include <span>
#include <string>

namespace moecore {

uint32_t crc32_of(std::span<const std::byte> bytes, uint32_t running = 0);
std::string crc32_text(uint32_t crc);
// The CRC-32 of bytes A then B from crc32_of(A), crc32_of(B) and B's length (zlib's crc32_combine).
uint32_t crc32_combine_of(uint32_t first, uint32_t second, int64_t second_bytes);

}  // namespace moecore
