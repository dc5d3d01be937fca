// TensorBoard event files: TensorFlow's events.out.tfevents.* format, which TensorBoard reads and tensorboardX and
// torch's SummaryWriter write. A file is a sequence of TFRecords (uint64 LE length of the data, uint32 LE masked
// CRC-32C of those 8 bytes, the data, uint32 LE masked CRC-32C of the data); each record's data is a serialized
// tensorflow.Event protobuf. The first record is {wall_time, file_version: "brain.Event:2"}; each scalar is then one
// Event {wall_time, step, summary {value {tag, simple_value}}}, its value stored as a float.
// Flushing: scalars are held in memory until max_queue of them are queued, flush() is called or the writer is
// destroyed; then they are handed to the OS (write(2), no fsync), so a process killed afterwards leaves them in the
// file, while a machine that crashes may lose them. scripts/read_tfevents.py decodes and checks such files.
#pragma once

#include <cstddef>
#include <cstdint>
#include <span>
#include <string>
#include <string_view>

namespace moecore {

class TensorBoardWriter {
 public:
  // Creates `dir` (and its parents) if missing and a new file events.out.tfevents.<secs>.<hostname>.<pid>.<n> in it
  // (n counts the writers of this process); writes the brain.Event:2 record and flushes it. max_queue: scalars held
  // in memory before they are written (Megatron's --tensorboard-queue-size), at least 1 (else std::invalid_argument).
  // Throws std::runtime_error naming the path and the OS error when the directory or the file cannot be made.
  explicit TensorBoardWriter(const std::string& dir, int64_t max_queue = 1000);
  ~TensorBoardWriter();  // flushes; never throws
  TensorBoardWriter(TensorBoardWriter&& other) noexcept = default;
  TensorBoardWriter& operator=(TensorBoardWriter&& other) noexcept;
  TensorBoardWriter(const TensorBoardWriter&) = delete;
  TensorBoardWriter& operator=(const TensorBoardWriter&) = delete;

  // Queues one scalar summary event (one Event per scalar, as SummaryWriter.add_scalar writes). wall_time: seconds
  // since the epoch, now when not given. Throws std::runtime_error naming the file when a write fails.
  void add_scalar(std::string_view tag, double value, int64_t step);
  void add_scalar(std::string_view tag, double value, int64_t step, double wall_time);
  // Writes every queued record to the OS. On a write error the records not yet written stay queued and
  // std::runtime_error names the file and the OS error.
  void flush();

  const std::string& path() const { return path_; }

 private:
  // An open file descriptor, closed with its owner.
  class FileDescriptor {
   public:
    FileDescriptor() = default;
    explicit FileDescriptor(int fd) : fd_(fd) {}
    ~FileDescriptor();
    FileDescriptor(FileDescriptor&& other) noexcept;
    FileDescriptor& operator=(FileDescriptor&& other) noexcept;
    int get() const { return fd_; }

   private:
    int fd_ = -1;
  };

  std::string path_;
  FileDescriptor file_;
  int64_t max_queue_ = 1;
  int64_t queued_ = 0;
  std::string unwritten_;  // framed records not yet handed to the OS

  void close() noexcept;
};

// CRC-32C (Castagnoli) of `bytes`; `running` continues the CRC of bytes before them.
uint32_t crc32c_of(std::span<const std::byte> bytes, uint32_t running = 0);
// TensorFlow's masking of a CRC stored in a TFRecord: ((crc >> 15) | (crc << 17)) + 0xa282ead8.
uint32_t masked_crc32c(uint32_t crc);

}  // namespace moecore
