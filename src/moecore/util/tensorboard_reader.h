// Reading TensorBoard event files (the format of tensorboard_events.h): every TFRecord's two masked CRC-32C checked,
// each tensorflow.Event decoded (wall_time, step, file_version, summary values with simple_value); events other
// than scalars and unknown fields are skipped as protobuf readers skip them.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

namespace moecore {

struct TensorBoardScalar {
  std::string tag;
  int64_t step = 0;
  double value = 0.0;  // the stored float
  double wall_time = 0.0;
};

struct TensorBoardEvents {
  std::string file_version;  // "brain.Event:2"
  std::vector<TensorBoardScalar> scalars;
  // The file ends inside a record (a writer killed while writing): the records before it were read, as TensorBoard
  // reads them.
  bool truncated_tail = false;
};

// Throws std::runtime_error naming the file and the record's byte offset when a CRC does not match or an Event does
// not decode, and naming the OS error when the file cannot be read.
TensorBoardEvents read_tensorboard_events(const std::string& path);

// The event files (events.out.tfevents.*) directly in `dir`, sorted by name (their creation times come first).
std::vector<std::string> tensorboard_event_files(const std::string& dir);

}  // namespace moecore
