// Under mpirun -np 2: the training log of a DP2 run against one process on the same global batch (rank 0 runs the
// one-process reference first: one micro-batch of 4 samples, where DP2 gives each rank a micro-batch of 2).
// - global_load_balancing_loss: Megatron sums it over tp-dp-cp without averaging over DP (router.py:
//   _apply_global_aux_loss, needs_dp_avg=False), so the DP2 value equals the one-process value;
// - lm loss (iteration 1, before any update) and the validation loss before training, with --eod-mask-loss on
//   documents of different lengths: token-weighted over the global batch, so equal to the one-process values;
// - the throughput figure: FLOPs of the global batch / (seconds x 1e12 x world size 2); with packed sequences the
//   FLOPs of the global batch's documents (Megatron's THD count), the same under DP2 as in one process;
// - context parallelism: dp_size()/dp_rank() are the DP group's, dp_cp_size()/dp_cp_rank() the dp-cp group's;
// - --log-params-norm / --log-num-zeros-in-grad under DP2 (replicated and distributed optimizer, fp32 and bf16), TP2,
//   EP2 and PP2 (tied and untied embeddings) equal the one-process figures.
// Exit status 1 on any mismatch.
#include <algorithm>
#include <cmath>
#include <filesystem>
#include <iostream>
#include <sstream>
#include <string>
#include <vector>

#include "moecore/data/indexed_dataset.h"
#include "moecore/parallel/mpi_runtime.h"
#include "moecore/parallel/parallel_state.h"
#include "moecore/train/log_format.h"
#include "moecore/train/trainer.h"
#include "moecore/train/training_log.h"
#include "moecore/train/training_setup.h"
#include "unit/test_recipe.h"

namespace {

int failures = 0;

void check(const bool ok, const std::string& what) {
  if (!ok) ++failures;
  std::cout << (ok ? "ok: " : "FAIL: ") << what << "\n";
}

void check_close(const double got, const double want, const double rel, const std::string& what) {
  check(std::abs(got - want) <= rel * std::abs(want),
        what + ": " + std::to_string(got) + " vs " + std::to_string(want));
}

// The number after `key` in the first line holding `line_marker` (NaN when absent).
double logged(const std::string& log, const std::string& line_marker, const std::string& key) {
  const size_t line = log.find(line_marker);
  if (line == std::string::npos) return std::nan("");
  const size_t end = log.find('\n', line);
  const size_t at = log.find(key, line);
  if (at == std::string::npos || at > end) return std::nan("");
  return std::stod(log.substr(at + key.size()));
}

void write_corpus(const std::string& prefix) {
  moecore::IndexedDatasetWriter writer(prefix, moecore::IndexedDType::kI32);
  uint64_t state = 777;
  for (int d = 0; d < 300; ++d) {
    state = state * 6364136223846793005ULL + 1442695040888963407ULL;
    const int length = 1 + static_cast<int>((state >> 33) % 9);
    std::vector<int32_t> tokens;
    for (int t = 0; t < length; ++t) tokens.push_back(static_cast<int32_t>((state >> (t + 3)) % 60));
    tokens.push_back(60);  // EOD of NullTokenizer --vocab-size 60
    writer.add_document(tokens);
  }
  writer.finalize();
}

std::vector<std::string> flags(const std::string& dir, const int micro_batch_size) {
  // clang-format off
  return moecore::test::recipe_flags("tiny-moe", {
      "--attention-dropout", "0", "--hidden-dropout", "0", "--micro-batch-size", std::to_string(micro_batch_size),
      "--global-batch-size", "4", "--train-iters", "2", "--lr", "1e-3", "--log-interval", "1", "--eval-iters", "1",
      "--tokenizer-type", "NullTokenizer", "--vocab-size", "60", "--data-path", dir + "/corpus",
      "--split", "70,30,0", "--data-cache-path", dir + "/cache", "--eod-mask-loss", "--seed", "11",
      "--moe-router-load-balancing-type", "global_aux_loss", "--moe-aux-loss-coeff", "0.01", "--log-throughput"
  });
  // clang-format on
}

}  // namespace

int main(int argc, char** argv) {
  moecore::parallel::MpiRuntime mpi(&argc, &argv);
  const moecore::parallel::ProcessGroup world = moecore::parallel::ProcessGroup::world();
  if (world.size() != 2) {
    std::cerr << "run under mpirun -np 2\n";
    return 2;
  }
  try {
    // Context parallelism: CP 2 over the 2 ranks, DP 1.
    moecore::ParallelSizes cp_sizes;
    cp_sizes.world_size = 2;
    cp_sizes.context_parallel_size = 2;
    const auto cp = moecore::parallel::ParallelState::create(cp_sizes, false, world);
    check(cp.dp_size() == 1 && cp.dp_rank() == 0, "CP2: dp_size() 1, dp_rank() 0");
    check(cp.dp_cp_size() == 2 && cp.dp_cp_rank() == world.rank(), "CP2: dp_cp_size() 2, dp_cp_rank() = rank");

    const std::string dir = "dist_train_logging_work";
    std::string reference;
    if (world.rank() == 0) {
      std::filesystem::remove_all(dir);
      std::filesystem::create_directories(dir);
      write_corpus(dir + "/corpus");
      std::ostringstream log;
      moecore::run_training(moecore::parse_train_args(flags(dir, 4), 1), log,
                            moecore::parallel::ParallelState::single_process());
      reference = log.str();
    }
    moecore::parallel::sum_double(world, 0.0);  // the corpus exists before rank 1 reads it

    const moecore::TrainingArgs args = moecore::parse_train_args(flags(dir, 2), 2);
    const auto dp2 = moecore::make_parallel_state(args);
    check(dp2.dp_size() == 2 && dp2.dp_rank() == world.rank(), "DP2: dp_size() 2, dp_rank() = rank");
    std::ostringstream log;
    moecore::run_training(args, log, dp2);

    // Throughput: what the logger passes to Megatron's formula.
    const moecore::TrainingArgs run_args = moecore::with_padded_vocabulary(args, moecore::build_vocabulary(args));
    std::ostringstream unused;
    const moecore::LRSchedule schedule(moecore::lr_schedule_config(run_args));
    const moecore::TrainingLogger logger(run_args, schedule, dp2, unused);
    const double flops = moecore::num_floating_point_operations(run_args.model, 4, 16);
    check(logger.flops_per_iteration() == flops, "FLOPs per iteration are the global batch's");
    check_close(logger.throughput_per_gpu(0.5), flops / (0.5 * 1e12 * 2), 1e-12, "TFLOP/s/GPU divides by world 2");

    if (world.rank() == 0) {
      const std::string dp_log = log.str();
      const std::string line1 = "] iteration        1/       2 |";
      check_close(logged(dp_log, line1, " global_load_balancing_loss: "),
                  logged(reference, line1, " global_load_balancing_loss: "), 1e-5,
                  "iteration 1 global_load_balancing_loss");
      check_close(logged(dp_log, line1, " lm loss: "), logged(reference, line1, " lm loss: "), 1e-5,
                  "iteration 1 lm loss");
      const std::string valid0 = " validation loss at iteration 0 |";
      check_close(logged(dp_log, valid0, " lm loss value: "), logged(reference, valid0, " lm loss value: "), 1e-5,
                  "validation loss before training");
      if (failures > 0) std::cout << "one process:\n" << reference << "DP2:\n" << dp_log;
    }

    // Communicated bytes (the [comm] line's MB per iteration), DP2 with the distributed optimizer: bf16 weights halve
    // the parameter all-gather; gradients reduce in fp32 under --bf16 (Megatron's default) and in bf16, half the
    // bytes, with --grad-reduce-in-bf16.
    const auto comm_megabytes = [&](const std::vector<std::string>& extra, const std::string& kind) {
      std::vector<std::string> run = flags(dir, 2);
      run.insert(run.end(), {"--eval-iters", "0"});
      run.insert(run.end(), extra.begin(), extra.end());
      const bool model_parallel = std::find(run.begin(), run.end(), "--tensor-model-parallel-size") != run.end() ||
                                  std::find(run.begin(), run.end(), "--expert-model-parallel-size") != run.end();
      if (!model_parallel) run.push_back("--use-distributed-optimizer");
      const moecore::TrainingArgs comm_args = moecore::parse_train_args(run, 2);
      std::ostringstream out;
      moecore::run_training(comm_args, out, model_parallel ? moecore::make_parallel_state(comm_args) : dp2);
      const std::string text = out.str();
      const size_t line = text.rfind(" [comm] ");
      if (line == std::string::npos) return std::nan("");
      const size_t at = text.find(" " + kind + " ", line);
      const size_t end = text.find('|', at);
      const size_t mb = text.rfind(" / ", text.find(" MB", at));
      if (at == std::string::npos || mb == std::string::npos || mb < at || mb > end) return std::nan("");
      return std::stod(text.substr(mb + 3));
    };
    const double fp32_grad = comm_megabytes({}, "grad-reduce"), fp32_param = comm_megabytes({}, "param-gather");
    const double bf16_grad = comm_megabytes({"--bf16"}, "grad-reduce");
    const double bf16_param = comm_megabytes({"--bf16"}, "param-gather");
    const double bf16_wire_grad = comm_megabytes({"--bf16", "--grad-reduce-in-bf16"}, "grad-reduce");
    if (world.rank() == 0) {
      check(fp32_grad > 0 && fp32_param > 0, "fp32 gradient and parameter bytes are logged");
      check_close(bf16_grad, fp32_grad, 1e-9, "bf16: gradients still reduce in fp32");
      check_close(bf16_param, fp32_param / 2, 1e-3, "bf16: the parameter all-gather moves half the bytes");
      check_close(bf16_wire_grad, fp32_grad / 2, 1e-3, "--grad-reduce-in-bf16: half the gradient bytes");
    }
    // EP2, the alltoall dispatcher: under --bf16 the token rows, the expert outputs and both their gradients move in
    // bf16, the probabilities and their gradients in fp32. The forced-balance router routes alike in both runs, so
    // each rank sends and receives the same rows: (sent + received) x (2 H x 2 + 4) bytes against (2 H x 4 + 4),
    // H = 32 (the [comm] line prints 4 significant digits).
    const std::vector<std::string> ep2_flags = {"--expert-model-parallel-size", "2", "--moe-token-dispatcher-type",
                                                "alltoall", "--moe-router-force-load-balancing"};
    std::vector<std::string> ep2_bf16_flags = ep2_flags;
    ep2_bf16_flags.push_back("--bf16");
    const double fp32_a2a = comm_megabytes(ep2_flags, "all-to-all");
    const double bf16_a2a = comm_megabytes(ep2_bf16_flags, "all-to-all");
    if (world.rank() == 0) {
      check(fp32_a2a > 0, "EP2: all-to-all bytes are logged");
      check_close(bf16_a2a / fp32_a2a, (4.0 * 32 + 4) / (8.0 * 32 + 4), 2e-3,
                  "bf16: dispatched rows move in 16 bits, probabilities in fp32");
    }
    // LatentMoE (--moe-latent-size 8 of H = 32): the dispatcher moves fc1_latent_proj's rows, 8 features instead of
    // 32, so the fp32 bytes fall from (sent + received) x (2 H x 4 + 4) to (2 x 8 x 4 + 4).
    std::vector<std::string> ep2_latent_flags = ep2_flags;
    ep2_latent_flags.insert(ep2_latent_flags.end(), {"--moe-latent-size", "8"});
    const double latent_a2a = comm_megabytes(ep2_latent_flags, "all-to-all");
    if (world.rank() == 0) {
      check_close(latent_a2a / fp32_a2a, (8.0 * 8 + 4) / (8.0 * 32 + 4), 2e-3,
                  "--moe-latent-size 8: the all-to-all moves 8 of 32 features per row");
    }
    // TP2 with sequence parallelism: the activations' gathers and reduce-scatters move 16-bit values under --bf16.
    const std::vector<std::string> tp2_flags = {"--tensor-model-parallel-size", "2", "--sequence-parallel",
                                                "--expert-tensor-parallel-size", "1"};
    std::vector<std::string> tp2_bf16_flags = tp2_flags;
    tp2_bf16_flags.push_back("--bf16");
    const double fp32_tp = comm_megabytes(tp2_flags, "tensor-parallel");
    const double bf16_tp = comm_megabytes(tp2_bf16_flags, "tensor-parallel");
    if (world.rank() == 0) {
      check(fp32_tp > 0, "fp32 tensor-parallel bytes are logged");
      check_close(bf16_tp, fp32_tp / 2, 1e-3, "bf16: tensor-parallel activations move half the bytes");
    }

    // --log-params-norm and --log-num-zeros-in-grad count every element once, whatever the layout: the 2-rank
    // layouts log the one-process figures (the norm within the layouts' rounding of one update; the zeros, which
    // here are the embedding rows of the padded vocabulary and of tokens no sample holds, exactly).
    // The vocabulary (61 ids) padded to 64 in one process and under TP2 alike; no linear biases: the key bias's
    // gradient is zero in exact arithmetic, so its rounding leaves exact zeros by chance.
    const std::vector<std::string> stat_flags = {"--log-params-norm",
                                                 "--log-num-zeros-in-grad",
                                                 "--eval-iters",
                                                 "0",
                                                 "--untie-embeddings-and-output-weights",
                                                 "--make-vocab-size-divisible-by",
                                                 "32",
                                                 "--disable-bias-linear"};
    const auto statistics_log = [&](const std::vector<std::string>& layout, const int world_size,
                                    const moecore::parallel::ParallelState* state) {
      std::vector<std::string> run = flags(dir, world_size == 1 ? 4 : 2);
      run.insert(run.end(), stat_flags.begin(), stat_flags.end());
      run.insert(run.end(), layout.begin(), layout.end());
      const moecore::TrainingArgs stat_args = moecore::parse_train_args(run, world_size);
      std::ostringstream out;
      moecore::run_training(stat_args, out, state ? *state : moecore::make_parallel_state(stat_args));
      return out.str();
    };
    std::string stat_reference;
    const moecore::parallel::ParallelState single = moecore::parallel::ParallelState::single_process();
    if (world.rank() == 0) stat_reference = statistics_log({}, 1, &single);
    const std::vector<std::pair<std::string, std::vector<std::string>>> stat_layouts = {
        {"DP2", {}},
        {"DP2 distributed optimizer", {"--use-distributed-optimizer"}},
        {"DP2 distributed optimizer bf16", {"--use-distributed-optimizer", "--bf16"}},
        {"TP2 SP", {"--tensor-model-parallel-size", "2", "--sequence-parallel", "--expert-tensor-parallel-size", "1"}},
        {"EP2", {"--expert-model-parallel-size", "2"}},
        {"PP2", {"--pipeline-model-parallel-size", "2"}}};
    std::string bf16_reference;
    if (world.rank() == 0) bf16_reference = statistics_log({"--bf16"}, 1, &single);
    for (const auto& [name, layout] : stat_layouts) {
      const std::string text = statistics_log(layout, 2, nullptr);
      if (world.rank() != 0) continue;
      const bool bf16 = std::find(layout.begin(), layout.end(), "--bf16") != layout.end();
      const std::string& want = bf16 ? bf16_reference : stat_reference;
      for (const std::string iteration : {"1", "2"}) {
        const std::string line = "] iteration        " + iteration + "/       2 |";
        const double zeros = logged(want, line, " num zeros: "), got = logged(text, line, " num zeros: ");
        check(zeros > 0 && got == zeros,
              name + ": iteration " + iteration + " num zeros " + std::to_string(got) + " vs " + std::to_string(zeros));
        check_close(logged(text, line, " params norm: "), logged(want, line, " params norm: "), 1e-5,
                    name + ": iteration " + iteration + " params norm");
      }
    }

    // Tied embeddings under PP2: the last stage's copy of the word embeddings is not counted again.
    std::vector<std::string> tied_flags = flags(dir, 4);
    tied_flags.insert(tied_flags.end(), {"--log-params-norm", "--eval-iters", "0"});
    std::string tied_reference;
    if (world.rank() == 0) {
      std::ostringstream out;
      moecore::run_training(moecore::parse_train_args(tied_flags, 1), out, single);
      tied_reference = out.str();
    }
    tied_flags[std::find(tied_flags.begin(), tied_flags.end(), "--micro-batch-size") - tied_flags.begin() + 1] = "2";
    tied_flags.insert(tied_flags.end(), {"--pipeline-model-parallel-size", "2"});
    const moecore::TrainingArgs tied_args = moecore::parse_train_args(tied_flags, 2);
    std::ostringstream tied_log;
    moecore::run_training(tied_args, tied_log, moecore::make_parallel_state(tied_args));
    if (world.rank() == 0) {
      const std::string line = "] iteration        2/       2 |";
      check_close(logged(tied_log.str(), line, " params norm: "), logged(tied_reference, line, " params norm: "), 1e-5,
                  "PP2 tied embeddings: iteration 2 params norm");
    }

    // Packed sequences (--reset-attention-mask): the FLOPs count runs over the documents of the global batch, which
    // DP2 sums over its two ranks' micro-batches; it must equal the one-process count, and fall below the unpacked
    // count (documents of 2..10 tokens in sequences of 16).
    std::vector<std::string> packed_flags = flags(dir, 4);
    packed_flags.push_back("--reset-attention-mask");
    double packed_reference_flops = 0.0;
    if (world.rank() == 0) {
      std::ostringstream packed_log;
      const moecore::TrainResult one = moecore::run_training(moecore::parse_train_args(packed_flags, 1), packed_log,
                                                             moecore::parallel::ParallelState::single_process());
      packed_reference_flops = one.progress.floating_point_operations_so_far;
      check_close(logged(packed_log.str(), "] iteration        2/       2 |", " real tokens per iteration: "), 64.0,
                  0.0, "packed: 4 x 16 real tokens per iteration");
    }
    packed_flags[std::find(packed_flags.begin(), packed_flags.end(), "--micro-batch-size") - packed_flags.begin() + 1] =
        "2";
    std::ostringstream packed_log;
    const moecore::TrainResult packed_dp2 =
        moecore::run_training(moecore::parse_train_args(packed_flags, 2), packed_log, dp2);
    if (world.rank() == 0) {
      check_close(packed_dp2.progress.floating_point_operations_so_far, packed_reference_flops, 1e-12,
                  "packed: DP2 counts the FLOPs of the global batch's documents as one process");
      check(packed_reference_flops < 2.0 * flops, "packed: documents count fewer attention FLOPs than whole sequences");
      check_close(logged(packed_log.str(), "] iteration        2/       2 |", " real tokens per iteration: "), 64.0,
                  0.0, "packed DP2: 4 x 16 real tokens per iteration");
      std::filesystem::remove_all(dir);
    }
  } catch (const std::exception& e) {
    std::cerr << "error: " << e.what() << '\n';
    moecore::parallel::abort_world(1);
  }
  const double all_failures = moecore::parallel::sum_double(world, static_cast<double>(failures));
  if (world.rank() == 0) std::cout << (all_failures == 0 ? "PASS" : "FAILED") << "\n";
  return all_failures == 0 ? 0 : 1;
}
