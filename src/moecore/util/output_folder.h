// Whether a run can write a folder it was given (--save, --export-hf), found out before it spends time training:
// what is checked is what the writers later do (std::filesystem::create_directories, then files inside).
#pragma once

#include <string>

namespace moecore {

// Why `dir` cannot be created and written, or "" when it can. An existing `dir` must be a folder in which a file can
// be created (probed by creating and removing a temporary file); a missing one needs its nearest existing ancestor to
// be such a folder (create_directories makes the rest). Creates nothing that outlives the call.
std::string folder_write_problem(const std::string& dir);

}  // namespace moecore
