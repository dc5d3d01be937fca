#include "moecore/train/progress_log.h"

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <ctime>
#include <filesystem>
#include <fstream>
#include <iomanip>
#include <iterator>
#include <optional>
#include <sstream>
#include <stdexcept>
#include <utility>
#include <vector>

namespace moecore {
namespace {

constexpr const char* kFileName = "progress.txt";

std::string local_time_text(const std::time_t seconds) {
  std::tm local{};
  localtime_r(&seconds, &local);
  char text[32];
  std::strftime(text, sizeof text, "%Y-%m-%d %H:%M:%S", &local);
  return text;
}

std::optional<double> parse_local_time(const std::string& text) {
  std::tm local{};
  std::istringstream in(text);
  in >> std::get_time(&local, "%Y-%m-%d %H:%M:%S");
  if (in.fail()) return std::nullopt;
  local.tm_isdst = -1;
  return static_cast<double>(std::mktime(&local));
}

// The value after ": " in a field such as "# GPUs: 4".
std::string field_value(const std::string& field) {
  const size_t colon = field.find(": ");
  return colon == std::string::npos ? std::string() : field.substr(colon + 2);
}

std::vector<std::string> split_tabs(const std::string& line) {
  std::vector<std::string> fields;
  std::istringstream in(line);
  for (std::string field; std::getline(in, field, '\t');) fields.push_back(field);
  return fields;
}

std::string format(const char* spec, const double value) {
  char text[64];
  std::snprintf(text, sizeof text, spec, value);
  return text;
}

}  // namespace

std::optional<ProgressStart> progress_start(const std::string& progress_text, const int64_t world_size) {
  std::optional<ProgressStart> start;
  double latest = 0.0;
  std::optional<double> uncommitted;
  std::istringstream in(progress_text);
  for (std::string line; std::getline(in, line);) {
    const std::vector<std::string> fields = split_tabs(line);
    if (fields.size() < 4) continue;
    const std::string& event = fields[3];
    try {
      if (event == "Saved checkpoint" && fields.size() > 7) latest = std::stod(field_value(fields[7]));
      if (event == "Saving async checkpoint" && fields.size() > 7) uncommitted = std::stod(field_value(fields[7]));
      if (event == "Saved async checkpoint" && uncommitted) latest = *std::exchange(uncommitted, std::nullopt);
      if (std::stoll(field_value(fields[2])) != world_size) {
        start.reset();  // a job of another world size: the search starts again
        continue;
      }
    } catch (const std::exception&) {
      continue;  // a line moecore or Megatron did not write
    }
    if (event == "Starting job" && !start) {
      if (const std::optional<double> seconds = parse_local_time(fields[0])) start = ProgressStart{*seconds, latest};
    }
  }
  return start;
}

ProgressLog::ProgressLog(const TrainingArgs& args, const parallel::ParallelState& parallel,
                         const double floating_point_operations_at_start)
    : args_(args),
      world_size_(parallel.world.size()),
      writes_(args.log_progress && parallel.rank == 0),
      flops_at_start_(floating_point_operations_at_start) {
  append("Starting job");
}

void ProgressLog::append(const std::string& event) const {
  if (!writes_) return;
  std::filesystem::create_directories(args_.save);
  const std::string path = (std::filesystem::path(args_.save) / kFileName).string();
  std::ofstream out(path, std::ios::app);
  const char* job_id = std::getenv("SLURM_JOB_ID");
  out << local_time_text(std::time(nullptr)) << "\tJob ID: " << (job_id != nullptr ? job_id : "")
      << "\t# GPUs: " << world_size_ << '\t' << event << '\n';
  out.flush();
  if (!out) throw std::runtime_error("cannot append to " + path);
}

void ProgressLog::saved(const TrainingProgress& progress, const bool async_scheduled, const double job_start_seconds) {
  if (!writes_) return;
  const double now = static_cast<double>(std::time(nullptr));
  const double flops = progress.floating_point_operations_so_far;
  const double world = static_cast<double>(world_size_);
  const double job_seconds = std::max(1e-9, now - job_start_seconds);
  const double job_throughput = (flops - flops_at_start_) / (job_seconds * 1e12 * world);
  // Megatron reads the file as it stands, this job's "Starting job" included.
  std::ifstream in((std::filesystem::path(args_.save) / kFileName).string());
  const std::string text((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  const std::optional<ProgressStart> start = progress_start(text, world_size_);
  const double cumulative_seconds = start ? std::max(1e-9, now - start->seconds) : job_seconds;
  const double cumulative_throughput =
      (flops - (start ? start->floating_point_operations : flops_at_start_)) / (cumulative_seconds * 1e12 * world);
  const double tokens =
      static_cast<double>(progress.consumed_train_samples) * static_cast<double>(args_.model.seq_length);
  append(std::string(async_scheduled ? "Saving async checkpoint" : "Saved checkpoint") +
         "\tIteration: " + std::to_string(progress.iteration) + "\tJob throughput: " + format("%.1f", job_throughput) +
         " TFLOP/s/GPU\tCumulative throughput: " + format("%.1f", cumulative_throughput) +
         " TFLOP/s/GPU\tFloating-point operations: " + format("%.2e", flops) +
         "\tTokens (in billions): " + format("%.2f", tokens / 1e9));
}

void ProgressLog::async_saved(const int64_t iteration) {
  append("Saved async checkpoint\tIteration: " + std::to_string(iteration));
}

}  // namespace moecore
