// A folder replaced at once, as AtomicFile replaces a file: the new contents are written into a temporary folder
// beside the target, then swapped in, so an interrupted save never loses the last complete copy.
#pragma once

#include <string>

#include "moecore/util/atomic_file.h"

namespace moecore {

// Puts the finished folder `tmp` in place of `target` (on one filesystem) and removes what `target` held. Where the
// kernel offers an atomic exchange (renameat2 RENAME_EXCHANGE), `target` always names a complete folder; otherwise
// the previous copy is moved to TARGET.old for the instant between two renames, and put back if the second fails.
// Throws FileWriteError naming both paths and the OS error; `target` is then as it was.
void replace_directory(const std::string& tmp, const std::string& target);

namespace detail {
// The two-rename fallback of replace_directory, exposed for its tests.
void replace_directory_by_renames(const std::string& tmp, const std::string& target);
}  // namespace detail

}  // namespace moecore
