// --fp8-param-gather / --fp4-param-gather under mpirun (2 or 4 ranks, plain data parallelism).
//
// Part 1, the DDP and distributed optimizer on a synthetic model (dense and expert weights, some quantized, plus
// norms, biases, an embedding and a router that stay high precision), every recipe:
//   - the model's quantized weights start as the quantization of their initial (rounded) values;
//   - after each step every rank's quantized weight equals, bit for bit, quant::quantize of the whole fp32 main
//     parameter (rounded to the weights' dtype) computed in one process: the main shards are gathered here and
//     quantized whole, while the DDP quantized shards cut inside scaling blocks (shapes chosen so the cuts fall
//     mid-block); two bucket layouts (other cuts) and the overlapped gather give the same weights;
//   - the parameter all-gather bytes per step, counted by hand: the shapes below are multiples of 128 elements, so
//     no bucket is padded and the bytes are (2 bytes x high-precision elements + 1 byte per FP8 code, or 1/2 per
//     E2M1 code) / group size + 4 bytes x scaling blocks (the amax all-reduce, which every rank sends whole).
// Part 2 (2 ranks; 4 ranks: TP2 x DP2, losses only), whole training runs of a small MoE model with --bf16
// --use-distributed-optimizer:
//   - the [comm] line's param-gather MB per iteration: the hand-counted figure, half the bf16 run's bytes for the
//     quantized weights (a quarter with FP4) plus the amax bytes;
//   - the losses of --fp8-param-gather runs against the same FP8 recipe without it (tolerances explained there).
//     The attention's products run in fp32 (ScopedAttentionProductPath): the tolerances count the bf16 roundings of
//     activations that a ~1e-7 weight perturbation may flip, and bf16 attention products (P and dS rounded to bf16,
//     kernels/cpu/attention_products.h) add many more such roundings; they are checked in kernels_attention_bf16_test.
// Prints "N passed, M failed" on rank 0; exit status 1 on any failure.
#include <bit>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <filesystem>
#include <sstream>
#include <string>
#include <vector>

#include "moecore/data/indexed_dataset.h"
#include "moecore/kernels/cpu/attention_products.h"
#include "moecore/ops/precision.h"
#include "moecore/optim/ddp.h"
#include "moecore/optim/distributed_optimizer.h"
#include "moecore/parallel/comm_stats.h"
#include "moecore/parallel/mpi_runtime.h"
#include "moecore/parallel/parallel_state.h"
#include "moecore/parallel/process_group.h"
#include "moecore/quant/quantize.h"
#include "moecore/train/trainer.h"
#include "moecore/train/training_setup.h"
#include "parallel/dist_checks.h"
#include "unit/test_recipe.h"

namespace {

using moecore::DType;
using moecore::Param;
using moecore::ParamStore;
using moecore::quant::ElementFormat;
using moecore::quant::QuantSpec;
using moecore::quant::Recipe;
using namespace moecore::test;  // NOLINT: check, g_rank, g_failures, mix, name_hash (dist_checks.h)
namespace parallel = moecore::parallel;
namespace quant = moecore::quant;

// In [-1, 1] times a magnitude that changes every 16 rows (2^-4 .. 2^1), so blocks get different scales.
float init_value(const std::string& name, const int64_t i, const int64_t cols) {
  const uint64_t z = mix(name_hash(name) ^ mix(static_cast<uint64_t>(i)));
  const double u = static_cast<double>(z >> 11) / 9007199254740992.0 * 2.0 - 1.0;
  return static_cast<float>(std::ldexp(u, static_cast<int>((i / cols / 16) % 6) - 4));
}

// A rank's gradient contribution: a multiple of 1/64 in [-4, 4].
float grad_value(const std::string& name, const int64_t i, const int rank, const int step) {
  const uint64_t z = mix(name_hash(name) ^ mix(static_cast<uint64_t>(i) * 131 + static_cast<uint64_t>(rank) * 7 +
                                               static_cast<uint64_t>(step) * 1000003));
  return static_cast<float>(static_cast<int>(z % 513) - 256) / 64.0f;
}

struct WeightSpec {
  std::string name;
  int64_t rows, cols;  // cols 1: a 1-D param of `rows` elements
  int module;
  bool expert;
  bool quantized;
};

constexpr int kExperts = 3;

// Every numel is a multiple of 128, so no bucket is padded at 2 or 4 ranks. Buffer order is backward order: the
// dense quantized buffer is [proj (10240), qkv (15360)], cut at 2 ranks at element 12800 (qkv row 26, column 64:
// inside a 128x128 block and a 16x16 tile); the expert quantized buffer is [fc2 2, fc1 2, fc2 1, fc1 1, fc2 0, fc1 0]
// (3072 / 2048 each), cut at 7680 (expert 1's fc2 row 26, column 64).
std::vector<WeightSpec> model() {
  std::vector<WeightSpec> w = {
      {"embedding.word_embeddings.weight", 64, 32, -1, false, false},
      {"decoder.layers.0.input_layernorm.weight", 128, 1, 0, false, false},
      {"decoder.layers.0.self_attention.linear_qkv.weight", 160, 96, 0, false, true},
      {"decoder.layers.0.self_attention.linear_proj.weight", 160, 64, 0, false, true},
      {"decoder.layers.0.mlp.router.weight", 4, 32, 0, false, false},
  };
  for (int e = 0; e < kExperts; ++e) {
    const std::string prefix = "decoder.layers.0.mlp.experts.local_experts." + std::to_string(e) + ".";
    w.push_back({prefix + "linear_fc1.weight", 64, 32, 0, true, true});
    w.push_back({prefix + "linear_fc2.weight", 32, 96, 0, true, true});
    w.push_back({prefix + "linear_fc2.bias", 128, 1, 0, true, false});
  }
  w.push_back({"decoder.final_layernorm.weight", 128, 1, 1, false, false});
  return w;
}

// Scaling blocks of a [rows, cols] weight, by hand from the recipes' weight blocks.
int64_t blocks(const Recipe recipe, const int64_t rows, const int64_t cols) {
  switch (recipe) {
    case Recipe::kTensorwise: return 1;
    case Recipe::kBlockwise: return ((rows + 127) / 128) * ((cols + 127) / 128);
    case Recipe::kMxfp8: return rows * (cols / 32);
    case Recipe::kNvfp4: return (rows / 16) * (cols / 16);
    case Recipe::kDelayed: break;
  }
  return -1;
}

struct Case {
  std::string name;
  Recipe recipe;
  DType params_dtype;
  bool quantized_gather = true;
  int64_t bucket_size = 0;
  bool overlap = false;
};

QuantSpec spec_of(const Recipe recipe) {
  return quant::make_spec(recipe, recipe == Recipe::kNvfp4 ? ElementFormat::kE2M1 : ElementFormat::kE4M3,
                          quant::Role::kWeight);
}

std::vector<float> rounded(std::vector<float> x, const DType dtype) {
  moecore::Tensor t({static_cast<int64_t>(x.size())}, DType::kF32, moecore::MemCategory::kOther);
  std::copy(x.begin(), x.end(), t.data<float>());
  moecore::ops::round_to_dtype_(t, dtype);
  std::copy_n(t.data<float>(), x.size(), x.begin());
  return x;
}

// The weight of the one-process reference: quantize the whole (rounded) tensor, decode.
std::vector<float> reference_weight(const std::vector<float>& full, const WeightSpec& w, const Case& c) {
  const std::vector<float> x = rounded(full, c.params_dtype);
  return quant::quantize(x.data(), w.rows, w.cols, spec_of(c.recipe), quant::Usage::kRowwise).decode();
}

bool bit_equal(const float* a, const float* b, const size_t n) {
  for (size_t i = 0; i < n; ++i) {
    if (std::bit_cast<uint32_t>(a[i]) != std::bit_cast<uint32_t>(b[i])) return false;
  }
  return true;
}

// The quantized weights after two steps (name order), for comparing layouts.
using Weights = std::vector<std::vector<float>>;

Weights run_ddp_case(const Case& c, const parallel::ParallelState& ps) {
  const std::vector<WeightSpec> specs = model();
  ParamStore params;
  for (const WeightSpec& w : specs) {
    Param p =
        moecore::make_param(w.name, w.cols == 1 ? std::vector<int64_t>{w.rows} : std::vector<int64_t>{w.rows, w.cols},
                            moecore::InitKind::kZeros);
    for (int64_t i = 0; i < p.value.numel(); ++i) p.value.data<float>()[i] = init_value(w.name, i, w.cols);
    p.module = w.module;
    p.is_expert = w.expert;
    p.linear_weight = w.cols > 1;
    if (w.quantized) p.weight_quantization = spec_of(c.recipe);
    params.push_back(std::move(p));
  }
  moecore::DdpOptions options;
  options.use_distributed_optimizer = true;
  options.quantized_param_gather = c.quantized_gather;
  options.param_gather_dtype = c.params_dtype;
  options.bucket_size = c.bucket_size;
  options.overlap_param_gather = c.overlap;
  moecore::DistributedDataParallel ddp(params, ps, options);
  moecore::AdamWOptions adam;
  adam.params_dtype = c.params_dtype;
  moecore::DistributedAdamW opt(ddp, params, adam);

  // Initial weights: the quantization of the rounded initial values.
  for (size_t i = 0; i < specs.size(); ++i) {
    if (!specs[i].quantized || !c.quantized_gather) continue;
    std::vector<float> init(static_cast<size_t>(params[i].value.numel()));
    for (size_t k = 0; k < init.size(); ++k)
      init[k] = init_value(specs[i].name, static_cast<int64_t>(k), specs[i].cols);
    const std::vector<float> want = reference_weight(init, specs[i], c);
    check(bit_equal(params[i].value.data<float>(), want.data(), want.size()),
          c.name + ": " + specs[i].name + " starts as its quantization");
  }

  const int g = ps.dp_cp.size();
  int64_t n_high = 0, n_quantized = 0, n_blocks = 0;
  for (const WeightSpec& w : specs) {
    const bool q = w.quantized && c.quantized_gather;
    (q ? n_quantized : n_high) += w.rows * w.cols;
    if (q) n_blocks += blocks(c.recipe, w.rows, w.cols);
  }
  const double high_bytes = c.params_dtype == DType::kF32 ? 4.0 : 2.0;
  const double code_bytes = c.recipe == Recipe::kNvfp4 ? 0.5 : 1.0;
  const double want_bytes = (high_bytes * static_cast<double>(n_high) + code_bytes * static_cast<double>(n_quantized)) /
                                static_cast<double>(g) +
                            4.0 * static_cast<double>(n_blocks);

  for (int step = 0; step < 2; ++step) {
    ddp.zero_grad();
    for (Param& p : params) {
      for (int64_t k = 0; k < p.grad.numel(); ++k) p.grad.data<float>()[k] = grad_value(p.name, k, g_rank, step);
    }
    ddp.finish_grad_sync();
    parallel::CommStats::instance().reset();
    opt.step(1e-2);
    for (int m = -1; m <= 1; ++m) ddp.before_forward(m);
    ddp.wait_param_gather();
    const double bytes = parallel::CommStats::instance().bytes(parallel::CommKind::kParamGather);
    if (c.bucket_size == 0) {
      check(bytes == want_bytes,
            c.name + ": param-gather bytes " + std::to_string(bytes) + ", by hand " + std::to_string(want_bytes));
    }

    // The whole fp32 main parameters: each rank's pieces, summed over the group as bit patterns (the pieces are
    // disjoint, so the sum is exact and keeps the sign of zeros).
    std::vector<std::vector<int32_t>> main_bits(specs.size());
    for (size_t i = 0; i < specs.size(); ++i) main_bits[i].assign(static_cast<size_t>(params[i].value.numel()), 0);
    for (const moecore::AdamWMomentSlice& s : opt.moment_slices()) {
      const bool has_main = s.main_param.defined();
      check(has_main || (c.params_dtype == DType::kF32 && !c.quantized_gather), c.name + ": main parameters kept");
      if (!has_main) continue;
      for (int64_t k = s.begin; k < s.end; ++k) {
        main_bits[static_cast<size_t>(s.param)][static_cast<size_t>(k)] =
            std::bit_cast<int32_t>(s.main_param.data<float>()[k - s.begin]);
      }
    }
    for (size_t i = 0; i < specs.size(); ++i) {
      if (!specs[i].quantized || !c.quantized_gather) continue;
      (specs[i].expert ? ps.edp : ps.dp_cp).all_reduce(std::span<int32_t>(main_bits[i]), parallel::ReduceOp::kSum);
      std::vector<float> main(main_bits[i].size());
      for (size_t k = 0; k < main.size(); ++k) main[k] = std::bit_cast<float>(main_bits[i][k]);
      const std::vector<float> want = reference_weight(main, specs[i], c);
      check(bit_equal(params[i].value.data<float>(), want.data(), want.size()),
            c.name + ": " + specs[i].name + " after step " + std::to_string(step + 1) +
                " equals the one-process quantization of its main parameter");
    }
  }
  Weights out;
  for (size_t i = 0; i < specs.size(); ++i) {
    if (specs[i].quantized)
      out.emplace_back(params[i].value.data<float>(), params[i].value.data<float>() + params[i].value.numel());
  }
  return out;
}

// ---------------------------------------------------------------------------------------------- part 2: training

void write_corpus(const std::string& prefix) {
  moecore::IndexedDatasetWriter writer(prefix, moecore::IndexedDType::kI32);
  uint64_t state = 777;
  for (int d = 0; d < 300; ++d) {
    state = state * 6364136223846793005ULL + 1442695040888963407ULL;
    const int length = 4 + static_cast<int>((state >> 33) % 12);
    std::vector<int32_t> tokens;
    for (int t = 0; t < length; ++t) tokens.push_back(static_cast<int32_t>((state >> (t + 3)) % 60));
    tokens.push_back(60);
    writer.add_document(tokens);
  }
  writer.finalize();
}

std::vector<std::string> train_flags(const std::string& dir) {
  // clang-format off
  return moecore::test::recipe_flags("tiny-moe", {
      "--attention-dropout", "0", "--hidden-dropout", "0", "--micro-batch-size", "2", "--global-batch-size", "4",
      "--train-iters", "8", "--lr", "3e-3", "--log-interval", "1", "--eval-iters", "0",
      "--tokenizer-type", "NullTokenizer", "--vocab-size", "60", "--data-path", dir + "/corpus",
      "--split", "100,0,0", "--data-cache-path", dir + "/cache", "--seed", "5", "--moe-aux-loss-coeff", "0.01",
      "--use-distributed-optimizer", "--bf16"
  });
  // clang-format on
}

struct Run {
  std::vector<double> losses;
  double param_megabytes = std::nan("");  // the last [comm] line's param-gather MB per iteration
  // The trained one-process model's weights with Param::weight_quantization: how many, and the largest relative
  // change when quantized once more with their recipe (0: each is its own quantization).
  int quantized_weights = 0;
  double requantize_change = 0.0;
  std::vector<float> weights;  // those weights' values, concatenated
};

// A run over `ps` (world size `world`). The weights are inspected without tensor parallelism only: the gathered
// one-process weight of a TP-sharded layer is made of shards quantized separately.
Run train(const std::string& dir, const std::vector<std::string>& extra, const parallel::ParallelState& ps,
          const int world = 2) {
  std::vector<std::string> flags = train_flags(dir);
  flags.insert(flags.end(), extra.begin(), extra.end());
  std::ostringstream log;
  Run run;
  const moecore::FullModelCallback inspect = [&](const moecore::GPTModel& model) {
    for (const Param& p : model.params()) {
      if (!p.weight_quantization || ps.tp_size() > 1) continue;
      ++run.quantized_weights;
      const float* w = p.value.data<float>();
      run.weights.insert(run.weights.end(), w, w + p.value.numel());
      quant::QuantizeOptions options;  // delayed scaling: the weight's current scale (the last gather's)
      if (p.delayed_scaling) options.tensor_scale = p.delayed_scaling->scale_fwd()[1];
      const std::vector<float> again =
          quant::quantize(w, p.value.dim(0), p.value.dim(1), *p.weight_quantization, quant::Usage::kRowwise, options)
              .decode();
      for (size_t i = 0; i < again.size(); ++i) {
        const double change = again[i] == w[i] ? 0.0 : std::abs(again[i] - w[i]) / std::abs(w[i]);
        run.requantize_change = std::max(run.requantize_change, change);
      }
    }
  };
  const moecore::TrainResult result = moecore::run_training(moecore::parse_train_args(flags, world), log, ps, inspect);
  run.losses = result.train_losses;
  const std::string text = log.str();
  const size_t line = text.rfind(" [comm] ");
  if (line == std::string::npos) return run;
  const size_t at = text.find(" param-gather ", line);
  const size_t end = text.find('|', at);
  const size_t mb = text.rfind(" / ", text.find(" MB", at));
  if (at != std::string::npos && mb != std::string::npos && mb > at && mb < end) {
    run.param_megabytes = std::stod(text.substr(mb + 3));
  }
  return run;
}

// One folder per launch size: ctest runs the 2- and 4-rank launches at the same time.
std::string work_dir() {
  return "dist_quantized_param_gather_work_np" + std::to_string(parallel::ProcessGroup::world().size());
}

void prepare_corpus(const parallel::ProcessGroup& world) {
  if (g_rank == 0) {
    std::filesystem::remove_all(work_dir());
    std::filesystem::create_directories(work_dir());
    write_corpus(work_dir() + "/corpus");
  }
  parallel::sum_double(world, 0.0);  // the corpus exists before the other ranks read it
}

// 4 ranks, TP2 x DP2 with sequence parallelism: each rank's weights are TP shards, quantized (by the GEMMs and by
// the parameter all-gather alike) with the blocks of the local shard; the losses match the runs without the flag as
// under plain data parallelism (same tolerance, same reasons).
void run_tensor_parallel_checks() {
  prepare_corpus(parallel::ProcessGroup::world());
  for (const std::string recipe : {"tensorwise", "blockwise"}) {  // mxfp8: a qkv shard of 48 columns has no 1x32 blocks
    const std::vector<std::string> flags = {"--tensor-model-parallel-size",
                                            "2",
                                            "--sequence-parallel",
                                            "--expert-tensor-parallel-size",
                                            "1",
                                            "--fp8-format",
                                            "e4m3",
                                            "--fp8-recipe",
                                            recipe};
    std::vector<std::string> all = train_flags(work_dir());
    all.insert(all.end(), flags.begin(), flags.end());
    const parallel::ParallelState tp2 = moecore::make_parallel_state(moecore::parse_train_args(all, 4));
    std::vector<std::string> with_flag = flags;
    with_flag.push_back("--fp8-param-gather");
    const Run plain = train(work_dir(), flags, tp2, 4);
    const Run gather = train(work_dir(), with_flag, tp2, 4);
    if (g_rank != 0) continue;
    check(gather.losses.size() == 8 && plain.losses.size() == 8, "TP2 " + recipe + ": 8 losses");
    for (size_t i = 0; i < gather.losses.size() && i < plain.losses.size(); ++i) {
      const double diff = std::abs(gather.losses[i] - plain.losses[i]) / plain.losses[i];
      check(diff <= 1e-5, "TP2 " + recipe + " iteration " + std::to_string(i + 1) + ": relative loss difference " +
                              std::to_string(diff));
    }
  }
  if (g_rank == 0) std::filesystem::remove_all(work_dir());
}

void run_training_checks(const parallel::ParallelState& ps) {
  const std::string dir = work_dir();
  prepare_corpus(ps.world);

  // Bytes per rank and iteration, by hand (2 ranks, bf16 weights). Dense params: word embeddings 128 x 32 (the
  // vocabulary 60 padded to 128), position embeddings 16 x 32, final norm 2 x 32 and per layer two norms 2 x 2 x 32,
  // qkv 96 x 32 + 96, proj 32 x 32 + 32, router 4 x 32: 13632 elements, padded to 13696. Expert params: 2 layers x 4
  // experts x (fc1 32 x 32 + 32, fc2 32 x 32 + 32) = 16896. bf16: (13696 + 16896) x 2 / 2 = 30592 bytes.
  // Quantized: qkv and proj weights 2 x (3072 + 1024) = 8192, expert weights 8 x 2048 = 16384 (20 weights; not the
  // router, embeddings, norms or biases); the rest, 5440 dense elements (padded to 5504: the same 64 padding elements)
  // and 512 expert elements, stays bf16: (5504 + 512) x 2 / 2 = 6016 bytes, plus codes (8192 + 16384) / 2 x 1 byte =
  // 12288 (FP8) or x 1/2 = 6144 (FP4: a quarter of bf16), plus 4 bytes per scaling block for the amax all-reduce:
  // tensorwise and blockwise (every weight within one 128 x 128 block) 20 blocks; mxfp8 1x32 blocks
  // 2 x (96 + 32 + 8 x 32) = 768; nvfp4 16x16 tiles 2 x (6 x 2 + 2 x 2 + 8 x 4) = 96.
  //
  // Losses, relative difference per iteration <= 1e-5 against the same recipe without the flag. Without the flag
  // the GEMMs quantize the bf16 weight; with it the weight is already that quantization and the GEMMs quantize it
  // again. Power-of-2 scales (blockwise, MXFP8) reproduce it exactly, and a 3-bit-mantissa value rescaled by another
  // power of two (MXFP8's 32x1 dgrad blocks of the decoded 1x32 row-block weight) only moves if it falls below
  // E4M3's normal range, about 1/(448 x 64) of its block's amax; tensorwise and NVFP4 scales round-trip to within an
  // fp32 ulp or two (quant_sharded_weight_test). So the runs should agree except where such a ~1e-7 perturbation
  // flips a bf16 or FP8 rounding of an activation. One flipped bf16 rounding (2^-8 of one of 32 hidden values, times
  // output weights ~0.02) moves one token's cross-entropy by ~1e-4 and the mean over 64 tokens by ~1.5e-6, ~3e-7
  // relative: 1e-5 allows some 30 such flips in 8 steps, while quantizing at all moves this model's loss by up to
  // 2e-4 (printed).
  const Run bf16 = train(dir, {}, ps);
  if (g_rank == 0) {
    std::printf("bf16 param-gather %.5g MB\n", bf16.param_megabytes);
    check(std::abs(bf16.param_megabytes - 30592e-6) <= 5e-4 * 30592e-6, "bf16 param-gather bytes by hand");
  }
  struct Quantized {
    std::vector<std::string> flags;
    int64_t code_bytes;
    int64_t blocks;
    bool pow2;  // power-of-2 scales: the weights are exactly their own quantization
    // Delayed scaling: the gathered one-process model that `train` inspects has fresh scaling states (scale 1), so
    // its weights are not checked against their quantization here (quant_sharded_weight_test covers the codes). And
    // the loss tolerance is wider: with the flag the initial weights are held as their quantization at TE's initial
    // scale 1 (fp8_model_init), so iteration 1's recorded weight amaxes are those of the FP8 weights instead of the
    // bf16 ones; the GEMMs of iteration 1 are identical (difference 0), and from iteration 2 the scales differ by the
    // FP8 rounding of one amax per weight, which moves the loss by less than quantizing at all does (printed as "vs
    // bf16", up to ~9e-4): 5e-4.
    bool delayed = false;
  };
  const std::vector<Quantized> recipes = {
      {{"--fp8-format", "e4m3", "--fp8-recipe", "tensorwise"}, 12288, 20, false},
      {{"--fp8-format", "e4m3", "--fp8-recipe", "blockwise"}, 12288, 20, true},
      {{"--fp8-format", "e4m3", "--fp8-recipe", "mxfp8"}, 12288, 768, true},
      {{"--fp4-format", "e2m1"}, 6144, 96, false},
      // Delayed scaling: each weight cast with its current scale, one amax per weight (recorded into its history).
      {{"--fp8-format", "e4m3", "--fp8-recipe", "delayed"}, 12288, 20, false, true},
  };
  std::vector<double> blockwise_losses;
  for (const Quantized& r : recipes) {
    const std::string name = r.flags[r.flags.size() - 1];
    std::vector<std::string> with_flag = r.flags;
    with_flag.push_back(r.flags[0] == "--fp4-format" ? "--fp4-param-gather" : "--fp8-param-gather");
    const Run plain = train(dir, r.flags, ps);
    const Run gather = train(dir, with_flag, ps);
    if (name == "blockwise") blockwise_losses = gather.losses;
    if (g_rank != 0) continue;
    const double want = static_cast<double>(6016 + r.code_bytes + 4 * r.blocks) * 1e-6;
    std::printf("%s param-gather %.5g MB (without the flag %.5g MB)\n", name.c_str(), gather.param_megabytes,
                plain.param_megabytes);
    check(std::abs(gather.param_megabytes - want) <= 5e-4 * want,
          name + ": param-gather " + std::to_string(gather.param_megabytes) + " MB, by hand " + std::to_string(want));
    check(plain.param_megabytes == bf16.param_megabytes, name + " without the flag gathers bf16");
    check(gather.quantized_weights == 20 && plain.quantized_weights == 20, name + ": 20 quantized weights");
    check(r.delayed || gather.requantize_change <= (r.pow2 ? 0.0 : std::ldexp(1.0, -20)),
          name + ": the trained weights are their own quantization (change " +
              std::to_string(gather.requantize_change) + ")");
    check(r.delayed || plain.requantize_change > 1e-3,
          name + " without the flag: bf16 weights, not on the quantization grid");
    check(gather.losses.size() == 8 && plain.losses.size() == 8, name + ": 8 losses");
    for (size_t i = 0; i < gather.losses.size() && i < plain.losses.size(); ++i) {
      const double diff = std::abs(gather.losses[i] - plain.losses[i]) / plain.losses[i];
      std::printf(
          "  %s iteration %zu: loss %.6f with the flag, %.6f without, relative difference %.3g (vs bf16 "
          "%.3g)\n",
          name.c_str(), i + 1, gather.losses[i], plain.losses[i], diff,
          std::abs(plain.losses[i] - bf16.losses[i]) / bf16.losses[i]);
      check(diff <= (r.delayed ? (i == 0 ? 0.0 : 5e-4) : 1e-5),
            name + " iteration " + std::to_string(i + 1) + ": relative loss difference " + std::to_string(diff));
    }
  }
  // A checkpoint at iteration 4, resumed to 8: the fp32 main parameters are saved (the weights hold codes), loaded,
  // quantized and gathered again, so iterations 5-8 repeat the uninterrupted run bit for bit.
  const std::vector<std::string> blockwise = {
      "--fp8-format", "e4m3",        "--fp8-recipe",    "blockwise", "--fp8-param-gather",
      "--save",       dir + "/ckpt", "--save-interval", "4"};
  std::vector<std::string> first_half = blockwise;
  first_half.insert(first_half.end(), {"--train-iters", "4", "--lr-decay-iters", "8"});
  const Run saved = train(dir, first_half, ps);
  // Loaded without training: the weights must be the saved quantized ones, not the loaded main parameters' bf16
  // values (which the GEMMs would quantize to the same, so only the weights themselves show it).
  std::vector<std::string> load_only = first_half;
  load_only.insert(load_only.end(), {"--load", dir + "/ckpt"});
  const Run loaded = train(dir, load_only, ps);
  // The longer run's weight-decay length (--train-iters x batch) differs from the saved run's: the scheduler comes
  // from the flags (the weight decay is constant, so the numbers are those of the uninterrupted run).
  std::vector<std::string> second_half = blockwise;
  second_half.insert(second_half.end(), {"--load", dir + "/ckpt", "--override-opt_param-scheduler"});
  const Run resumed = train(dir, second_half, ps);
  if (g_rank == 0) {
    check(!saved.weights.empty() && bit_equal(saved.weights.data(), loaded.weights.data(), saved.weights.size()) &&
              saved.weights.size() == loaded.weights.size(),
          "blockwise --fp8-param-gather: the loaded weights are the saved quantized weights");
    bool same = resumed.losses.size() == 4 && blockwise_losses.size() == 8;
    for (size_t i = 0; same && i < 4; ++i) same = resumed.losses[i] == blockwise_losses[4 + i];
    check(same, "blockwise --fp8-param-gather resumed from iteration 4 repeats iterations 5-8");
  }
  // --first-last-layers-bf16 with the first layer kept in bf16: only layer 1's 10 weights are quantized.
  const Run first_bf16 = train(dir,
                               {"--fp8-format", "e4m3", "--fp8-recipe", "blockwise", "--fp8-param-gather",
                                "--first-last-layers-bf16", "--num-layers-at-end-in-bf16", "0"},
                               ps);
  if (g_rank == 0) {
    check(first_bf16.quantized_weights == 10, "--first-last-layers-bf16: the bf16 layer's weights stay bf16");
    check(first_bf16.requantize_change == 0.0, "--first-last-layers-bf16: the FP8 layer's weights are FP8");
    std::filesystem::remove_all(dir);
  }
}

}  // namespace

int main(int argc, char** argv) {
  parallel::MpiRuntime mpi(&argc, &argv);
  const parallel::ProcessGroup world = parallel::ProcessGroup::world();
  g_rank = world.rank();
  moecore::ParallelSizes sizes;
  sizes.world_size = world.size();
  const parallel::ParallelState ps = parallel::ParallelState::create(sizes, false, world);

  const moecore::kernels::cpu::ScopedAttentionProductPath fp32_attention(
      moecore::kernels::cpu::AttentionProductPath::kF32);
  int passed = 0, failed = 0;
  const auto report = [&](const std::string& name) {
    std::vector<float> flag{static_cast<float>(g_failures > 0)};
    world.all_reduce(std::span<float>(flag), parallel::ReduceOp::kMax);
    (flag[0] == 0.0f ? passed : failed) += 1;
    if (g_rank == 0) std::printf("%s %s\n", flag[0] == 0.0f ? "PASS" : "FAIL", name.c_str());
    g_failures = 0;
  };
  const auto guarded = [&](const std::string& name, const auto& body) {
    try {
      body();
    } catch (const std::exception& e) {
      check(false, name + ": exception: " + e.what());
    }
    report(name);
  };

  for (const Recipe recipe : {Recipe::kTensorwise, Recipe::kBlockwise, Recipe::kMxfp8, Recipe::kNvfp4}) {
    const std::string r = quant::recipe_name(recipe);
    guarded(r + " bf16 weights", [&] {
      const Weights one = run_ddp_case({r + " bf16", recipe, DType::kBF16}, ps);
      const Weights buckets = run_ddp_case({r + " bf16, buckets of 3000", recipe, DType::kBF16, true, 3000}, ps);
      const Weights overlap = run_ddp_case({r + " bf16, overlapped", recipe, DType::kBF16, true, 3000, true}, ps);
      bool same = one.size() == buckets.size() && one.size() == overlap.size();
      for (size_t i = 0; same && i < one.size(); ++i) {
        same = bit_equal(one[i].data(), buckets[i].data(), one[i].size()) &&
               bit_equal(one[i].data(), overlap[i].data(), one[i].size());
      }
      check(same, r + ": the weights do not depend on the bucket layout or the overlap");
    });
  }
  guarded("blockwise fp32 weights", [&] { run_ddp_case({"blockwise fp32", Recipe::kBlockwise, DType::kF32}, ps); });
  guarded("bf16 without the flag", [&] {
    run_ddp_case({"bf16 without quantized gather", Recipe::kTensorwise, DType::kBF16, false}, ps);
  });
  if (world.size() == 2) guarded("training", [&] { run_training_checks(ps); });
  if (world.size() == 4) guarded("training, TP2 x DP2", [&] { run_tensor_parallel_checks(); });

  if (g_rank == 0) std::printf("%d passed, %d failed\n", passed, failed);
  return failed == 0 ? 0 : 1;
}
