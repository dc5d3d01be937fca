#include "moecore/ckpt/checkpoint_inspect.h"

#include <filesystem>
#include <ostream>

#include "moecore/ckpt/checkpoint_dir.h"
#include "moecore/ckpt/sharded_checkpoint.h"
#include "moecore/model/config.h"

namespace moecore {
namespace fs = std::filesystem;

int inspect_checkpoint(std::string dir, std::ostream& out,
                       const std::function<void(const ShardedCheckpoint&)>& check_contents) {
  if (!fs::exists(fs::path(dir) / "metadata.json")) {
    const std::optional<int64_t> latest = read_tracker(dir);
    if (!latest)
      throw CheckpointError(dir + ": neither a checkpoint folder (metadata.json) nor a save folder (tracker)");
    dir = iteration_dir(dir, *latest);
  }
  const ShardedCheckpoint ckpt(dir);
  const auto& meta = ckpt.metadata();
  out << "checkpoint " << dir << "\n"
      << "  format " << meta["format"].get<std::string>() << " version " << meta["format_version"] << ", iteration "
      << ckpt.iteration() << "\n  layout";
  for (const auto& [name, value] : meta["layout"].items()) out << " " << name << "=" << value.dump();
  out << "\n  files " << meta["files"].size() << ", tensors " << ckpt.keys().size() << "\n";
  int64_t total_bytes = 0;
  for (const auto& [name, f] : meta["files"].items()) total_bytes += f["bytes"].get<int64_t>();
  out << "  bytes " << total_bytes << "\n";
  for (const std::string& key : ckpt.keys()) {
    const auto& t = meta["tensors"][key];
    out << key << " " << t["dtype"].get<std::string>() << " " << shape_text(t["shape"].get<std::vector<int64_t>>())
        << " pieces:";
    for (const auto& p : t["pieces"]) {
      out << " " << p["file"].get<std::string>() << "@" << shape_text(p["offsets"].get<std::vector<int64_t>>()) << "+"
          << shape_text(p["shape"].get<std::vector<int64_t>>());
      if (p.contains("flat_range")) out << "{" << p["flat_range"].at(0) << ":" << p["flat_range"].at(1) << "}";
    }
    out << "\n";
  }
  if (check_contents) check_contents(ckpt);
  ckpt.verify();
  out << "verified: every checksum matches" << std::endl;
  return 0;
}

}  // namespace moecore
