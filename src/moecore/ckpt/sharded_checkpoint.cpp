#include "moecore/ckpt/sharded_checkpoint.h"

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <csignal>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <set>
#include <sstream>
#include <stdexcept>
#include <utility>

#include "moecore/ckpt/checkpoint_dir.h"
#include "moecore/ckpt/piece_coverage.h"
#include "moecore/ckpt/safetensors.h"
#include "moecore/parallel/agreement.h"
#include "moecore/tensor/finite_check.h"
#include "moecore/util/atomic_directory.h"
#include "moecore/util/checksum.h"

namespace moecore {
namespace fs = std::filesystem;
using ojson = nlohmann::ordered_json;
using json = nlohmann::json;

namespace {

std::string tmp_dir_of(const std::string& final_dir) { return final_dir + ".tmp"; }

std::string rank_file_name(const int rank) {
  char name[32];
  std::snprintf(name, sizeof name, "rank_%05d.safetensors", rank);
  return name;
}

// The identity of a piece: equal on every rank that holds the same elements of the same tensor.
std::string piece_id(const std::string& key, const StateBox& box) {
  json j = {key, box.offsets, box.shape, box.flat_begin, box.flat_end};
  return j.dump();
}

uint64_t fnv1a(const std::string& text) {
  uint64_t h = 1469598103934665603ull;
  for (const char c : text) h = (h ^ static_cast<uint8_t>(c)) * 1099511628211ull;
  return h;
}

// The piece's elements of `local` (pieces are contiguous in the local tensor), shaped as the safetensors entry: the
// box, or [numel] for a flat range. A view sharing the live storage.
Tensor piece_view(const Tensor& local, const PlacedBox& placed) {
  const std::vector<int64_t> shape = placed.box.flat() ? std::vector<int64_t>{placed.box.numel()} : placed.box.shape;
  return local.view({local.numel()})
      .slice_rows(placed.local_begin, placed.local_begin + placed.box.numel())
      .view(shape);
}

// Whether the fault-injection variable `env` (<stage>[:<rank>]) names `stage` for this world rank (every rank when
// no rank is given).
bool fault_spec_matches(const char* env, const char* stage, const int rank) {
  const char* at = std::getenv(env);
  if (at == nullptr) return false;
  const std::string spec = at;
  const size_t colon = spec.find(':');
  if (spec.substr(0, colon) != stage) return false;
  return colon == std::string::npos || spec.substr(colon + 1) == std::to_string(rank);
}

// Fault injection for the write-fault tests: MOECORE_CKPT_FAIL_AT=<stage>[:<rank>] makes a step of the save fail on
// every rank (or world rank <rank> only) as the OS would: "fsync" (the fsync of a file this rank writes reports EIO).
bool fault_injected(const char* stage, const int rank) {
  return fault_spec_matches("MOECORE_CKPT_FAIL_AT", stage, rank);
}

int checked_fsync(const int fd, const int rank) {
  if (fault_injected("fsync", rank)) {
    errno = EIO;
    return -1;
  }
  return ::fsync(fd);
}

// Writes `chunks` one after the other into a new file at `path`, fsynced; returns the CRC-32 of all the bytes. Every
// failure names the file and the OS error.
uint32_t write_all(const std::string& path, const std::vector<std::span<const std::byte>>& chunks, const int rank) {
  const int fd = ::open(path.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
  if (fd < 0) throw CheckpointError(path + ": cannot create: " + std::strerror(errno));
  const auto fail = [&](const char* what) {
    const std::string reason = std::strerror(errno);
    ::close(fd);
    throw CheckpointError(path + ": " + what + ": " + reason);
  };
  uint32_t crc = 0;
  for (const std::span<const std::byte> chunk : chunks) {
    crc = crc32_of(chunk, crc);
    size_t written = 0;
    while (written < chunk.size()) {
      const ssize_t n = ::write(fd, chunk.data() + written, chunk.size() - written);
      if (n < 0 && errno == EINTR) continue;
      if (n == 0) errno = ENOSPC;  // no progress: the device takes no more bytes
      if (n <= 0) fail("write failed");
      written += static_cast<size_t>(n);
    }
  }
  if (checked_fsync(fd, rank) != 0) fail("fsync failed");
  if (::close(fd) != 0) throw CheckpointError(path + ": close failed: " + std::strerror(errno));
  return crc;
}

// Creates `dir` (and its parents with `parents`) as a folder; a CheckpointError naming it and the OS error otherwise.
void make_folder(const fs::path& dir, const bool parents) {
  std::error_code ec;
  if (parents) {
    fs::create_directories(dir, ec);
  } else {
    fs::create_directory(dir, ec);
  }
  if (ec) throw CheckpointError(dir.string() + ": cannot create the folder: " + ec.message());
  if (!fs::is_directory(dir, ec)) throw CheckpointError(dir.string() + ": exists and is not a folder");
}

// Fault injection for the crash tests: MOECORE_CKPT_KILL_AT=<stage>[:<rank>] kills this process (every rank, or
// world rank <rank> only) with SIGKILL (no cleanup, as a power cut or the OOM killer) when the save reaches <stage>:
// "shard_written" (this rank's file is on disk), "metadata_written" (rank 0, before the folder is renamed),
// "renamed" (rank 0, before the tracker is updated).
void maybe_die_at(const char* stage, const int rank) {
  if (fault_spec_matches("MOECORE_CKPT_KILL_AT", stage, rank)) ::raise(SIGKILL);
}

}  // namespace

// ---------------------------------------------------------------- saving

ShardedSave::ShardedSave(const StateDict& state, const parallel::ProcessGroup& world, std::string root,
                         CheckpointInfo info, const bool async)
    : world_(world), root_(std::move(root)), info_(std::move(info)) {
  // Every rank's pieces, then the owner of each distinct piece: one of its holders, picked by a hash.
  std::vector<Piece> mine;
  json plan = json::array();
  for (const StateEntry& e : state.entries()) {
    for (const PlacedBox& placed : placement_boxes(e.placement)) {
      Piece p;
      p.key = e.key;
      p.dtype = e.dtype;
      p.global_shape = e.global_shape;
      p.box = placed.box;
      p.values = piece_view(e.local, placed);
      plan.push_back(piece_id(e.key, placed.box));
      mine.push_back(std::move(p));
    }
  }
  const std::vector<std::string> plans = parallel::all_gather_text(world_, plan.dump());
  std::map<std::string, std::vector<int>> holders;
  for (size_t r = 0; r < plans.size(); ++r) {
    for (const auto& id : json::parse(plans[r])) holders[id.get<std::string>()].push_back(static_cast<int>(r));
  }
  std::map<std::string, int> names_used;
  for (Piece& p : mine) {
    const std::string id = piece_id(p.key, p.box);
    const std::vector<int>& h = holders.at(id);
    if (h[fnv1a(id) % h.size()] != world_.rank()) continue;
    const int n = names_used[p.key]++;
    p.name = n == 0 ? p.key : p.key + "#" + std::to_string(n);
    if (async) p.values = p.values.clone();
    pieces_.push_back(std::move(p));
  }
  file_name_ = rank_file_name(world_.rank());

  // Rank 0 prepares a fresh ITER.tmp (a save killed earlier may have left one).
  const std::string tmp = tmp_dir_of(final_dir());
  try {
    parallel::run_on_all_ranks(world_, [&] {
      if (world_.rank() != 0) return;
      make_folder(root_, true);
      std::error_code ec;
      fs::remove_all(tmp, ec);
      if (ec) throw CheckpointError(tmp + ": cannot remove what an unfinished save left: " + ec.message());
      make_folder(tmp, false);
    });
    if (!async) parallel::run_on_all_ranks(world_, [this] { write_file(); });
  } catch (const parallel::GroupFailure&) {
    discard_partial_save();
    throw;
  }
  if (async) {
    writer_ = std::thread([this] {
      try {
        write_file();
      } catch (...) {
        writer_error_ = std::current_exception();
      }
      writer_done_ = true;
    });
  } else {
    writer_done_ = true;
  }
}

ShardedSave::~ShardedSave() {
  if (writer_.joinable()) writer_.join();
}

std::string ShardedSave::final_dir() const { return iteration_dir(root_, info_.iteration); }

void ShardedSave::discard_partial_save() {
  pieces_.clear();  // frees the async copies
  if (world_.rank() != 0) return;
  std::error_code ignored;  // a folder that cannot take writes may refuse the removal too; readers ignore ITER.tmp
  fs::remove_all(tmp_dir_of(final_dir()), ignored);
}

void ShardedSave::write_file() {
  if (pieces_.empty()) return;
  std::vector<NamedTensor> tensors;
  tensors.reserve(pieces_.size());
  for (Piece& p : pieces_) {
    p.crc32 = crc32_text(crc32_of(std::span<const std::byte>(p.values.data<std::byte>(), p.values.nbytes())));
    tensors.emplace_back(p.name, p.values);
  }
  // The header, then each piece's bytes straight from its tensor (no copy of the whole file in memory).
  const std::vector<std::byte> header = encode_safetensors_header(tensors);
  std::vector<std::span<const std::byte>> chunks{header};
  bytes_written_ = static_cast<int64_t>(header.size());
  for (const Piece& p : pieces_) {
    chunks.emplace_back(p.values.data<std::byte>(), p.values.nbytes());
    bytes_written_ += static_cast<int64_t>(p.values.nbytes());
  }
  file_crc32_ = crc32_text(write_all((fs::path(tmp_dir_of(final_dir())) / file_name_).string(), chunks, world_.rank()));
  maybe_die_at("shard_written", world_.rank());
}

bool ShardedSave::finalize(const bool blocking) {
  if (finalized_) return true;
  if (!blocking) {
    std::vector<int64_t> all_done{writer_done_ ? 1 : 0};
    world_.all_reduce(std::span<int64_t>(all_done), parallel::ReduceOp::kSum);  // kMin is not offered: count them
    if (all_done[0] != world_.size()) return false;
  }
  if (writer_.joinable()) writer_.join();
  try {
    complete();
  } catch (const parallel::GroupFailure&) {
    discard_partial_save();
    throw;
  }
  pieces_.clear();  // frees the async copies
  finalized_ = true;
  return true;
}

void ShardedSave::complete() {
  parallel::run_on_all_ranks(world_, [this] {
    if (writer_error_) std::rethrow_exception(writer_error_);
  });

  // Rank 0 assembles metadata.json from every rank's pieces.
  ojson records = ojson::array();
  for (const Piece& p : pieces_) {
    ojson r = {{"key", p.key},
               {"dtype", safetensors_dtype_code(p.dtype)},
               {"global_shape", p.global_shape},
               {"name", p.name},
               {"offsets", p.box.offsets},
               {"shape", p.box.shape}};
    if (p.box.flat()) r["flat_range"] = {p.box.flat_begin, p.box.flat_end};
    r["crc32"] = p.crc32;
    records.push_back(r);
  }
  ojson mine = {{"file", pieces_.empty() ? "" : file_name_},
                {"bytes", bytes_written_},
                {"crc32", file_crc32_},
                {"pieces", records}};
  const std::vector<std::string> all = parallel::all_gather_text(world_, mine.dump());
  parallel::run_on_all_ranks(world_, [&] {
    if (world_.rank() != 0) return;
    ojson meta = {{"format", kShardedFormat},     {"format_version", kShardedFormatVersion},
                  {"iteration", info_.iteration}, {"layout", info_.layout},
                  {"args", info_.args},           {"files", ojson::object()},
                  {"tensors", ojson::object()}};
    for (const std::string& text : all) {
      const ojson rank_record = ojson::parse(text);
      const std::string file = rank_record["file"];
      if (file.empty()) continue;
      meta["files"][file] = {{"bytes", rank_record["bytes"]}, {"crc32", rank_record["crc32"]}};
      for (const ojson& r : rank_record["pieces"]) {
        ojson& t = meta["tensors"][r["key"].get<std::string>()];
        if (t.is_null()) t = {{"dtype", r["dtype"]}, {"shape", r["global_shape"]}, {"pieces", ojson::array()}};
        ojson piece = {{"file", file}, {"name", r["name"]}, {"offsets", r["offsets"]}, {"shape", r["shape"]}};
        if (r.contains("flat_range")) piece["flat_range"] = r["flat_range"];
        piece["crc32"] = r["crc32"];
        t["pieces"].push_back(piece);
      }
    }
    // Every element of every tensor stored exactly once.
    for (const auto& [key, t] : meta["tensors"].items()) {
      int64_t stored = 0;
      for (const ojson& piece : t["pieces"]) {
        stored += piece.contains("flat_range")
                      ? piece["flat_range"][1].get<int64_t>() - piece["flat_range"][0].get<int64_t>()
                      : shape_numel(piece["shape"].get<std::vector<int64_t>>());
      }
      if (stored != shape_numel(t["shape"].get<std::vector<int64_t>>())) {
        throw CheckpointError("checkpoint save: the pieces of " + key + " hold " + std::to_string(stored) +
                              " elements, not the tensor's " +
                              std::to_string(shape_numel(t["shape"].get<std::vector<int64_t>>())));
      }
    }
    const std::string tmp = tmp_dir_of(final_dir());
    const std::string text = meta.dump(1);
    write_all((fs::path(tmp) / "metadata.json").string(), {std::as_bytes(std::span(text.data(), text.size()))},
              world_.rank());
    sync_directory(tmp);
    maybe_die_at("metadata_written", world_.rank());
    const std::string target = final_dir();
    try {  // saving an iteration again replaces it; what stays of the old copy is ignored by readers (ITER.tmp)
      replace_directory(tmp, target);
    } catch (const FileWriteError& e) {
      throw CheckpointError(std::string("checkpoint save: ") + e.what());
    }
    sync_directory(root_);
    maybe_die_at("renamed", world_.rank());
    write_tracker(root_, info_.iteration);
  });
}

// ---------------------------------------------------------------- loading

namespace {

// The row-major index in the global tensor of element `index` of a stored piece.
int64_t global_flat_index(const StateBox& box, const std::vector<int64_t>& global_shape, const int64_t index) {
  int64_t in_box = box.flat_begin + index;
  int64_t global = 0;
  int64_t stride = 1;
  for (size_t d = box.shape.size(); d-- > 0;) {
    const int64_t coordinate = box.shape[d] == 0 ? 0 : in_box % box.shape[d];
    in_box = box.shape[d] == 0 ? 0 : in_box / box.shape[d];
    global += (box.offsets[d] + coordinate) * stride;
    stride *= global_shape[d];
  }
  return global;
}

}  // namespace

void ShardedCheckpoint::fail(const std::string& file, const std::string& problem) const {
  throw CheckpointError((fs::path(dir_) / file).string() + ": " + problem);
}

ShardedCheckpoint::ShardedCheckpoint(std::string iter_dir) : dir_(std::move(iter_dir)) {
  const std::string meta_path = (fs::path(dir_) / "metadata.json").string();
  if (!fs::is_directory(dir_)) throw CheckpointError(dir_ + ": no such checkpoint folder");
  std::ifstream in(meta_path);
  if (!in) fail("metadata.json", "missing (not a complete moecore checkpoint)");
  try {
    metadata_ = ojson::parse(in);
  } catch (const ojson::parse_error& e) {
    fail("metadata.json", "malformed: not valid JSON (error at byte " + std::to_string(e.byte) + ")");
  } catch (const ojson::exception&) {  // 1e999: a number beyond a double
    fail("metadata.json", "malformed: a number out of range");
  }
  const CheckpointMetadata parsed = parse_checkpoint_metadata(metadata_, meta_path);
  iteration_ = parsed.iteration;
  for (const auto& [name, f] : parsed.files) files_[name] = StoredFile{f.bytes, f.crc32, 0, {}};
  for (const MetadataTensor& t : parsed.tensors) {
    Stored s{t.info, {}};
    for (const MetadataPiece& p : t.pieces) s.pieces.push_back(Piece{p.file, p.name, p.box, p.crc32});
    order_.push_back(t.key);
    tensors_.emplace(t.key, std::move(s));
  }
  check_files();
  // Every element stored exactly once (the pieces' sizes are now backed by the files' bytes).
  for (const auto& [key, s] : tensors_) {
    std::vector<StateBox> boxes;
    for (const Piece& p : s.pieces) boxes.push_back(p.box);
    if (const std::optional<std::string> problem = piece_coverage_problem(s.info.global_shape, boxes)) {
      fail("metadata.json", "the pieces of " + key + " " + *problem + " of its " + shape_text(s.info.global_shape) +
                                " elements (each must be stored exactly once)");
    }
  }
}

void ShardedCheckpoint::check_files() {
  // Every file: present, of its recorded size, a valid safetensors file.
  std::map<std::string, SafetensorsHeader> headers;
  for (auto& [name, f] : files_) {
    const fs::path path = fs::path(dir_) / name;
    std::error_code ec;
    const auto size = fs::file_size(path, ec);
    if (ec) fail(name, "missing");
    if (static_cast<int64_t>(size) != f.bytes) {
      fail(name, "truncated or resized: " + std::to_string(size) + " bytes instead of " + std::to_string(f.bytes));
    }
    try {
      headers[name] = read_safetensors_header(path.string());
    } catch (const std::runtime_error& e) {
      throw CheckpointError(e.what());
    }
    f.data_start = static_cast<int64_t>(headers[name].data_start);
  }
  // Each entry of a file is one piece of the metadata, of the piece's dtype and shape.
  std::map<std::pair<std::string, std::string>, std::string> piece_crcs;  // (file, entry) -> the piece's CRC-32
  for (const auto& [key, s] : tensors_) {
    for (const Piece& p : s.pieces) {
      const SafetensorsTensorInfo* entry = headers.at(p.file).find(p.name);
      const std::vector<int64_t> shape = p.box.flat() ? std::vector<int64_t>{p.box.numel()} : p.box.shape;
      if (entry == nullptr || entry->dtype != s.info.dtype || entry->shape != shape) {
        fail(p.file, "tensor " + key + " is missing or of the wrong size (entry '" + p.name +
                         "': " + safetensors_dtype_code(s.info.dtype) + " " + shape_text(shape) + " expected)");
      }
      if (!piece_crcs.emplace(std::make_pair(p.file, p.name), p.crc32).second) {
        fail("metadata.json", "two pieces name entry '" + p.name + "' of " + p.file);
      }
      files_.at(p.file).offsets[p.name] = {
          static_cast<int64_t>(entry->file_offset) - files_.at(p.file).data_start,
          static_cast<int64_t>(entry->file_offset + entry->nbytes) - files_.at(p.file).data_start};
    }
  }
  // The file's CRC-32 from its header's bytes and its pieces' CRC-32s (safetensors leaves no gaps): the recorded
  // file checksum is checked without reading the tensors, whose bytes each load checks against their pieces' CRCs.
  for (const auto& [name, f] : files_) {
    const SafetensorsHeader& header = headers.at(name);
    std::string head(static_cast<size_t>(f.data_start), '\0');
    std::ifstream file(fs::path(dir_) / name, std::ios::binary);
    if (!file.read(head.data(), static_cast<std::streamsize>(head.size()))) fail(name, "cannot read the header");
    uint32_t crc = crc32_of(std::as_bytes(std::span(head.data(), head.size())));
    for (const SafetensorsTensorInfo& entry : header.tensors) {
      const auto it = piece_crcs.find({name, entry.name});
      if (it == piece_crcs.end()) fail(name, "holds tensor '" + entry.name + "' that metadata.json does not list");
      crc = crc32_combine_of(crc, static_cast<uint32_t>(std::stoul(it->second, nullptr, 16)),
                             static_cast<int64_t>(entry.nbytes));
    }
    if (crc32_text(crc) != f.crc32) {
      fail(name, "checksum mismatch: the file's header and its pieces' CRC-32s give " + crc32_text(crc) +
                     ", metadata.json records " + f.crc32 + " (the file or metadata.json is corrupted)");
    }
  }
}

std::optional<StoredTensorInfo> ShardedCheckpoint::info(const std::string& key) const {
  const auto it = tensors_.find(key);
  if (it == tensors_.end()) return std::nullopt;
  return it->second.info;
}

Tensor ShardedCheckpoint::read_piece(const std::string& key, const Stored& stored, const Piece& piece) const {
  const StoredFile& f = files_.at(piece.file);
  const auto [begin, end] = f.offsets.at(piece.name);
  Tensor out(std::vector<int64_t>{piece.box.numel()}, stored.info.dtype, MemCategory::kOther);
  const std::string path = (fs::path(dir_) / piece.file).string();
  const int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
  if (fd < 0) fail(piece.file, "cannot open");
  int64_t done = 0;
  const int64_t n = end - begin;
  while (done < n) {
    const ssize_t got =
        ::pread(fd, out.data<std::byte>() + done, static_cast<size_t>(n - done), f.data_start + begin + done);
    if (got < 0 && errno == EINTR) continue;
    if (got <= 0) {
      ::close(fd);
      fail(piece.file, "cannot read tensor " + key + " (truncated)");
    }
    done += got;
  }
  ::close(fd);
  if (crc32_text(crc32_of(std::span<const std::byte>(out.data<std::byte>(), static_cast<size_t>(n)))) != piece.crc32) {
    fail(piece.file, "checksum mismatch in tensor " + key + " (the file is corrupted)");
  }
  // Intact bytes may still hold NaN or Inf (a run saved after its update diverged): such a state cannot train.
  if (const std::optional<NonFiniteElement> bad = first_nonfinite(out)) {
    fail(piece.file, key + " holds a non-finite value (" + nonfinite_name(bad->value) + ") at element " +
                         std::to_string(global_flat_index(piece.box, stored.info.global_shape, bad->index)));
  }
  return out;
}

std::vector<StoredPiece> ShardedCheckpoint::pieces(const std::string& key) const {
  const auto it = tensors_.find(key);
  if (it == tensors_.end()) return {};
  std::vector<StoredPiece> out;
  for (const Piece& p : it->second.pieces) {
    out.push_back(StoredPiece{p.box, [this, key, &stored = it->second, &p] { return read_piece(key, stored, p); }});
  }
  return out;
}

void ShardedCheckpoint::verify() const {
  for (const auto& [name, f] : files_) {
    std::ifstream in(fs::path(dir_) / name, std::ios::binary);
    std::vector<char> buffer(1 << 20);
    uint32_t crc = 0;
    while (in) {
      in.read(buffer.data(), static_cast<std::streamsize>(buffer.size()));
      crc = crc32_of(std::as_bytes(std::span(buffer.data(), static_cast<size_t>(in.gcount()))), crc);
    }
    if (crc32_text(crc) != f.crc32) fail(name, "checksum mismatch (the file is corrupted)");
  }
  for (const auto& [key, s] : tensors_) {
    for (const Piece& p : s.pieces) read_piece(key, s, p);
  }
}

int64_t ShardedCheckpoint::i64(const std::string& key) const {
  const Tensor t = read_global_tensor(*this, key, DType::kI64);
  return *t.data<int64_t>();
}

double ShardedCheckpoint::f64(const std::string& key) const {
  const Tensor t = read_global_tensor(*this, key, DType::kF64);
  return *t.data<double>();
}

}  // namespace moecore
