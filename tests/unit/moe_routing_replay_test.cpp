// Router replay's pieces (moe/routing_recording.h, moe/routing_replay.h): the recording file round trip and its
// refusal of every corruption (each byte flipped, each truncation), the recorder's first-routing-per-position rule, the
// per-micro-batch table and the lookup of training samples by their tokens.
#include <gtest/gtest.h>
#include <unistd.h>

#include <cstdint>
#include <filesystem>
#include <fstream>
#include <functional>
#include <iterator>
#include <string>
#include <vector>

#include "moecore/model/config.h"
#include "moecore/moe/routing_recording.h"
#include "moecore/moe/routing_replay.h"

namespace moecore {
namespace {

namespace fs = std::filesystem;

std::string temp_path(const std::string& name) {
  const fs::path dir = fs::temp_directory_path() / ("moecore_routing_replay_test_" + std::to_string(::getpid()));
  fs::create_directories(dir);
  return (dir / name).string();
}

std::string bytes_of(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  return std::string((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
}

void write_bytes(const std::string& path, const std::string& bytes) {
  std::ofstream(path, std::ios::binary | std::ios::trunc) << bytes;
}

// Two routers (layers 1 and 3), top-2 over 4 experts; records of 3 tokens (2 routed) and 2 tokens (2 routed).
RoutingRecording small_recording() {
  RoutingRecording r;
  r.topk = 2;
  r.num_experts = 4;
  r.router_layers = {1, 3};
  r.records.push_back({{7, 8, 9}, 2, {0, 1, 2, 3, 3, 0, 1, 2}});
  r.records.push_back({{5, 6}, 2, {1, 0, 3, 2, 2, 1, 0, 3}});
  return r;
}

ModelConfig moe_model(const int64_t seq_length) {
  ModelConfig c;
  c.num_layers = 4;
  c.seq_length = seq_length;
  c.moe.num_experts = 4;
  c.moe.topk = 2;
  c.moe.moe_layer_pattern = {false, true, false, true};
  return c;
}

std::string error_of(const std::function<void()>& f) {
  try {
    f();
  } catch (const ConfigError& e) {
    return e.what();
  }
  return "";
}

TEST(RoutingRecording, RoundTrip) {
  const std::string path = temp_path("round_trip.bin");
  const RoutingRecording written = small_recording();
  write_routing_recording(path, written);
  const RoutingRecording read = read_routing_recording(path);
  EXPECT_EQ(read.topk, 2);
  EXPECT_EQ(read.num_experts, 4);
  EXPECT_EQ(read.router_layers, written.router_layers);
  ASSERT_EQ(read.records.size(), 2u);
  for (size_t i = 0; i < 2; ++i) {
    EXPECT_EQ(read.records[i].tokens, written.records[i].tokens);
    EXPECT_EQ(read.records[i].routed, written.records[i].routed);
    EXPECT_EQ(read.records[i].experts, written.records[i].experts);
  }
  EXPECT_EQ(read.experts_of(read.records[0], 1, 0)[0], 3);  // token 1, router 0: experts {3, 0}
  EXPECT_EQ(read.experts_of(read.records[0], 1, 0)[1], 0);
  // The documented layout: magic, version, sizes, the layers, the count, the CRC; each record's counts first.
  const std::string bytes = bytes_of(path);
  EXPECT_EQ(bytes.substr(0, 8), "MOEROUTE");
  EXPECT_EQ(bytes.size(), 8u + 4 * 4 + 2 * 4 + 8 + 4 + (8 + 3 * 4 + 8 * 4 + 4) + (8 + 2 * 4 + 8 * 4 + 4));
}

TEST(RoutingRecording, EveryFlippedByteAndEveryTruncationIsRefused) {
  const std::string path = temp_path("good.bin"), bad = temp_path("bad.bin");
  write_routing_recording(path, small_recording());
  const std::string bytes = bytes_of(path);
  for (size_t i = 0; i < bytes.size(); ++i) {
    std::string flipped = bytes;
    flipped[i] = static_cast<char>(flipped[i] ^ 0x10);
    write_bytes(bad, flipped);
    const std::string error = error_of([&] { read_routing_recording(bad); });
    EXPECT_NE(error.find("routing recording " + bad + ": "), std::string::npos) << "byte " << i << ": " << error;
    EXPECT_EQ(error.find('\n'), std::string::npos) << error;
  }
  for (size_t size = 0; size < bytes.size(); ++size) {
    write_bytes(bad, bytes.substr(0, size));
    EXPECT_FALSE(error_of([&] { read_routing_recording(bad); }).empty()) << "truncated to " << size;
  }
  write_bytes(bad, bytes + "x");
  EXPECT_NE(error_of([&] { read_routing_recording(bad); }).find("bytes after the last of its 2 records"),
            std::string::npos);
  EXPECT_EQ(error_of([&] { read_routing_recording(temp_path("absent.bin")); }),
            "routing recording " + temp_path("absent.bin") + ": no such file");
}

TEST(RoutingRecording, InconsistentRecordingsAreNamed) {
  RoutingRecording r = small_recording();
  r.records[0].experts[3] = 4;
  EXPECT_EQ(routing_recording_problem(r), "record 0: token 0, router 1: expert 4 is outside [0, 4)");
  r = small_recording();
  r.records[1].experts[5] = 2;
  EXPECT_EQ(routing_recording_problem(r), "record 1: token 1, router 0: expert 2 is chosen twice");
  r = small_recording();
  r.records[0].routed = 4;
  EXPECT_EQ(routing_recording_problem(r), "record 0: more routed tokens than tokens");
  r = small_recording();
  r.records[1].experts.pop_back();
  EXPECT_EQ(routing_recording_problem(r), "record 1: expert ids do not fill routed x routers x top-k");
  EXPECT_NE(error_of([&] { write_routing_recording(temp_path("never.bin"), r); }).find("do not fill"),
            std::string::npos);
  EXPECT_FALSE(fs::exists(temp_path("never.bin")));
}

TEST(RoutingRecorder, KeepsTheFirstRoutingOfEachPosition) {
  RoutingRecorder recorder(moe_model(8));
  const auto selection = [](std::vector<int32_t> ids) {
    Tensor t = Tensor::zeros({static_cast<int64_t>(ids.size() / 2), 2}, DType::kI32);
    std::copy(ids.begin(), ids.end(), t.data<int32_t>());
    return t;
  };
  // Prefill of 3 positions, then one decode step; then a re-run of all 4 positions routes differently (ignored).
  recorder.begin_forward(0);
  recorder.record(0, selection({0, 1, 1, 2, 2, 3}));
  recorder.record(1, selection({3, 2, 2, 1, 1, 0}));
  recorder.begin_forward(3);
  recorder.record(0, selection({3, 0}));
  recorder.record(1, selection({0, 3}));
  recorder.begin_forward(0);
  recorder.record(0, selection({1, 0, 1, 0, 1, 0, 1, 0}));
  const RoutingRecord record = recorder.finish({10, 11, 12, 13, 14});
  EXPECT_EQ(record.tokens, (std::vector<int32_t>{10, 11, 12, 13, 14}));
  EXPECT_EQ(record.routed, 4);  // the last token was never fed
  EXPECT_EQ(record.experts, (std::vector<int32_t>{0, 1, 3, 2, 1, 2, 2, 1, 2, 3, 1, 0, 3, 0, 0, 3}));
  recorder.begin_forward(6);
  EXPECT_THROW(recorder.record(0, selection({0, 1})), std::logic_error);  // a gap after position 4
}

TEST(RoutingReplay, TablesFollowTheSamplesTokensAndTheLocalRows) {
  const std::string path = temp_path("replay.bin");
  RoutingRecording r = small_recording();
  r.records.push_back({{7, 8, 4}, 2, {2, 3, 0, 1, 1, 2, 3, 0}});  // same first 2 tokens as record 0: record 0 wins
  write_routing_recording(path, r);
  const RoutingReplaySource source(path, moe_model(2));
  EXPECT_EQ(source.num_records(), 3);
  // Two samples: [5, 6] (record 1), [7, 8] (record 0). Rows t = s * B + b.
  const std::vector<int32_t> tokens_BS = {5, 6, 7, 8};
  const RoutingReplayBatch batch = source.batch(tokens_BS, 2, 10);
  const Tensor all = batch.local_selection(1, TokenRows(), 4);
  const std::vector<int32_t> router1(all.data<int32_t>(), all.data<int32_t>() + 8);
  // s=0: b=0 record 1 token 0 router 1 {3, 2}, b=1 record 0 token 0 router 1 {2, 3}; s=1: {0, 3}, {1, 2}.
  EXPECT_EQ(router1, (std::vector<int32_t>{3, 2, 2, 3, 0, 3, 1, 2}));
  // Context-parallel rank 0 of 2 over the 4 rows: chunks 0 and 3, i.e. one-process rows 0 (record 1, token 0) and 3
  // (record 0, token 1); router 0.
  const Tensor local = batch.local_selection(0, TokenRows::context_parallel(4, 1, 0, 2), 2);
  EXPECT_EQ(std::vector<int32_t>(local.data<int32_t>(), local.data<int32_t>() + 4), (std::vector<int32_t>{1, 0, 3, 0}));
  EXPECT_EQ(source.missing(std::vector<int32_t>{5, 6, 8, 7}, 2, 10),
            "routing recording " + path + " has no record of training sample 11 (no record starts with its 2 tokens)");
  EXPECT_NE(error_of([&] {
              source.batch(std::vector<int32_t>{8, 7, 5, 6}, 2, 0);
            }).find("training sample 0"),
            std::string::npos);
}

TEST(RoutingReplay, OtherModelsRecordingsAreRefused) {
  const std::string path = temp_path("model.bin");
  write_routing_recording(path, small_recording());
  ModelConfig other = moe_model(2);
  other.moe.moe_layer_pattern = {true, true, false, true};
  EXPECT_EQ(error_of([&] { RoutingReplaySource(path, other); }),
            "routing recording " + path + ": recorded for MoE layers [1, 3], this model's are [0, 1, 3]");
  other = moe_model(2);
  other.moe.topk = 1;
  EXPECT_EQ(error_of([&] { RoutingReplaySource(path, other); }),
            "routing recording " + path + ": recorded with top-2 routing, this model has --moe-router-topk 1");
  other = moe_model(2);
  other.moe.num_experts = 8;
  EXPECT_EQ(error_of([&] { RoutingReplaySource(path, other); }),
            "routing recording " + path + ": recorded over 4 experts, this model has --num-experts 8");
  EXPECT_EQ(error_of([&] { RoutingReplaySource(path, moe_model(3)); }),
            "routing recording " + path + ": none of its 2 records routes 3 tokens (--seq-length)");
  // Appending to another model's recording is refused; to a missing file starts one.
  RoutingRecorder recorder(moe_model(2));
  RoutingRecording empty = recorder.empty_recording();
  empty.num_experts = 8;
  EXPECT_NE(error_of([&] {
              append_routing_record(path, empty, RoutingRecord{{1}, 0, {}});
            }).find("this model has"),
            std::string::npos);
  const std::string fresh = temp_path("fresh.bin");
  fs::remove(fresh);
  append_routing_record(fresh, recorder.empty_recording(), RoutingRecord{{1, 2}, 1, {0, 1, 2, 3}});
  append_routing_record(fresh, recorder.empty_recording(), RoutingRecord{{3}, 0, {}});
  EXPECT_EQ(read_routing_recording(fresh).records.size(), 2u);
}

}  // namespace
}  // namespace moecore
