// Stored pieces and the sharded checkpoint format: placement boxes, box-overlap copies against a per-element
// reference, resharding between placements (tensor-parallel cuts with segments, distributed-optimizer flat ranges),
// a save / load round trip in one process, the tracker, and the one-line errors for damaged files.
#include <gtest/gtest.h>

#include <cstdint>
#include <filesystem>
#include <fstream>
#include <functional>
#include <limits>
#include <nlohmann/json.hpp>
#include <random>
#include <sstream>
#include <string>
#include <tuple>
#include <vector>

#include "moecore/ckpt/checkpoint_dir.h"
#include "moecore/ckpt/checkpoint_inspect.h"
#include "moecore/ckpt/piece_coverage.h"
#include "moecore/ckpt/sharded_checkpoint.h"
#include "moecore/ckpt/state_source.h"

namespace moecore {
namespace {
namespace fs = std::filesystem;

StatePlacement placement(const std::vector<int64_t>& full_shape, const int dim, const int segments,
                         const int num_shards, const int shard_index, const int64_t flat_begin = 0,
                         const int64_t flat_end = -1) {
  StatePlacement p;
  p.shard = ParamShard{dim, segments, num_shards, shard_index, full_shape};
  p.flat_begin = flat_begin;
  p.flat_end = flat_end;
  return p;
}

Tensor random_tensor(const std::vector<int64_t>& shape, const uint32_t seed) {
  Tensor t(shape, DType::kF32);
  std::mt19937 rng(seed);
  std::normal_distribution<float> normal;
  for (float& v : t.span<float>()) v = normal(rng);
  return t;
}

// This placement's local tensor, element by element from the global tensor (the reference for every load).
Tensor local_slice(const Tensor& global, const StatePlacement& p) {
  Tensor local(std::vector<int64_t>{local_numel(p)}, DType::kF32);
  for (int64_t i = 0; i < local.numel(); ++i) local.data<float>()[i] = global.data<float>()[global_index(p, i)];
  return local;
}

// A source holding the pieces that a set of placements saves (as ranks of one layout would).
class PieceSource : public StateSource {
 public:
  PieceSource(const std::string& key, const Tensor& global, const std::vector<StatePlacement>& saved)
      : key_(key), shape_(global.shape()) {
    for (const StatePlacement& p : saved) {
      const Tensor local = local_slice(global, p);
      for (const PlacedBox& b : placement_boxes(p)) {
        Tensor values(std::vector<int64_t>{b.box.numel()}, DType::kF32);
        for (int64_t i = 0; i < b.box.numel(); ++i) values.data<float>()[i] = local.data<float>()[b.local_begin + i];
        pieces_.push_back(StoredPiece{b.box, [values] { return values; }});
      }
    }
  }
  std::string description() const override { return "test pieces"; }
  std::optional<StoredTensorInfo> info(const std::string& key) const override {
    if (key != key_) return std::nullopt;
    return StoredTensorInfo{DType::kF32, shape_};
  }
  std::vector<StoredPiece> pieces(const std::string& key) const override {
    return key == key_ ? pieces_ : std::vector<StoredPiece>{};
  }

 private:
  std::string key_;
  std::vector<int64_t> shape_;
  std::vector<StoredPiece> pieces_;
};

TEST(PlacementBoxes, SegmentedRowShardIsOneBoxPerSegment) {
  // [8, 3], two segments of 4 rows cut over 2 ranks: rank 1 holds rows 2-3 and 6-7.
  const std::vector<PlacedBox> boxes = placement_boxes(placement({8, 3}, 0, 2, 2, 1));
  ASSERT_EQ(boxes.size(), 2u);
  EXPECT_EQ(boxes[0].box.offsets, (std::vector<int64_t>{2, 0}));
  EXPECT_EQ(boxes[0].box.shape, (std::vector<int64_t>{2, 3}));
  EXPECT_EQ(boxes[0].local_begin, 0);
  EXPECT_EQ(boxes[1].box.offsets, (std::vector<int64_t>{6, 0}));
  EXPECT_EQ(boxes[1].local_begin, 6);
}

TEST(PlacementBoxes, FlatRangeSplitsAcrossSegments) {
  // The same shard's local elements [4, 9): elements 4-5 of the first box, 0-2 of the second.
  const std::vector<PlacedBox> boxes = placement_boxes(placement({8, 3}, 0, 2, 2, 1, 4, 9));
  ASSERT_EQ(boxes.size(), 2u);
  EXPECT_EQ(boxes[0].box.flat_begin, 4);
  EXPECT_EQ(boxes[0].box.flat_end, 6);
  EXPECT_EQ(boxes[0].local_begin, 0);
  EXPECT_EQ(boxes[1].box.flat_begin, 0);
  EXPECT_EQ(boxes[1].box.flat_end, 3);
  EXPECT_EQ(boxes[1].local_begin, 2);
  // An empty range has no boxes.
  EXPECT_TRUE(placement_boxes(placement({8, 3}, 0, 2, 2, 1, 0, 0)).empty());
}

TEST(PlacementBoxes, ColumnSegmentsAreRejected) {
  EXPECT_THROW(placement_boxes(placement({4, 8}, 1, 2, 2, 0)), std::logic_error);
}

// copy_box_overlap against a per-element reference on random boxes and flat ranges of a random 3-D tensor.
TEST(CopyBoxOverlap, MatchesPerElementReference) {
  std::mt19937 rng(5);
  const std::vector<int64_t> shape{5, 4, 6};
  const auto random_box = [&] {
    StateBox b;
    for (const int64_t extent : shape) {
      const int64_t lo = std::uniform_int_distribution<int64_t>(0, extent - 1)(rng);
      const int64_t hi = std::uniform_int_distribution<int64_t>(lo + 1, extent)(rng);
      b.offsets.push_back(lo);
      b.shape.push_back(hi - lo);
    }
    if (rng() % 2) {
      b.flat_begin = std::uniform_int_distribution<int64_t>(0, b.box_numel())(rng);
      b.flat_end = std::uniform_int_distribution<int64_t>(b.flat_begin, b.box_numel())(rng);
    }
    return b;
  };
  // Global coordinates of box element k (row-major in the box).
  const auto coords = [](const StateBox& b, int64_t k) {
    std::vector<int64_t> c(b.shape.size());
    for (size_t d = b.shape.size(); d-- > 0;) {
      c[d] = b.offsets[d] + k % b.shape[d];
      k /= b.shape[d];
    }
    return c;
  };
  for (int trial = 0; trial < 300; ++trial) {
    const StateBox src_box = random_box(), dst_box = random_box();
    const Tensor src = random_tensor({src_box.numel()}, static_cast<uint32_t>(trial));
    Tensor dst(std::vector<int64_t>{dst_box.numel() + 3}, DType::kF32);
    for (float& v : dst.span<float>()) v = -7.0f;
    Tensor want = dst.clone();
    int64_t want_count = 0;
    const int64_t s0 = src_box.flat() ? src_box.flat_begin : 0;
    const int64_t t0 = dst_box.flat() ? dst_box.flat_begin : 0;
    for (int64_t i = 0; i < src_box.numel(); ++i) {
      const std::vector<int64_t> c = coords(src_box, s0 + i);
      bool inside = true;
      int64_t k = 0;
      for (size_t d = 0; d < c.size(); ++d) {
        inside &= c[d] >= dst_box.offsets[d] && c[d] < dst_box.offsets[d] + dst_box.shape[d];
        k = k * dst_box.shape[d] + (c[d] - dst_box.offsets[d]);
      }
      if (!inside || k < t0 || k >= t0 + dst_box.numel()) continue;
      want.data<float>()[3 + k - t0] = src.data<float>()[i];
      ++want_count;
    }
    EXPECT_EQ(copy_box_overlap(src_box, &src, dst_box, &dst, 3), want_count) << trial;
    EXPECT_EQ(copy_box_overlap(src_box, nullptr, dst_box, nullptr, 3), want_count) << trial;
    for (int64_t i = 0; i < dst.numel(); ++i)
      ASSERT_EQ(dst.data<float>()[i], want.data<float>()[i]) << trial << " " << i;
  }
}

// Saved under TP 4 with two segments and distributed-optimizer flat ranges, loaded under TP 2 (whole shards and flat
// ranges) and replicated: every local tensor equals its slice of the global tensor.
TEST(LoadState, ReshardsBetweenPlacements) {
  const std::vector<int64_t> shape{16, 3};
  const Tensor global = random_tensor(shape, 11);
  std::vector<StatePlacement> saved;
  for (int r = 0; r < 4; ++r) {  // each TP shard split in two flat halves over 2 DP ranks
    saved.push_back(placement(shape, 0, 2, 4, r, 0, 5));
    saved.push_back(placement(shape, 0, 2, 4, r, 5, 12));
  }
  const PieceSource source("w", global, saved);
  for (const StatePlacement& target :
       {placement(shape, 0, 2, 2, 0), placement(shape, 0, 2, 2, 1, 3, 17), placement(shape, 0, 1, 1, 0),
        placement(shape, 0, 2, 1, 0, 20, 48), placement(shape, 0, 1, 1, 0, 0, 0)}) {
    StateDict state;
    state.add_tensor("w", Tensor(std::vector<int64_t>{local_numel(target)}, DType::kF32), target);
    load_state(source, state);
    const Tensor want = local_slice(global, target);
    const Tensor& got = state.entries().front().local;
    for (int64_t i = 0; i < want.numel(); ++i) ASSERT_EQ(got.data<float>()[i], want.data<float>()[i]) << i;
  }
}

TEST(LoadState, MissingPiecesAndShapesAreErrors) {
  const std::vector<int64_t> shape{8, 2};
  const Tensor global = random_tensor(shape, 3);
  const PieceSource half("w", global, {placement(shape, 0, 1, 2, 0)});  // rows 0-3 only
  StateDict state;
  state.add_tensor("w", Tensor(shape, DType::kF32), placement(shape, 0, 1, 1, 0));
  try {
    load_state(half, state);
    FAIL() << "no error";
  } catch (const std::runtime_error& e) {
    EXPECT_NE(std::string(e.what()).find("test pieces: 8 of the 16 elements this rank needs"), std::string::npos)
        << e.what();
  }
  StateDict other;
  other.add_tensor("w", Tensor(std::vector<int64_t>{4, 4}, DType::kF32), placement({4, 4}, 0, 1, 1, 0));
  EXPECT_THROW(load_state(half, other), std::runtime_error);
  StateDict absent;
  absent.add_tensor("v", Tensor(shape, DType::kF32), placement(shape, 0, 1, 1, 0));
  EXPECT_THROW(load_state(half, absent), std::runtime_error);
}

// A padded vocabulary of another size: the rows both have are loaded, the rest keep their values.
TEST(LoadState, RowsMayDifferWhenAllowed) {
  const Tensor global = random_tensor({6, 2}, 9);
  const PieceSource source("emb", global, {placement({6, 2}, 0, 1, 1, 0)});
  StateDict state;
  Tensor local(std::vector<int64_t>{8, 2}, DType::kF32);
  for (float& v : local.span<float>()) v = 5.0f;
  state.add_tensor("emb", local, placement({8, 2}, 0, 1, 1, 0));
  EXPECT_THROW(load_state(source, state), std::runtime_error);
  load_state(source, state, nullptr, [](const std::string& key) { return key == "emb"; });
  for (int64_t i = 0; i < 12; ++i) EXPECT_EQ(local.data<float>()[i], global.data<float>()[i]);
  for (int64_t i = 12; i < 16; ++i) EXPECT_EQ(local.data<float>()[i], 5.0f);
}

class ShardedCheckpointTest : public ::testing::Test {
 protected:
  void SetUp() override {
    root_ = fs::temp_directory_path() / ("moecore_ckpt_test_" + std::to_string(::getpid()));
    fs::remove_all(root_);
  }
  void TearDown() override { fs::remove_all(root_); }

  // A state of a fp32 tensor stored as two flat pieces' worth (one rank: whole), a bf16 tensor, and scalars.
  StateDict make_state(const uint32_t seed) {
    StateDict s;
    weight_ = random_tensor({6, 4}, seed);
    s.add_tensor("layer.weight", weight_, placement({6, 4}, 0, 1, 1, 0));
    half_ = Tensor(std::vector<int64_t>{5}, DType::kBF16);
    for (int i = 0; i < 5; ++i) half_.data<uint16_t>()[i] = fp32_to_bf16(0.25f * static_cast<float>(i + seed));
    s.add_tensor("half", half_, placement({5}, 0, 1, 1, 0));
    s.add_i64("iteration", 42 + seed);
    s.add_f64("flops", 1.5e12 + seed);
    return s;
  }
  std::string save(const StateDict& state, const int64_t iteration, const bool async) {
    CheckpointInfo info;
    info.iteration = iteration;
    ShardedSave saving(state, parallel::ProcessGroup::self(), root_.string(), info, async);
    saving.finalize(true);
    return iteration_dir(root_.string(), iteration);
  }
  fs::path root_;
  Tensor weight_, half_;
};

TEST_F(ShardedCheckpointTest, RoundTripIsBitExact) {
  for (const bool async : {false, true}) {
    const StateDict saved = make_state(1);
    const std::string dir = save(saved, 7, async);
    EXPECT_EQ(read_tracker(root_.string()), 7);
    EXPECT_FALSE(fs::exists(dir + ".tmp"));
    const ShardedCheckpoint ckpt(dir);
    EXPECT_EQ(ckpt.iteration(), 7);
    EXPECT_EQ(ckpt.keys(), (std::vector<std::string>{"layer.weight", "half", "iteration", "flops"}));
    EXPECT_EQ(ckpt.i64("iteration"), 43);
    EXPECT_EQ(ckpt.f64("flops"), 1.5e12 + 1);
    ckpt.verify();
    StateDict loaded = make_state(2);  // other values, overwritten by the load
    load_state(ckpt, loaded, [](const StateEntry& e) { return !e.global_shape.empty(); });
    EXPECT_EQ(std::memcmp(weight_.data<float>(), saved.at("layer.weight").local.data<float>(), weight_.nbytes()), 0);
    EXPECT_EQ(std::memcmp(half_.data<uint16_t>(), saved.at("half").local.data<uint16_t>(), half_.nbytes()), 0);
    fs::remove_all(root_);
  }
}

TEST_F(ShardedCheckpointTest, SavingAnIterationAgainReplacesIt) {
  save(make_state(1), 3, false);
  const std::string dir = save(make_state(2), 3, false);
  EXPECT_EQ(ShardedCheckpoint(dir).i64("iteration"), 44);
  EXPECT_FALSE(fs::exists(dir + ".tmp"));
}

TEST_F(ShardedCheckpointTest, DamageGivesOneLineErrorsNamingFileAndTensor) {
  const std::string dir = save(make_state(1), 5, false);
  const std::string file = dir + "/rank_00000.safetensors";
  const auto expect_error = [&](const std::string& want) {
    try {
      const ShardedCheckpoint ckpt(dir);
      ckpt.verify();
      FAIL() << "no error, expected " << want;
    } catch (const CheckpointError& e) {
      EXPECT_NE(std::string(e.what()).find(want), std::string::npos) << e.what();
      EXPECT_EQ(std::string(e.what()).find('\n'), std::string::npos);
    }
  };
  std::vector<char> bytes;
  {
    std::ifstream in(file, std::ios::binary);
    bytes.assign(std::istreambuf_iterator<char>(in), {});
  }
  // Flip a byte of the first tensor's data (layer.weight, right after the header).
  uint64_t header_len = 0;
  for (int i = 7; i >= 0; --i) header_len = (header_len << 8) | static_cast<uint8_t>(bytes[static_cast<size_t>(i)]);
  std::vector<char> corrupted = bytes;
  corrupted[8 + header_len + 3] ^= 0x10;
  std::ofstream(file, std::ios::binary).write(corrupted.data(), static_cast<std::streamsize>(corrupted.size()));
  expect_error("rank_00000.safetensors: checksum mismatch");
  try {
    const ShardedCheckpoint ckpt(dir);
    StateDict target = make_state(3);
    load_state(ckpt, target);
    FAIL() << "loaded a corrupted tensor";
  } catch (const CheckpointError& e) {
    EXPECT_NE(std::string(e.what()).find("checksum mismatch in tensor layer.weight"), std::string::npos) << e.what();
  }
  std::ofstream(file, std::ios::binary).write(bytes.data(), static_cast<std::streamsize>(bytes.size() - 9));
  expect_error("rank_00000.safetensors: truncated or resized");
  fs::remove(file);
  expect_error("rank_00000.safetensors: missing");
  std::ofstream(dir + "/metadata.json") << "{\"format\": \"moecore_sharded\", \"format_version\": 1";
  expect_error("metadata.json: malformed");
  fs::remove(dir + "/metadata.json");
  expect_error("metadata.json: missing");
}

// Sizes in metadata.json that overflow int64 arithmetic are one-line errors (found by tests/fuzz, whose
// regressions/sharded_checkpoint holds these inputs).
TEST_F(ShardedCheckpointTest, OverflowingSizesInMetadataAreErrors) {
  const std::string dir = save(make_state(1), 5, false);
  std::string original;
  {
    std::ifstream in(dir + "/metadata.json");
    original.assign(std::istreambuf_iterator<char>(in), {});
  }
  const auto expect_error = [&](const std::function<void(nlohmann::ordered_json&)>& damage, const std::string& want) {
    nlohmann::ordered_json metadata = nlohmann::ordered_json::parse(original);
    damage(metadata["tensors"]["layer.weight"]);
    std::ofstream(dir + "/metadata.json", std::ios::trunc) << metadata.dump(1);
    try {
      const ShardedCheckpoint ckpt(dir);
      FAIL() << "no error, expected " << want;
    } catch (const CheckpointError& e) {
      EXPECT_NE(std::string(e.what()).find(want), std::string::npos) << e.what();
    }
  };
  // offset + shape of a piece at 2^63 - 1 overflowed the inside-the-tensor check
  expect_error(
      [](auto& t) {
        t["pieces"][0]["offsets"] = {std::numeric_limits<int64_t>::max(), 0};
      },
      "\"tensors.layer.weight.pieces[0]\" lies outside the tensor [6, 4]");
  // [2^40, 2^40] fp32: 2^82 bytes
  const int64_t big = int64_t{1} << 40;
  expect_error(
      [&](auto& t) {
        t["shape"] = {big, big};
        t["pieces"][0]["shape"] = {big, big};
      },
      "layer.weight byte count overflows 64-bit integers (4398046511104 x 1099511627776)");
  expect_error([](auto& t) { t["shape"] = {-6, 4}; }, "\"tensors.layer.weight.shape\" has a negative dimension");
  // A flat_range that is not a pair was read past its end.
  expect_error([](auto& t) { t["pieces"][0]["flat_range"] = {3}; },
               "\"tensors.layer.weight.pieces[0].flat_range\" is not a pair");
}

// A rank file whose header gives a tensor one data offset instead of two was read past the JSON array (found by
// tests/fuzz: regressions/sharded_checkpoint/rank_file_one_data_offset).
TEST_F(ShardedCheckpointTest, RankFileDataOffsetsMustBePairs) {
  const std::string dir = save(make_state(1), 5, false);
  const std::string file = dir + "/rank_00000.safetensors";
  std::string bytes;
  {
    std::ifstream in(file, std::ios::binary);
    bytes.assign(std::istreambuf_iterator<char>(in), {});
  }
  // "[0,N]" -> "[N  ]": one offset, the file's size unchanged (metadata.json records it).
  const size_t open = bytes.find("\"data_offsets\":[0,");
  ASSERT_NE(open, std::string::npos);
  const size_t begin = open + std::string("\"data_offsets\":[").size();
  const size_t end = bytes.find(']', begin);
  const std::string end_offset = bytes.substr(begin + 2, end - begin - 2);
  bytes.replace(begin, end - begin, end_offset + std::string(end - begin - end_offset.size(), ' '));
  std::ofstream(file, std::ios::binary | std::ios::trunc) << bytes;
  try {
    const ShardedCheckpoint ckpt(dir);
    FAIL() << "no error for a one-element data_offsets";
  } catch (const CheckpointError& e) {
    EXPECT_NE(std::string(e.what()).find("is not two non-negative integers"), std::string::npos) << e.what();
    EXPECT_EQ(std::string(e.what()).find('\n'), std::string::npos);
  }
}

// Rewrites dir's metadata.json with `damage` applied, opens and verifies the checkpoint, and returns the error
// (empty when it opened and verified).
std::string error_after(const std::string& dir, const std::function<void(nlohmann::ordered_json&)>& damage) {
  const std::string path = dir + "/metadata.json";
  std::string original;
  {
    std::ifstream in(path);
    original.assign(std::istreambuf_iterator<char>(in), {});
  }
  nlohmann::ordered_json metadata = nlohmann::ordered_json::parse(original);
  damage(metadata);
  std::ofstream(path, std::ios::trunc) << metadata.dump(1);
  std::string error;
  try {
    const ShardedCheckpoint ckpt(dir);
    ckpt.verify();
  } catch (const CheckpointError& e) {
    error = e.what();
  }
  std::ofstream(path, std::ios::trunc) << original;
  return error;
}

// A value of the wrong JSON type anywhere in metadata.json is one line naming the file and the field's path (it
// was a raw "[json.exception.type_error.304]", or went unnoticed until a load used the field).
TEST_F(ShardedCheckpointTest, MetadataOfTheWrongTypeNamesTheField) {
  const std::string dir = save(make_state(1), 5, false);
  using J = nlohmann::ordered_json;
  const std::vector<std::tuple<std::string, std::function<void(J&)>, std::string>> cases = {
      {"top", [](J& m) { m = nullptr; }, "metadata.json: must be a JSON object, got null"},
      {"args", [](J& m) { m["args"] = nullptr; }, "metadata.json: \"args\" must be an object, got null"},
      {"args.model", [](J& m) { m["args"]["model"] = nullptr; },
       "metadata.json: \"args.model\" must be an object, got null"},
      {"args.training", [](J& m) { m["args"]["training"] = J::array(); },
       "metadata.json: \"args.training\" must be an object, got an array"},
      {"layout", [](J& m) { m["layout"] = 3; }, "metadata.json: \"layout\" must be an object, got 3"},
      {"no layout", [](J& m) { m.erase("layout"); }, "metadata.json: \"layout\" is missing"},
      {"iteration", [](J& m) { m["iteration"] = "5"; },
       "metadata.json: \"iteration\" must be an integer within 64 bits, got \"5\""},
      {"format_version", [](J& m) { m["format_version"] = 1.5; },
       "metadata.json: \"format_version\" must be an integer within 64 bits, got 1.5"},
      {"files", [](J& m) { m["files"] = nullptr; }, "metadata.json: \"files\" must be an object, got null"},
      {"file entry", [](J& m) { m["files"]["rank_00000.safetensors"] = nullptr; },
       "metadata.json: \"files.rank_00000.safetensors\" must be an object, got null"},
      {"file bytes", [](J& m) { m["files"]["rank_00000.safetensors"]["bytes"] = -1; },
       "metadata.json: \"files.rank_00000.safetensors.bytes\" must not be negative, got -1"},
      {"file crc", [](J& m) { m["files"]["rank_00000.safetensors"]["crc32"] = 7; },
       "metadata.json: \"files.rank_00000.safetensors.crc32\" must be a string, got 7"},
      {"tensors", [](J& m) { m["tensors"] = "x"; }, "metadata.json: \"tensors\" must be an object, got \"x\""},
      {"tensor", [](J& m) { m["tensors"]["half"] = nullptr; },
       "metadata.json: \"tensors.half\" must be an object, got null"},
      {"dtype", [](J& m) { m["tensors"]["half"]["dtype"] = nullptr; },
       "metadata.json: \"tensors.half.dtype\" must be a string, got null"},
      {"shape", [](J& m) { m["tensors"]["half"]["shape"] = {2.5}; },
       "metadata.json: \"tensors.half.shape[0]\" must be an integer within 64 bits, got 2.5"},
      {"pieces", [](J& m) { m["tensors"]["half"]["pieces"] = J::object(); },
       "metadata.json: \"tensors.half.pieces\" must be an array, got an object"},
      {"piece", [](J& m) { m["tensors"]["half"]["pieces"][0] = nullptr; },
       "metadata.json: \"tensors.half.pieces[0]\" must be an object, got null"},
      {"piece file", [](J& m) { m["tensors"]["half"]["pieces"][0]["file"] = true; },
       "metadata.json: \"tensors.half.pieces[0].file\" must be a string, got true"},
      {"piece offsets", [](J& m) { m["tensors"]["half"]["pieces"][0]["offsets"] = nullptr; },
       "metadata.json: \"tensors.half.pieces[0].offsets\" must be an array, got null"},
      {"piece crc", [](J& m) { m["tensors"]["half"]["pieces"][0].erase("crc32"); },
       "metadata.json: \"tensors.half.pieces[0].crc32\" is missing"},
      {"flat_range", [](J& m) { m["tensors"]["half"]["pieces"][0]["flat_range"] = nullptr; },
       "metadata.json: \"tensors.half.pieces[0].flat_range\" must be an array, got null"},
  };
  for (const auto& [name, damage, want] : cases) {
    const std::string error = error_after(dir, damage);
    EXPECT_NE(error.find(want), std::string::npos) << name << ": " << error;
    EXPECT_EQ(error.find("json.exception"), std::string::npos) << name << ": " << error;
    EXPECT_EQ(error.find('\n'), std::string::npos) << name << ": " << error;
  }
  EXPECT_EQ(error_after(dir, [](J&) {}), "");  // the file restored
}

// Pieces must hold every element of their tensor exactly once: a gap (the tensor's shape grown) passed verification,
// and a gap hidden by an overlap of the same size loaded the overlapping piece twice and left the gap unset.
TEST_F(ShardedCheckpointTest, PiecesMustCoverTheirTensorExactlyOnce) {
  StateDict state = make_state(1);
  state.add_tensor("other.weight", random_tensor({6, 4}, 9), placement({6, 4}, 0, 1, 1, 0));
  const std::string dir = save(state, 5, false);
  using J = nlohmann::ordered_json;
  EXPECT_NE(error_after(dir,
                        [](J& m) {
                          m["tensors"]["layer.weight"]["shape"] = {12, 4};
                        })
                .find("metadata.json: the pieces of layer.weight leave element 24 out of its [12, 4] elements"),
            std::string::npos);
  // other.weight's piece also as rows 0..5 of layer.weight [12, 4]: 48 elements, rows 0..5 twice, rows 6..11 never.
  const auto doubled = [](J& m) {
    m["tensors"]["layer.weight"]["shape"] = {12, 4};
    J piece = m["tensors"]["other.weight"]["pieces"][0];
    m["tensors"]["layer.weight"]["pieces"].push_back(piece);
    m["tensors"].erase("other.weight");
  };
  EXPECT_NE(error_after(dir, doubled).find("the pieces of layer.weight overlap at element 0"), std::string::npos)
      << error_after(dir, doubled);
}

TEST(PieceCoverage, FlatRangesAndBoxesTileOrNot) {
  const auto box = [](std::vector<int64_t> offsets, std::vector<int64_t> shape, int64_t b = 0, int64_t e = -1) {
    return StateBox{std::move(offsets), std::move(shape), b, e};
  };
  EXPECT_EQ(piece_coverage_problem({4, 6}, {box({0, 0}, {4, 3}), box({0, 3}, {4, 3})}), std::nullopt);
  EXPECT_EQ(piece_coverage_problem({4, 6}, {box({0, 0}, {4, 6}, 0, 10), box({0, 0}, {4, 6}, 10, 24)}), std::nullopt);
  EXPECT_EQ(piece_coverage_problem({4, 6}, {box({0, 0}, {4, 6}, 0, 10), box({0, 0}, {4, 6}, 11, 24)}),
            "leave element 10 out");
  EXPECT_EQ(piece_coverage_problem({4, 6}, {box({0, 0}, {4, 3}), box({0, 2}, {4, 3})}), "overlap at element 2");
  EXPECT_EQ(piece_coverage_problem({4, 6}, {box({0, 0}, {4, 6}, 0, 12), box({2, 0}, {2, 6})}), std::nullopt);
  EXPECT_EQ(piece_coverage_problem({4, 6}, {box({0, 0}, {4, 6}, 0, 13), box({2, 0}, {2, 6})}), "overlap at element 12");
  EXPECT_EQ(piece_coverage_problem({4, 6}, {box({0, 0}, {4, 6}, 3, 9), box({0, 0}, {4, 3})}), "overlap at element 6");
  EXPECT_EQ(piece_coverage_problem({}, {box({}, {})}), std::nullopt);
  EXPECT_EQ(piece_coverage_problem({}, {}), "leave element 0 out");
  EXPECT_EQ(piece_coverage_problem({0, 5}, {}), std::nullopt);
  // A flat range of one element of a huge box visits one row, not all of them.
  EXPECT_EQ(piece_coverage_problem({int64_t{1} << 40, 1}, {box({0, 0}, {int64_t{1} << 40, 1}, 7, 8)}),
            "leave element 0 out");
}

// The file's recorded CRC-32 is checked on opening (from its header's bytes and its pieces' CRC-32s, which each read
// checks), so a load notices a damaged header or a wrong checksum in metadata.json, not only `verify`.
TEST_F(ShardedCheckpointTest, FileChecksumIsCheckedOnOpening) {
  const std::string dir = save(make_state(1), 5, false);
  const auto open_error = [&] {
    try {
      const ShardedCheckpoint ckpt(dir);
    } catch (const CheckpointError& e) {
      return std::string(e.what());
    }
    return std::string();
  };
  EXPECT_EQ(open_error(), "");
  std::string metadata;
  {
    std::ifstream in(dir + "/metadata.json");
    metadata.assign(std::istreambuf_iterator<char>(in), {});
  }
  nlohmann::ordered_json damaged = nlohmann::ordered_json::parse(metadata);
  std::string& crc = damaged["files"]["rank_00000.safetensors"]["crc32"].get_ref<std::string&>();
  crc[0] = crc[0] == '0' ? '1' : '0';
  std::ofstream(dir + "/metadata.json", std::ios::trunc) << damaged.dump(1);
  EXPECT_NE(open_error().find("rank_00000.safetensors: checksum mismatch"), std::string::npos) << open_error();
  std::ofstream(dir + "/metadata.json", std::ios::trunc) << metadata;
  // The header's entries in reverse order: the same size and meaning, other bytes (a damage no parser notices).
  const std::string file = dir + "/rank_00000.safetensors";
  std::string bytes;
  {
    std::ifstream in(file, std::ios::binary);
    bytes.assign(std::istreambuf_iterator<char>(in), {});
  }
  uint64_t header_len = 0;
  for (int i = 7; i >= 0; --i) header_len = (header_len << 8) | static_cast<uint8_t>(bytes[static_cast<size_t>(i)]);
  const std::string header = bytes.substr(8, header_len);
  const nlohmann::ordered_json entries = nlohmann::ordered_json::parse(header);
  nlohmann::ordered_json reversed = nlohmann::ordered_json::object();
  for (auto it = entries.rbegin(); it != entries.rend(); ++it) reversed[it.key()] = it.value();
  std::string reordered = reversed.dump();
  ASSERT_LE(reordered.size(), header.size());
  reordered.resize(header.size(), ' ');
  ASSERT_NE(reordered, header);
  std::string spaced = bytes;
  spaced.replace(8, header.size(), reordered);
  std::ofstream(file, std::ios::binary | std::ios::trunc) << spaced;
  EXPECT_NE(open_error().find("rank_00000.safetensors: checksum mismatch"), std::string::npos) << open_error();
}

// `moecore checkpoint DIR`: iteration, tensors and pieces, then every checksum; a damaged file is an error.
TEST_F(ShardedCheckpointTest, InspectCommandPrintsAndVerifies) {
  const std::string dir = save(make_state(1), 9, false);
  std::ostringstream out;
  EXPECT_EQ(inspect_checkpoint(root_.string(), out), 0);  // the save folder: its tracker's iteration
  const std::string text = out.str();
  EXPECT_NE(text.find("checkpoint " + dir), std::string::npos) << text;
  EXPECT_NE(text.find("iteration 9"), std::string::npos) << text;
  EXPECT_NE(text.find("layer.weight F32 [6, 4] pieces: rank_00000.safetensors@[0, 0]+[6, 4]"), std::string::npos)
      << text;
  EXPECT_NE(text.find("half BF16 [5]"), std::string::npos) << text;
  EXPECT_NE(text.find("verified: every checksum matches"), std::string::npos) << text;
  std::ostringstream again;
  EXPECT_EQ(inspect_checkpoint(dir, again), 0);  // one iteration folder
  {
    std::fstream f(dir + "/rank_00000.safetensors", std::ios::in | std::ios::out | std::ios::binary);
    f.seekp(-2, std::ios::end);
    f.put('\x7f');
  }
  std::ostringstream damaged;
  EXPECT_THROW(inspect_checkpoint(dir, damaged), CheckpointError);
  EXPECT_THROW(inspect_checkpoint((root_ / "nothing").string(), damaged), std::runtime_error);
}

TEST_F(ShardedCheckpointTest, Tracker) {
  fs::create_directories(root_);
  EXPECT_FALSE(read_tracker(root_.string()).has_value());
  write_tracker(root_.string(), 1200);
  EXPECT_EQ(read_tracker(root_.string()), 1200);
  EXPECT_EQ(iteration_dir_name(1200), "iter_0001200");
  std::ofstream(tracker_path(root_.string())) << "release\n";
  EXPECT_EQ(read_tracker(root_.string()), 0);
  std::ofstream(tracker_path(root_.string())) << "12a";
  EXPECT_THROW(read_tracker(root_.string()), std::runtime_error);
  // Another file's text in the tracker: its start, control bytes escaped, on one line.
  std::ofstream(tracker_path(root_.string())) << "{\n \"format\": \"moecore_sharded\",\n \"format_version\": 1\n}\n";
  try {
    read_tracker(root_.string());
    ADD_FAILURE() << "no error";
  } catch (const std::runtime_error& e) {
    EXPECT_NE(std::string(e.what()).find("found '{\\x0a \"format\": \"moecore_sharded\",\\x0a \"format...'"),
              std::string::npos)
        << e.what();
  }
}

}  // namespace
}  // namespace moecore
