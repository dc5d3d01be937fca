// Writes the fuzz harnesses' seed corpora (tests/fuzz/corpus/<harness>/) and dictionaries (tests/fuzz/dict/) with
// moecore's own writers, so every seed is a file moecore itself produces:
//
//   fuzz_make_corpus SOURCE_DIR     (rewrites SOURCE_DIR/tests/fuzz/corpus and SOURCE_DIR/tests/fuzz/dict)
//
// The files are committed; rerun this after a format changes.
#include <cstdint>
#include <cstdio>
#include <exception>
#include <filesystem>
#include <fstream>
#include <iostream>
#include <iterator>
#include <string>
#include <vector>

#include "fuzz_npy_fixture.h"
#include "fuzz_util.h"
#include "moecore/ckpt/hf_checkpoint.h"
#include "moecore/ckpt/safetensors.h"
#include "moecore/ckpt/sharded_checkpoint.h"
#include "moecore/ckpt/state_dict.h"
#include "moecore/config/arguments.h"
#include "moecore/data/file_bytes.h"
#include "moecore/data/indexed_dataset.h"
#include "moecore/data/npy.h"
#include "moecore/model/gpt_model.h"
#include "moecore/moe/router_trace.h"
#include "moecore/util/tensorboard_events.h"

namespace {

namespace fs = std::filesystem;
using moecore::fuzz::join_two_files;

fs::path g_corpus;

void put(const std::string& harness, const std::string& name, const std::string& bytes) {
  const fs::path dir = g_corpus / harness;
  fs::create_directories(dir);
  moecore::fuzz::write_bytes((dir / name).string(), bytes);
}

std::string slurp(const fs::path& path) { return moecore::read_file_bytes(path.string()); }

std::string as_string(const std::vector<std::byte>& bytes) {
  return std::string(reinterpret_cast<const char*>(bytes.data()), bytes.size());
}

// Tokens separated by NUL bytes (the flags harness's form for tokens with blanks).
std::string nul_joined(const std::vector<std::string>& tokens) {
  std::string out;
  for (size_t i = 0; i < tokens.size(); ++i) out += (i ? std::string(1, '\0') : std::string()) + tokens[i];
  return out;
}

// ---- flags: `train` with each configs/*.args file, `generate`, `preprocess`
void flags(const fs::path& source) {
  const std::string run =
      "--micro-batch-size 2 --global-batch-size 16 --train-iters 100 --lr 1e-3 --mock-data "
      "--tokenizer-type NullTokenizer --vocab-size 1000\n";
  for (const fs::directory_entry& entry : fs::directory_iterator(source / "configs")) {
    if (entry.path().extension() == ".args") {
      put("flags", "train_" + entry.path().stem().string(), "train\n" + slurp(entry.path()) + run);
    }
  }
  put("flags", "train_minimal",
      "--num-layers 2 --hidden-size 64 --num-attention-heads 4 --seq-length 32 --max-position-embeddings 32\n" + run);
  put("flags", "train_nul_separated",
      nul_joined({"train",
                  "--num-layers=2",
                  "--hidden-size",
                  "64",
                  "--num-attention-heads",
                  "4",
                  "--seq-length",
                  "16",
                  "--max-position-embeddings",
                  "16",
                  "--micro-batch-size",
                  "1",
                  "--train-iters",
                  "3",
                  "--lr",
                  "0.1",
                  "--mock-data",
                  "--tokenizer-type",
                  "NullTokenizer",
                  "--vocab-size",
                  "50",
                  "--split",
                  "98,2,0"}));
  put("flags", "generate",
      "generate\n--load /tmp/model\n--prompt hello\n--max-new-tokens 4 --temperature 0.7 --top-k 5 --seed 3\n");
  put("flags", "generate_nul_separated",
      nul_joined({"generate", "--load=dir", "--prompt", "two words\nand a line", "--top-k", "0"}));
  put("flags", "preprocess",
      "preprocess --input in.jsonl --output-prefix out --workers 2 --tokenizer-type NullTokenizer --vocab-size 100 "
      "--json-keys text title --append-eod --log-interval 10\n");
}

void flags_dict(const fs::path& dict_dir) {
  std::ofstream out(dict_dir / "flags.dict");
  out << "# moecore train / generate / preprocess flag names and values (written by fuzz_make_corpus)\n";
  for (const std::string& flag : moecore::implemented_train_flags()) out << '"' << flag << "\"\n";
  for (const char* token : {"train",
                            "generate",
                            "preprocess",
                            "=",
                            "--load",
                            "--prompt",
                            "--max-new-tokens",
                            "--temperature",
                            "--top-k",
                            "--seed",
                            "--input",
                            "--output-prefix",
                            "--workers",
                            "--json-keys",
                            "--partitions",
                            "--append-eod",
                            "--vocab-file",
                            "--merge-file",
                            "NullTokenizer",
                            "GPT2BPETokenizer",
                            "rope",
                            "learned_absolute",
                            "none",
                            "RMSNorm",
                            "LayerNorm",
                            "linear",
                            "cosine",
                            "constant",
                            "wsd",
                            "inverse-square-root",
                            "aux_loss",
                            "seq_aux_loss",
                            "global_aux_loss",
                            "sinkhorn",
                            "softmax",
                            "sigmoid",
                            "alltoall",
                            "allgather",
                            "fp32",
                            "fp64",
                            "bf16",
                            "([0]*3+[1]*9)",
                            "[1,0,1,0]",
                            "969,30,1",
                            "0,1,0",
                            "-1,1,1",
                            "1e-8"}) {
    out << '"' << token << "\"\n";
  }
}

// ---- indexed_dataset: .idx + .bin pairs from IndexedDatasetWriter
void indexed_dataset(const fs::path& scratch) {
  const auto write = [&](const std::string& name, moecore::IndexedDType dtype,
                         const std::vector<std::vector<std::vector<int32_t>>>& documents) {
    const std::string prefix = (scratch / name).string();
    moecore::IndexedDatasetWriter writer(prefix, dtype);
    for (const auto& document : documents) {
      for (const auto& sequence : document) writer.add_sequence(sequence);
      writer.end_document();
    }
    writer.finalize();
    put("indexed_dataset", name, join_two_files(slurp(prefix + ".idx"), slurp(prefix + ".bin")));
  };
  write("uint16_three_documents", moecore::IndexedDType::kU16, {{{1, 2, 3, 4, 5}}, {{6, 7}}, {{8, 9, 10, 11}}});
  write("int32_sentences", moecore::IndexedDType::kI32, {{{100, 200}, {300}}, {{400, 500, 600}}, {{7}, {8}, {9}}});
  write("uint8_with_empty", moecore::IndexedDType::kU8, {{{1, 2}}, {{}}, {{3}}});
  write("int64_one", moecore::IndexedDType::kI64, {{{42, 43, 44, 45, 46, 47, 48}}});
  write("empty", moecore::IndexedDType::kU16, {});
}

// ---- preprocess: JSONL
void preprocess() {
  put("preprocess", "ids",
      "{\"text\": \"1 2 3\", \"title\": \"4\"}\n{\"text\": \"5 6 7 8 9\", \"title\": \"10 11\"}\n");
  put("preprocess", "sentence_lists",
      "{\"text\": [\"1 2\", \"3\"], \"title\": [\"4\"]}\n{\"text\": [], \"title\": \"\"}\n");
  put("preprocess", "id_lists",
      "{\"text\": [1, 2, 3], \"title\": \"4\"}\n{\"text\": \"5 6\", \"title\": [7, 0, 1000]}\n");
  put("preprocess", "gpt2_text",
      "{\"text\": \"Hello, world! It's 2024 -- caf\\u00e9 \\ud83d\\ude00   spaces\\n\\ttabs\", \"title\": \"1\"}\n"
      "{\"text\": \"\\u4e2d\\u6587 and 's 're 've 'll 123456 x\", \"title\": \"2\"}\n");
}

// ---- safetensors: encode_safetensors of every dtype
void safetensors() {
  using moecore::DType;
  using moecore::Tensor;
  const auto tensor = [](std::vector<int64_t> shape, DType dtype) {
    Tensor t(shape, dtype);
    auto* bytes = t.data<unsigned char>();
    for (size_t i = 0; i < t.nbytes(); ++i) bytes[i] = static_cast<unsigned char>(i * 37 + 11);
    return t;
  };
  put("safetensors", "all_dtypes",
      as_string(moecore::encode_safetensors({{"a.weight", tensor({2, 3}, DType::kF32)},
                                             {"b.bf16", tensor({4}, DType::kBF16)},
                                             {"c.f16", tensor({2, 2}, DType::kF16)},
                                             {"d.f64", tensor({1}, DType::kF64)},
                                             {"e.i32", tensor({3}, DType::kI32)},
                                             {"f.i64", tensor({}, DType::kI64)},
                                             {"g.u8", tensor({0}, DType::kU8)}},
                                            {{"format", "pt"}})));
  put("safetensors", "one_matrix", as_string(moecore::encode_safetensors({{"w", tensor({4, 2}, DType::kF32)}})));
  put("safetensors", "empty", as_string(moecore::encode_safetensors({})));
}

// ---- hf_config: config.json of an export of each supported model_type
moecore::ModelConfig dense_config() {
  moecore::ModelConfig c;
  c.num_layers = 2;
  c.hidden_size = 32;
  c.ffn_hidden_size = 48;
  c.num_attention_heads = 4;
  c.num_query_groups = 2;
  c.kv_channels = 8;
  c.seq_length = 16;
  c.max_position_embeddings = 64;
  c.vocab_size = 96;
  c.normalization = moecore::Normalization::kRMSNorm;
  c.activation = moecore::Activation::kSwiGLU;
  c.add_bias_linear = false;
  c.position_embedding_type = moecore::PositionEmbedding::kRope;
  c.rotary_base = 500000.0;
  c.attention_dropout = 0.0;
  c.hidden_dropout = 0.0;
  return c;
}

moecore::ModelConfig moe_config(int64_t layers) {
  moecore::ModelConfig c = dense_config();
  c.num_layers = layers;
  c.untie_embeddings_and_output_weights = true;
  c.moe.num_experts = 4;
  c.moe.ffn_hidden_size = 24;
  c.moe.moe_layer_pattern.assign(static_cast<size_t>(layers), true);
  c.moe.topk = 2;
  c.moe.load_balancing_types = {moecore::LoadBalancingType::kAuxLoss};
  c.moe.aux_loss_coeffs = {0.01};
  return c;
}

void hf_config(const fs::path& scratch) {
  std::vector<std::pair<std::string, moecore::ModelConfig>> models;
  models.emplace_back("llama", dense_config());
  moecore::ModelConfig qwen3 = dense_config();
  qwen3.qk_layernorm = true;
  models.emplace_back("qwen3", qwen3);
  models.emplace_back("mixtral", moe_config(2));
  moecore::ModelConfig qwen3_moe = moe_config(3);
  qwen3_moe.qk_layernorm = true;
  qwen3_moe.moe.moe_layer_pattern = {false, true, true};
  models.emplace_back("qwen3_moe", qwen3_moe);
  moecore::ModelConfig deepseek_like = moe_config(3);  // sigmoid, groups, expert bias, gated shared expert
  deepseek_like.moe.moe_layer_pattern = {false, true, true};
  deepseek_like.moe.num_experts = 8;
  deepseek_like.moe.topk = 4;
  deepseek_like.moe.score_function = moecore::RouterScoreFunction::kSigmoid;
  deepseek_like.moe.num_groups = 4;
  deepseek_like.moe.group_topk = 2;
  deepseek_like.moe.enable_expert_bias = true;
  deepseek_like.moe.topk_scaling_factor = 2.5;
  deepseek_like.moe.load_balancing_types = {moecore::LoadBalancingType::kSeqAuxLoss};
  deepseek_like.moe.shared_expert_intermediate_size = 20;
  deepseek_like.moe.shared_expert_gate = true;
  models.emplace_back("moecore_moe", deepseek_like);
  for (const auto& [type, config] : models) {
    const moecore::GPTModel model(config, 1);
    moecore::HfExportInfo info;
    info.model_type = type;
    const fs::path dir = scratch / ("hf_" + type);
    moecore::export_hf(model, info, dir.string());
    put("hf_config", type, slurp(dir / "config.json"));
  }
}

// ---- npy: npy_encode of each dtype (selector 0) and the fixture dataset's cache files (selectors 1-3)
void npy(const fs::path& scratch) {
  put("npy", "i8_vector", std::string(1, '\0') + moecore::npy_encode(moecore::NpyDType::kI8, {3}, {-1, 0, 1 << 20}));
  put("npy", "i4_matrix", std::string(1, '\0') + moecore::npy_encode(moecore::NpyDType::kI4, {2, 2}, {1, 2, 3, 4}));
  put("npy", "u2_empty", std::string(1, '\0') + moecore::npy_encode(moecore::NpyDType::kU2, {0}, {}));
  put("npy", "i2_scalar", std::string(1, '\0') + moecore::npy_encode(moecore::NpyDType::kI2, {}, {-7}));
  put("npy", "u4_vector", std::string(1, '\0') + moecore::npy_encode(moecore::NpyDType::kU4, {2}, {0, 4000000000}));
  const fs::path cache = scratch / "gpt_cache";
  (void)moecore::fuzz::fixture_dataset(cache.string());
  for (size_t k = 0; k < 3; ++k) {
    for (const fs::directory_entry& entry : fs::directory_iterator(cache)) {
      const std::string name = entry.path().filename().string();
      if (name.ends_with(moecore::fuzz::kFixtureCacheFiles[k])) {
        put("npy", "cache_" + std::string(moecore::fuzz::kFixtureCacheFiles[k]),
            std::string(1, static_cast<char>(k + 1)) + slurp(entry.path()));
      }
    }
  }
}

// ---- sharded_checkpoint: a ShardedSave of a small state (an fp32 and a bf16 matrix, scalars)
void sharded_checkpoint(const fs::path& scratch) {
  moecore::Tensor matrix({3, 4}, moecore::DType::kF32);
  for (int64_t i = 0; i < matrix.numel(); ++i) matrix.data<float>()[i] = 0.25f * static_cast<float>(i);
  moecore::Tensor half({2, 4}, moecore::DType::kBF16);
  for (size_t i = 0; i < half.nbytes(); ++i) half.data<unsigned char>()[i] = static_cast<unsigned char>(i * 13 + 7);
  moecore::StateDict state;
  moecore::StatePlacement whole;
  whole.shard = moecore::ParamShard{0, 1, 1, 0, {3, 4}};
  state.add_tensor("model.weight", matrix, whole);
  moecore::StatePlacement half_whole;
  half_whole.shard = moecore::ParamShard{0, 1, 1, 0, {2, 4}};
  state.add_tensor("model.bf16_weight", half, half_whole);
  state.add_i64("iteration", 7);
  state.add_f64("lr", 0.5);
  moecore::CheckpointInfo info;
  info.iteration = 7;
  const std::string root = (scratch / "ckpt").string();
  moecore::ShardedSave save(state, moecore::parallel::ProcessGroup::self(), root, info, false);
  save.finalize(true);
  const fs::path dir = save.final_dir();
  put("sharded_checkpoint", "iteration_7",
      join_two_files(slurp(dir / "metadata.json"), slurp(dir / "rank_00000.safetensors")));
}

// ---- run_report: a TensorBoard event file (selector 0), a training log (1), a routing trace (2)
void run_report(const fs::path& scratch) {
  std::string events;
  {
    moecore::TensorBoardWriter writer((scratch / "tb").string(), 1);
    writer.add_scalar("lm loss", 10.5, 1, 1.0);
    writer.add_scalar("learning-rate", 3e-4, 1, 1.0);
    writer.add_scalar("moe/min_load_ratio_layer_0", 0.25, 2, 2.0);
    writer.add_scalar("iteration-time", 0.4, 2, 2.0);
    events = slurp(writer.path());
  }
  put("run_report", "events", std::string(1, '\0') + events);
  put("run_report", "log",
      std::string(1, '\1') +
          " [2026-12-06 19:53:36.701150] iteration        1/      30 | consumed samples:            8 | elapsed "
          "time per iteration (ms): 448.7 | throughput per GPU (TFLOP/s/GPU): 0.314 | learning rate: 6.000000E-04 | "
          "global batch size:     8 | lm loss: 1.083297E+01 | load_balancing_loss: 1.053783E+00 | loss scale: 1.0 | "
          "grad norm: 4.027 | num zeros: 12 | params norm: 84.006 | number of skipped iterations:   0 | number of "
          "nan iterations:   0 | time left (estimate): 0:00:12 |\n"
          " [MoE] layer 0 tokens per expert: [796 428 559 650] | min/max load ratio: 0.264 / 1.555 |\n"
          "[Rank 0] (after 1 iterations) memory (MB) | params: 56.6 (peak 56.7) | total peak: 344.6\n"
          " [comm] per iteration, max over ranks (ms / share of step [/ MB sent]): all-to-all 1.5 / 0.3% / 2.5 MB |\n"
          "WARNING: [MoE] layer 0: experts 1 (load ratio 0.000), 3 (load ratio 0.010) have had under 0.100 of the "
          "layer's mean tokens per expert since iteration 2 (3 log intervals or more)\n"
          " validation loss at iteration 1 | lm loss value: 7.489700E+00 | lm loss PPL: 1.789515E+03 | \n"
          " validation loss at iteration 1 on test set | lm loss value: 6.819604E+00 | lm loss PPL: 9.1E+02 | \n"
          "> training throughput: 4812.8 tokens/s over 1 iterations\n");
  {
    moecore::RouterTracer tracer({.dir = (scratch / "trace").string(), .max_steps = 2, .rank = 0});
    moecore::Tensor map({2, 4}, moecore::DType::kU8);
    for (const int at : {0, 3, 5, 6}) map.data<uint8_t>()[at] = 1;
    const moecore::Tensor weight({4, 2}, moecore::DType::kF32);
    tracer.record({.mtp = false, .layer = 1, .mtp_idx = std::nullopt}, map, 2, moecore::Tensor(), moecore::Tensor(),
                  {weight, {}, "softmax"});
    tracer.record({.mtp = true, .layer = 0, .mtp_idx = 0}, map, 2, moecore::Tensor(), moecore::Tensor(),
                  {weight, {}, "softmax"});
    tracer.advance_step(0);
  }
  put("run_report", "trace", std::string(1, '\2') + slurp(scratch / "trace" / "router_trace_rank0.jsonl"));
}

}  // namespace

int main(int argc, char** argv) {
  if (argc != 2) {
    std::cerr << "usage: fuzz_make_corpus SOURCE_DIR\n";
    return 2;
  }
  try {
    const fs::path source = argv[1];
    g_corpus = source / "tests/fuzz/corpus";
    const fs::path dict_dir = source / "tests/fuzz/dict";
    fs::remove_all(g_corpus);
    fs::create_directories(g_corpus);
    fs::create_directories(dict_dir);
    const moecore::fuzz::ScratchDir scratch("make_corpus");
    flags(source);
    flags_dict(dict_dir);
    indexed_dataset(scratch.path());
    preprocess();
    safetensors();
    hf_config(scratch.path());
    npy(scratch.path());
    sharded_checkpoint(scratch.path());
    run_report(scratch.path());
  } catch (const std::exception& e) {
    std::cerr << "error: " << e.what() << '\n';
    return 1;
  }
  return 0;
}
