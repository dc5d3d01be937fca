// Under mpirun -np 2: a tiny MoE model trained for 8 iterations under DP2 with the distributed optimizer, with fp32
// optimizer states and with --use-precision-aware-optimizer:
// - fp32 states with the flag: bit-identical;
// - --exp-avg-dtype bf16 --exp-avg-sq-dtype bf16: iteration 1 (before any update) has the same loss, iteration 2 too
//   (the first update runs on the fp32 moments before they are stored, so the weights are bit-identical); later
//   losses follow the fp32-state run within 1e-3 relative (each stored moment is off by at most 2^-8 relative, which
//   moves each update by about that fraction; the differences stay far below the loss's own change over the run);
//   the optimizer states take half the bytes (the log's precision-aware line);
// - fp8 E4M3 moments: the same loss at iterations 1 and 2, later within 5e-3 (4 significant bits; Adam's update is
//   m / sqrt(v), so much of the moments' relative error cancels), a quarter of the bytes;
// - --bf16 with the flag (fp32 main parameters kept as bf16 weights + 16-bit remainders, starting from the bf16
//   weights) against --bf16: iteration 1 equal, later within 1e-3; the states take 10 bytes per element, not 8 (fp32
//   weights, no main copy) or 12;
// - adding --main-grads-dtype bf16: iteration 1 equal, later within 2e-3 (gradients accumulated over the two
//   micro-batches and reduced in bf16), half the gradient-reduction bytes.
// Exit status 1 on any mismatch.
#include <cmath>
#include <iostream>
#include <sstream>
#include <string>
#include <vector>

#include "moecore/parallel/mpi_runtime.h"
#include "moecore/train/trainer.h"
#include "unit/test_recipe.h"

namespace {

int failures = 0;

void check(const bool ok, const std::string& what) {
  if (!ok) ++failures;
  std::cout << (ok ? "ok: " : "FAIL: ") << what << "\n";
}

std::vector<std::string> flags(const std::vector<std::string>& extra) {
  // clang-format off
  std::vector<std::string> f = moecore::test::recipe_flags("tiny-dense", {
      "--ffn-hidden-size", "128", "--micro-batch-size", "2", "--global-batch-size", "8", "--train-iters", "8",
      "--lr", "3e-3", "--lr-warmup-iters", "2", "--log-interval", "1", "--eval-iters", "0", "--mock-data",
      "--tokenizer-type", "NullTokenizer", "--vocab-size", "500", "--seed", "3", "--num-experts", "4",
      "--moe-ffn-hidden-size", "64", "--moe-router-topk", "2", "--moe-aux-loss-coeff", "1e-2",
      "--use-distributed-optimizer", "--ddp-bucket-size", "20000"
  });
  // clang-format on
  f.insert(f.end(), extra.begin(), extra.end());
  return f;
}

struct Run {
  std::vector<double> losses;
  std::string log;
};

Run train(const std::vector<std::string>& extra) {
  const moecore::TrainingArgs args = moecore::parse_train_args(flags(extra), 2);
  std::ostringstream log;
  const moecore::TrainResult result = moecore::run_training(args, log, moecore::make_parallel_state(args));
  return {result.train_losses, log.str()};
}

// The MB after "optimizer states " in the precision-aware log line (NaN when absent).
double state_megabytes(const std::string& log) {
  const size_t at = log.find("; optimizer states ");
  return at == std::string::npos ? std::nan("") : std::stod(log.substr(at + 19));
}

// The MB per iteration of one communication kind in the last [comm] line (NaN when absent).
double comm_megabytes(const std::string& log, const std::string& kind) {
  const size_t line = log.rfind(" [comm] ");
  if (line == std::string::npos) return std::nan("");
  const size_t at = log.find(" " + kind + " ", line);
  const size_t end = log.find('|', at);
  const size_t mb = log.rfind(" / ", log.find(" MB", at));
  if (at == std::string::npos || mb == std::string::npos || mb < at || mb > end) return std::nan("");
  return std::stod(log.substr(mb + 3));
}

void compare(const Run& got, const Run& want, const size_t exact_iterations, const double rel,
             const std::string& what) {
  if (got.losses.size() != want.losses.size() || got.losses.size() != 8) {
    check(false, what + ": 8 iterations logged");
    return;
  }
  bool differs = false;
  for (size_t i = 0; i < got.losses.size(); ++i) {
    const double g = got.losses[i], w = want.losses[i];
    if (i < exact_iterations) {
      check(g == w, what + ": iteration " + std::to_string(i + 1) + " equal: " + std::to_string(g));
    } else {
      check(std::isfinite(g) && std::abs(g - w) <= rel * std::abs(w),
            what + ": iteration " + std::to_string(i + 1) + " " + std::to_string(g) + " vs " + std::to_string(w));
      differs = differs || g != w;
    }
  }
  check(differs, what + ": the rounding shows in later losses");
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
    const Run fp32 = train({});
    const Run bf16_moments =
        train({"--use-precision-aware-optimizer", "--exp-avg-dtype", "bf16", "--exp-avg-sq-dtype", "bf16"});
    const Run fp32_pao = train({"--use-precision-aware-optimizer"});
    const Run fp8_moments =
        train({"--use-precision-aware-optimizer", "--exp-avg-dtype", "fp8", "--exp-avg-sq-dtype", "fp8"});
    const Run bf16 = train({"--bf16"});
    const Run bf16_remainders = train({"--bf16", "--use-precision-aware-optimizer"});
    const Run bf16_main_grads = train({"--bf16", "--use-precision-aware-optimizer", "--main-grads-dtype", "bf16"});
    if (world.rank() == 0) {
      check(fp32_pao.losses == fp32.losses, "precision-aware with fp32 states trains bit-identically");
      compare(bf16_moments, fp32, 2, 1e-3, "bf16 moments");
      compare(fp8_moments, fp32, 2, 5e-3, "fp8 moments");
      compare(bf16_remainders, bf16, 1, 1e-3, "bf16 weights + remainders");
      compare(bf16_main_grads, bf16_remainders, 1, 2e-3, "bf16 main grads");
      const double mb_plain = state_megabytes(fp32_pao.log), mb_rem = state_megabytes(bf16_remainders.log);
      check(std::abs(mb_rem - mb_plain * 5 / 4) <= 0.01,
            "remainders: the main parameters take 2 bytes: " + std::to_string(mb_rem) + " MB");
      const double grad_mb = comm_megabytes(bf16.log, "grad-reduce");
      check(
          grad_mb > 0.0 && std::abs(comm_megabytes(bf16_main_grads.log, "grad-reduce") - grad_mb / 2) <= 1e-3 * grad_mb,
          "bf16 main grads reduce in bf16: half the gradient bytes");
      const double mb32 = state_megabytes(fp32_pao.log), mb16 = state_megabytes(bf16_moments.log);
      const double mb8 = state_megabytes(fp8_moments.log);
      check(mb32 > 0.0 && std::abs(mb16 - mb32 / 2) <= 0.01 && std::abs(mb8 - mb32 / 4) <= 0.01,
            "optimizer states: fp32 " + std::to_string(mb32) + " MB, bf16 " + std::to_string(mb16) + " MB, fp8 " +
                std::to_string(mb8) + " MB");
      if (failures > 0) std::cout << "fp32:\n" << fp32.log << "bf16 moments:\n" << bf16_moments.log;
    }
  } catch (const std::exception& e) {
    std::cerr << "error: " << e.what() << '\n';
    moecore::parallel::abort_world(1);
  }
  const double all_failures = moecore::parallel::sum_double(world, static_cast<double>(failures));
  if (world.rank() == 0) std::cout << (all_failures == 0 ? "PASS" : "FAILED") << "\n";
  return all_failures == 0 ? 0 : 1;
}
