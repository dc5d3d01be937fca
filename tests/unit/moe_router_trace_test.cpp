// RouterTracer (--moe-routing-trace-path): the exact JSONL text of Megatron's router_trace.py records (json.dumps
// separators, Megatron's key order, "mtp_idx" for MTP depths, top_indices last), records buffered until
// advance_step stamps them with its step, in call order; maps without exactly top-k experts per token left out;
// tracing stops after max_steps; the bf16 sidecars (offsets, byte counts, shapes; the bytes the round-to-nearest-even
// of the inputs); files emptied at construction; unwritable folders named in the error.
#include <gtest/gtest.h>

#include <array>
#include <bit>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <memory>
#include <sstream>
#include <stdexcept>
#include <string>
#include <vector>

#include "moecore/moe/router_trace.h"
#include "moecore/tensor/dtype.h"
#include "moecore/tensor/rng.h"
#include "test_temp_dir.h"

namespace moecore {
namespace {

namespace fs = std::filesystem;

// A kU8 routing map [rows, experts] with a 1 at each listed expert of each row.
Tensor routing_map(const std::vector<std::vector<int>>& rows, const int64_t experts) {
  Tensor map({static_cast<int64_t>(rows.size()), experts}, DType::kU8);
  uint8_t* bits = map.data<uint8_t>();
  for (size_t t = 0; t < rows.size(); ++t) {
    for (const int e : rows[t]) bits[t * static_cast<size_t>(experts) + static_cast<size_t>(e)] = 1;
  }
  return map;
}

// An fp32 tensor [rows, columns] holding `values` row-major.
Tensor fp32(const std::vector<float>& values, const int64_t rows, const int64_t columns) {
  Tensor out({rows, columns}, DType::kF32);
  EXPECT_EQ(static_cast<int64_t>(values.size()), rows * columns);
  std::memcpy(out.data<float>(), values.data(), values.size() * sizeof(float));
  return out;
}

// A router state for the weights file (read only with dump_router_weights).
const RouterTraceWeights& no_weights() {
  static const Tensor weight = fp32({0.0f}, 1, 1);
  static const RouterTraceWeights weights{weight, {}, "softmax"};
  return weights;
}

float from_bits(const uint32_t bits) { return std::bit_cast<float>(bits); }

std::string read_text(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  std::ostringstream text;
  text << in.rdbuf();
  return text.str();
}

// The file's little-endian 16-bit words.
std::vector<uint16_t> read_words(const std::string& path) {
  const std::string bytes = read_text(path);
  std::vector<uint16_t> words(bytes.size() / 2);
  for (size_t i = 0; i < words.size(); ++i) {
    words[i] = static_cast<uint16_t>(static_cast<uint8_t>(bytes[2 * i]) |
                                     (static_cast<uint16_t>(static_cast<uint8_t>(bytes[2 * i + 1])) << 8));
  }
  EXPECT_EQ(bytes.size() % 2, 0u) << path;
  return words;
}

RouterTraceSite decoder(const int64_t layer) { return {.mtp = false, .layer = layer, .mtp_idx = std::nullopt}; }

RouterTraceOptions options(const test::TempDir& dir, const int64_t max_steps, const int rank = 0) {
  return {.dir = dir.path("trace"), .max_steps = max_steps, .rank = rank};
}

TEST(RouterTracer, WritesMegatronRecordTextAtAdvanceStep) {
  const test::TempDir dir("router_trace");
  RouterTracer tracer(options(dir, 10, /*rank=*/1));
  const std::string jsonl = dir.path("trace/router_trace_rank1.jsonl");
  ASSERT_TRUE(fs::exists(jsonl));  // created (empty) at construction, as Megatron's open(path, "w")
  EXPECT_FALSE(fs::exists(dir.path("trace/hidden_states_rank1.bin")));  // sidecars only when asked for
  EXPECT_FALSE(fs::exists(dir.path("trace/logits_rank1.bin")));
  EXPECT_TRUE(tracer.active());

  tracer.record(decoder(3), routing_map({{0, 3}, {1, 2}}, 4), 2, Tensor(), Tensor(), no_weights());
  EXPECT_EQ(read_text(jsonl), "");  // buffered until the step ends
  tracer.advance_step(7);
  EXPECT_EQ(read_text(jsonl),
            "{\"step\": 7, \"stage\": \"pre_dispatch\", \"block\": \"decoder\", \"layer\": 3, \"rank\": 1, "
            "\"num_tokens\": 2, \"topk\": 2, \"top_indices\": [[0, 3], [1, 2]]}\n");
  EXPECT_EQ(tracer.records_written(), 1);
  EXPECT_EQ(tracer.records_left_out(), 0);
}

TEST(RouterTracer, SeveralRecordsPerStepInCallOrderWithMtpIdx) {
  const test::TempDir dir("router_trace");
  RouterTracer tracer(options(dir, 10));
  // Step 4: two micro-batches of layer 1 around layer 0, then an MTP depth; step 5: one record. The maps' experts
  // are read in ascending order whatever order the router chose them in.
  tracer.record(decoder(1), routing_map({{5, 2}}, 8), 2, Tensor(), Tensor(), no_weights());
  tracer.record(decoder(0), routing_map({{7, 0}, {3, 4}, {6, 1}}, 8), 2, Tensor(), Tensor(), no_weights());
  tracer.record(decoder(1), routing_map({{1, 7}}, 8), 2, Tensor(), Tensor(), no_weights());
  tracer.record({.mtp = true, .layer = 0, .mtp_idx = 1}, routing_map({{2}, {0}}, 3), 1, Tensor(), Tensor(),
                no_weights());
  tracer.advance_step(4);
  tracer.record(decoder(12), routing_map({{0, 1, 2}}, 3), 3, Tensor(), Tensor(), no_weights());
  tracer.advance_step(5);
  EXPECT_EQ(read_text(dir.path("trace/router_trace_rank0.jsonl")),
            "{\"step\": 4, \"stage\": \"pre_dispatch\", \"block\": \"decoder\", \"layer\": 1, \"rank\": 0, "
            "\"num_tokens\": 1, \"topk\": 2, \"top_indices\": [[2, 5]]}\n"
            "{\"step\": 4, \"stage\": \"pre_dispatch\", \"block\": \"decoder\", \"layer\": 0, \"rank\": 0, "
            "\"num_tokens\": 3, \"topk\": 2, \"top_indices\": [[0, 7], [3, 4], [1, 6]]}\n"
            "{\"step\": 4, \"stage\": \"pre_dispatch\", \"block\": \"decoder\", \"layer\": 1, \"rank\": 0, "
            "\"num_tokens\": 1, \"topk\": 2, \"top_indices\": [[1, 7]]}\n"
            "{\"step\": 4, \"stage\": \"pre_dispatch\", \"block\": \"mtp\", \"layer\": 0, \"rank\": 0, "
            "\"num_tokens\": 2, \"topk\": 1, \"mtp_idx\": 1, \"top_indices\": [[2], [0]]}\n"
            "{\"step\": 5, \"stage\": \"pre_dispatch\", \"block\": \"decoder\", \"layer\": 12, \"rank\": 0, "
            "\"num_tokens\": 1, \"topk\": 3, \"top_indices\": [[0, 1, 2]]}\n");
  EXPECT_EQ(tracer.records_written(), 5);
}

TEST(RouterTracer, StepWithoutRecordsWritesNothingButCounts) {
  const test::TempDir dir("router_trace");
  RouterTracer tracer(options(dir, 2));
  tracer.advance_step(0);  // e.g. a pipeline rank without MoE layers: the step still counts towards max_steps
  tracer.record(decoder(0), routing_map({{1}}, 2), 1, Tensor(), Tensor(), no_weights());
  tracer.advance_step(1);
  EXPECT_FALSE(tracer.active());
  EXPECT_EQ(read_text(dir.path("trace/router_trace_rank0.jsonl")),
            "{\"step\": 1, \"stage\": \"pre_dispatch\", \"block\": \"decoder\", \"layer\": 0, \"rank\": 0, "
            "\"num_tokens\": 1, \"topk\": 1, \"top_indices\": [[1]]}\n");
}

TEST(RouterTracer, LeavesOutMapsWithoutTopkExpertsForEveryToken) {
  const test::TempDir dir("router_trace");
  RouterTraceOptions opts = options(dir, 10);
  opts.capture_hidden_states = true;
  opts.capture_logits = true;
  RouterTracer tracer(opts);
  const Tensor hidden = fp32({1, 2, 3, 4}, 2, 2);
  const Tensor logits = fp32({1, 2, 3, 4, 5, 6}, 2, 3);
  // A token dropped by the capacity: 3 nonzeros for 2 tokens x top-2 (Megatron's hook returns).
  tracer.record(decoder(0), routing_map({{0, 1}, {2}}, 3), 2, hidden, logits, no_weights());
  // 4 nonzeros, but one token has none and the other three: not each token's top-2 either.
  tracer.record(decoder(1), routing_map({{}, {0, 1, 2}}, 3), 2, hidden, logits, no_weights());
  // A token routed to no expert at all under top-1.
  tracer.record(decoder(2), routing_map({{}, {1}}, 3), 1, hidden, logits, no_weights());
  // More than top-k experts for a token (5 nonzeros).
  tracer.record(decoder(2), routing_map({{0, 2}, {0, 1, 2}}, 3), 2, hidden, logits, no_weights());
  EXPECT_EQ(tracer.records_left_out(), 4);
  tracer.record(decoder(3), routing_map({{1, 2}, {0, 2}}, 3), 2, hidden, logits, no_weights());
  tracer.advance_step(0);
  EXPECT_EQ(tracer.records_written(), 1);
  EXPECT_EQ(tracer.records_left_out(), 4);
  // Nothing of the left-out maps reached the sidecars: the kept record's bytes start at 0.
  EXPECT_EQ(read_text(dir.path("trace/router_trace_rank0.jsonl")),
            "{\"step\": 0, \"stage\": \"pre_dispatch\", \"block\": \"decoder\", \"layer\": 3, \"rank\": 0, "
            "\"num_tokens\": 2, \"topk\": 2, \"hs_offset\": 0, \"hs_bytes\": 8, \"hs_shape\": [2, 2], "
            "\"logit_offset\": 0, \"logit_bytes\": 12, \"logit_shape\": [2, 3], \"top_indices\": [[1, 2], [0, 2]]}\n");
  EXPECT_EQ(fs::file_size(dir.path("trace/hidden_states_rank0.bin")), 8u);
  EXPECT_EQ(fs::file_size(dir.path("trace/logits_rank0.bin")), 12u);
}

TEST(RouterTracer, StopsAfterMaxSteps) {
  const test::TempDir dir("router_trace");
  RouterTraceOptions opts = options(dir, 2);
  opts.capture_logits = true;
  RouterTracer tracer(opts);
  const Tensor logits = fp32({0.5f, -0.5f}, 1, 2);
  for (int64_t step = 0; step < 2; ++step) {
    EXPECT_TRUE(tracer.active()) << step;
    tracer.record(decoder(0), routing_map({{1}}, 2), 1, Tensor(), logits, no_weights());
    tracer.advance_step(step);
  }
  EXPECT_FALSE(tracer.active());
  const std::string jsonl = dir.path("trace/router_trace_rank0.jsonl");
  const std::string written = read_text(jsonl);
  EXPECT_EQ(written,
            "{\"step\": 0, \"stage\": \"pre_dispatch\", \"block\": \"decoder\", \"layer\": 0, \"rank\": 0, "
            "\"num_tokens\": 1, \"topk\": 1, \"logit_offset\": 0, \"logit_bytes\": 4, \"logit_shape\": [1, 2], "
            "\"top_indices\": [[1]]}\n"
            "{\"step\": 1, \"stage\": \"pre_dispatch\", \"block\": \"decoder\", \"layer\": 0, \"rank\": 0, "
            "\"num_tokens\": 1, \"topk\": 1, \"logit_offset\": 4, \"logit_bytes\": 4, \"logit_shape\": [1, 2], "
            "\"top_indices\": [[1]]}\n");
  // Later records and steps are ignored: the files stay as they were, the counts too.
  tracer.record(decoder(0), routing_map({{0}}, 2), 1, Tensor(), logits, no_weights());
  tracer.record(decoder(0), routing_map({{0}, {}}, 2), 1, Tensor(), logits,
                no_weights());  // not even counted as left out
  tracer.advance_step(2);
  tracer.advance_step(3);
  EXPECT_FALSE(tracer.active());
  EXPECT_EQ(read_text(jsonl), written);
  EXPECT_EQ(fs::file_size(dir.path("trace/logits_rank0.bin")), 8u);
  EXPECT_EQ(tracer.records_written(), 2);
  EXPECT_EQ(tracer.records_left_out(), 0);
}

TEST(RouterTracer, SidecarsHoldBf16RoundedToNearestEven) {
  const test::TempDir dir("router_trace");
  RouterTraceOptions opts = options(dir, 10, /*rank=*/3);
  opts.capture_hidden_states = true;
  opts.capture_logits = true;
  RouterTracer tracer(opts);
  // Hand-computed round-to-nearest-even cases: exact, a tie to an even / odd upper half, above and below the
  // tie, negative, and FLT_MAX (rounds up to +inf).
  const Tensor hidden0 = fp32(
      {1.0f, from_bits(0x3F808000u), from_bits(0x3F818000u), from_bits(0x3F80C000u), from_bits(0x3F807FFFu), -2.5f}, 2,
      3);
  const std::vector<uint16_t> hidden0_bf16 = {0x3F80, 0x3F80, 0x3F82, 0x3F81, 0x3F80, 0xC020};
  const Tensor logits0 = fp32({from_bits(0x7F7FFFFFu), 0.15625f, from_bits(0xBF7F8000u), from_bits(0x00018000u), 0.0f,
                               -0.0f, from_bits(0x4049FFFFu), from_bits(0xC0490000u)},
                              2, 4);
  const std::vector<uint16_t> logits0_bf16 = {0x7F80, 0x3E20, 0xBF80, 0x0002, 0x0000, 0x8000, 0x404A, 0xC049};
  for (size_t i = 0; i < hidden0_bf16.size(); ++i) {
    EXPECT_EQ(fp32_to_bf16(hidden0.data<float>()[i]), hidden0_bf16[i]) << i;  // the hand values are moecore's
  }
  for (size_t i = 0; i < logits0_bf16.size(); ++i) EXPECT_EQ(fp32_to_bf16(logits0.data<float>()[i]), logits0_bf16[i]);
  tracer.record(decoder(0), routing_map({{0, 1}, {2, 3}}, 4), 2, hidden0, logits0, no_weights());

  // A larger record of random values in the same step: its bytes follow the first record's.
  constexpr int64_t T = 37, H = 19, E = 8;
  std::vector<float> hidden_values(T * H), logit_values(T * E);
  const CounterRng hidden_rng(1234, stream_key("hidden")), logits_rng(1234, stream_key("logits"));
  for (size_t i = 0; i < hidden_values.size(); ++i) hidden_values[i] = static_cast<float>(3 * hidden_rng.normal(i));
  for (size_t i = 0; i < logit_values.size(); ++i) logit_values[i] = static_cast<float>(0.01 * logits_rng.normal(i));
  std::vector<std::vector<int>> rows;
  for (int64_t t = 0; t < T; ++t) rows.push_back({static_cast<int>(E - 1), static_cast<int>(t % (E - 1))});
  tracer.record(decoder(2), routing_map(rows, E), 2, fp32(hidden_values, T, H), fp32(logit_values, T, E), no_weights());
  tracer.advance_step(0);

  const std::string text = read_text(dir.path("trace/router_trace_rank3.jsonl"));
  const std::string first =
      "{\"step\": 0, \"stage\": \"pre_dispatch\", \"block\": \"decoder\", \"layer\": 0, \"rank\": 3, "
      "\"num_tokens\": 2, \"topk\": 2, \"hs_offset\": 0, \"hs_bytes\": 12, \"hs_shape\": [2, 3], "
      "\"logit_offset\": 0, \"logit_bytes\": 16, \"logit_shape\": [2, 4], \"top_indices\": [[0, 1], [2, 3]]}\n";
  const std::string second_head =
      "{\"step\": 0, \"stage\": \"pre_dispatch\", \"block\": \"decoder\", \"layer\": 2, \"rank\": 3, "
      "\"num_tokens\": 37, \"topk\": 2, \"hs_offset\": 12, \"hs_bytes\": 1406, \"hs_shape\": [37, 19], "
      "\"logit_offset\": 16, \"logit_bytes\": 592, \"logit_shape\": [37, 8], \"top_indices\": [[0, 7], [1, 7], ";
  ASSERT_EQ(text.substr(0, first.size()), first);
  EXPECT_EQ(text.substr(first.size(), second_head.size()), second_head);

  std::vector<uint16_t> hidden_expected = hidden0_bf16, logits_expected = logits0_bf16;
  for (const float v : hidden_values) hidden_expected.push_back(fp32_to_bf16(v));
  for (const float v : logit_values) logits_expected.push_back(fp32_to_bf16(v));
  EXPECT_EQ(read_words(dir.path("trace/hidden_states_rank3.bin")), hidden_expected);
  EXPECT_EQ(read_words(dir.path("trace/logits_rank3.bin")), logits_expected);
}

TEST(RouterTracer, Bf16InputsAreCopiedBitForBit) {
  const test::TempDir dir("router_trace");
  RouterTraceOptions opts = options(dir, 1);
  opts.capture_hidden_states = true;
  RouterTracer tracer(opts);
  Tensor hidden({2, 2}, DType::kBF16);
  const std::vector<uint16_t> bits = {0x3F81, 0xFF80, 0x0001, 0xC2F7};  // odd mantissa, -inf, a subnormal, -123.5
  std::memcpy(hidden.data<uint16_t>(), bits.data(), bits.size() * sizeof(uint16_t));
  tracer.record(decoder(0), routing_map({{0}, {1}}, 2), 1, hidden, Tensor(), no_weights());
  tracer.advance_step(0);
  EXPECT_EQ(read_words(dir.path("trace/hidden_states_rank0.bin")), bits);
  EXPECT_FALSE(fs::exists(dir.path("trace/logits_rank0.bin")));
  EXPECT_NE(read_text(dir.path("trace/router_trace_rank0.jsonl"))
                .find("\"hs_offset\": 0, \"hs_bytes\": 8, "
                      "\"hs_shape\": [2, 2], \"top_indices\""),
            std::string::npos);
}

TEST(RouterTracer, ConstructionEmptiesThisRanksFiles) {
  const test::TempDir dir("router_trace");
  RouterTraceOptions opts = options(dir, 10);
  opts.capture_hidden_states = true;
  opts.capture_logits = true;
  {
    RouterTracer tracer(opts);
    tracer.record(decoder(0), routing_map({{0}}, 2), 1, fp32({1, 2}, 1, 2), fp32({3, 4}, 1, 2), no_weights());
    tracer.advance_step(0);
  }
  const std::string jsonl = dir.path("trace/router_trace_rank0.jsonl");
  ASSERT_GT(fs::file_size(jsonl), 0u);
  ASSERT_EQ(fs::file_size(dir.path("trace/hidden_states_rank0.bin")), 4u);
  ASSERT_EQ(fs::file_size(dir.path("trace/logits_rank0.bin")), 4u);
  std::ofstream(dir.path("trace/router_trace_rank1.jsonl")) << "another rank's\n";

  RouterTracer second(opts);  // a new run on the same folder: this rank's files start empty
  EXPECT_EQ(fs::file_size(jsonl), 0u);
  EXPECT_EQ(fs::file_size(dir.path("trace/hidden_states_rank0.bin")), 0u);
  EXPECT_EQ(fs::file_size(dir.path("trace/logits_rank0.bin")), 0u);
  EXPECT_EQ(read_text(dir.path("trace/router_trace_rank1.jsonl")), "another rank's\n");  // not this rank's
  second.record(decoder(5), routing_map({{1}}, 2), 1, fp32({1, 2}, 1, 2), fp32({3, 4}, 1, 2), no_weights());
  second.advance_step(9);
  EXPECT_EQ(read_text(jsonl),
            "{\"step\": 9, \"stage\": \"pre_dispatch\", \"block\": \"decoder\", \"layer\": 5, \"rank\": 0, "
            "\"num_tokens\": 1, \"topk\": 1, \"hs_offset\": 0, \"hs_bytes\": 4, \"hs_shape\": [1, 2], "
            "\"logit_offset\": 0, \"logit_bytes\": 4, \"logit_shape\": [1, 2], \"top_indices\": [[1]]}\n");
}

// --moe-routing-trace-dump-weights: each router's state as of its first record (later ones do not replace it), read
// back by PyTorch's torch.load (/usr/bin/python3) with Megatron's keys and fields.
TEST(RouterTracer, DumpsEachRoutersFirstStateForTorchLoad) {
  const test::TempDir dir("router_trace");
  RouterTraceOptions with_weights = options(dir, 2);
  with_weights.dump_router_weights = true;
  RouterTracer tracer(with_weights);
  const Tensor first = fp32({0.5f, -1.0f, 0.25f, 2.0f, -0.125f, 3.0f}, 3, 2);
  const Tensor later = fp32({9.0f, 9.0f, 9.0f, 9.0f, 9.0f, 9.0f}, 3, 2);
  const std::vector<float> bias = {0.1f, -0.2f, 0.3f};
  tracer.record(decoder(1), routing_map({{0}}, 3), 1, Tensor(), Tensor(), {first, bias, "sigmoid"});
  tracer.record(decoder(1), routing_map({{2}}, 3), 1, Tensor(), Tensor(), {later, {}, "softmax"});
  tracer.record({.mtp = true, .layer = 0, .mtp_idx = 0}, routing_map({{1}}, 3), 1, Tensor(), Tensor(),
                {later, {}, "softmax"});
  tracer.advance_step(0);
  tracer.finish();
  const std::string script =
      "import torch, sys\n"
      "d = torch.load(sys.argv[1])\n"
      "print(sorted(d, key=str))\n"
      "s = d[('decoder', None, 1)]\n"
      "print(s['weight'].tolist(), s['expert_bias'].tolist(), s['score_function'], s['topk'])\n"
      "m = d[('mtp', 0, 0)]\n"
      "print(m['weight'].sum().item(), m['expert_bias'], m['score_function'])\n";
  std::string out;
  {
    std::unique_ptr<FILE, int (*)(FILE*)> pipe(
        popen(("/usr/bin/python3 -c \"" + script + "\" " + dir.path("trace/router_state_rank0.pt") + " 2>&1").c_str(),
              "r"),
        pclose);
    std::array<char, 4096> buffer{};
    while (pipe && fgets(buffer.data(), buffer.size(), pipe.get()) != nullptr) out += buffer.data();
  }
  EXPECT_EQ(out,
            "[('decoder', None, 1), ('mtp', 0, 0)]\n"
            "[[0.5, -1.0], [0.25, 2.0], [-0.125, 3.0]] [0.10000000149011612, -0.20000000298023224, "
            "0.30000001192092896] sigmoid 1\n"
            "54.0 None softmax\n");
}

TEST(RouterTracer, UnwritableFolderThrowsNamingThePath) {
  const test::TempDir dir("router_trace");
  std::ofstream(dir.path("plain_file")) << "x";
  // A folder below a regular file cannot be created (also as root).
  RouterTraceOptions below_file{.dir = dir.path("plain_file/trace"), .max_steps = 1};
  test::expect_error_containing<std::runtime_error>([&] { RouterTracer tracer(below_file); },
                                                    dir.path("plain_file/trace"));
  // The folder exists, but this rank's trace file is a folder.
  fs::create_directories(dir.path("trace/router_trace_rank2.jsonl"));
  test::expect_error_containing<std::runtime_error>([&] { RouterTracer tracer(options(dir, 1, /*rank=*/2)); },
                                                    dir.path("trace/router_trace_rank2.jsonl"));
  // Likewise a sidecar asked for.
  fs::create_directories(dir.path("trace/logits_rank0.bin"));
  RouterTraceOptions logits = options(dir, 1);
  logits.capture_logits = true;
  test::expect_error_containing<std::runtime_error>([&] { RouterTracer tracer(logits); },
                                                    dir.path("trace/logits_rank0.bin"));
}

}  // namespace
}  // namespace moecore
