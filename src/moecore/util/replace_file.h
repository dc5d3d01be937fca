// A whole file written so that a failure (a full disk, an I/O error) never leaves a partial file under its name: the
// bytes go to a temporary beside it (unique per process and call), fsynced, then renamed over it.
#pragma once

#include <string>
#include <string_view>

namespace moecore {

// "" once `path` holds `bytes`; otherwise what failed and the OS error ("write failed: No space left on device"), with
// the temporary removed and `path` as it was.
std::string replace_file(const std::string& path, std::string_view bytes);

}  // namespace moecore
