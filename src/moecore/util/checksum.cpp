#include "moecore/util/checksum.h"

#include <zlib.h>

#include <algorithm>
#include <cstdio>

namespace moecore {

uint32_t crc32_of(const std::span<const std::byte> bytes, const uint32_t running) {
  uLong crc = running;
  size_t done = 0;
  while (done < bytes.size()) {  // zlib takes uInt lengths
    const size_t n = std::min<size_t>(bytes.size() - done, size_t{1} << 30);
    crc = ::crc32(crc, reinterpret_cast<const Bytef*>(bytes.data() + done), static_cast<uInt>(n));
    done += n;
  }
  return static_cast<uint32_t>(crc);
}

uint32_t crc32_combine_of(const uint32_t first, const uint32_t second, const int64_t second_bytes) {
  return static_cast<uint32_t>(::crc32_combine(first, second, static_cast<z_off_t>(second_bytes)));
}

std::string crc32_text(const uint32_t crc) {
  char text[9];
  std::snprintf(text, sizeof text, "%08x", crc);
  return text;
}

}  // namespace moecore
