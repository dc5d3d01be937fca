// Layout equivalence: `dist_equivalence_test --out REF -- <moecore train flags>` trains in one process and writes
// the per-iteration lm loss and the final parameters (and expert biases) to REF; under mpirun,
// `dist_equivalence_test --compare REF -- <same flags + a layout>` trains with that layout, gathers the model on
// rank 0 and checks every iteration's loss and every parameter tensor against the one-process run (Tolerances below:
// fp32 1e-5 / 1e-4; bf16 and fp16 runs by the size of their updates). Exit status 1 on any mismatch.
#include <cmath>
#include <cstdint>
#include <fstream>
#include <iostream>
#include <map>
#include <optional>
#include <sstream>
#include <string>
#include <vector>

#include "moecore/config/arguments.h"
#include "moecore/parallel/mpi_runtime.h"
#include "moecore/parallel/parallel_state.h"
#include "moecore/train/trainer.h"
#include "moecore/train/training_setup.h"
#include "parallel/model_tensors.h"

namespace {

struct Snapshot {
  std::vector<double> losses;
  std::map<std::string, std::vector<float>> tensors;
};

Snapshot snapshot(const moecore::GPTModel& model, const std::vector<double>& losses) {
  Snapshot out;
  out.losses = losses;
  out.tensors = moecore::test::model_tensors(model);
  return out;
}

void write(const Snapshot& s, const std::string& path) {
  std::ofstream out(path, std::ios::binary);
  const uint64_t n_losses = s.losses.size(), n_tensors = s.tensors.size();
  out.write(reinterpret_cast<const char*>(&n_losses), 8);
  out.write(reinterpret_cast<const char*>(s.losses.data()), static_cast<std::streamsize>(8 * n_losses));
  out.write(reinterpret_cast<const char*>(&n_tensors), 8);
  for (const auto& [name, values] : s.tensors) {
    const uint64_t name_len = name.size(), numel = values.size();
    out.write(reinterpret_cast<const char*>(&name_len), 8);
    out.write(name.data(), static_cast<std::streamsize>(name_len));
    out.write(reinterpret_cast<const char*>(&numel), 8);
    out.write(reinterpret_cast<const char*>(values.data()), static_cast<std::streamsize>(4 * numel));
  }
  if (!out) throw std::runtime_error("cannot write " + path);
}

Snapshot read(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  if (!in) throw std::runtime_error("cannot read the reference " + path + " (run the np1 reference test first)");
  Snapshot s;
  uint64_t n = 0;
  in.read(reinterpret_cast<char*>(&n), 8);
  s.losses.resize(n);
  in.read(reinterpret_cast<char*>(s.losses.data()), static_cast<std::streamsize>(8 * n));
  in.read(reinterpret_cast<char*>(&n), 8);
  for (uint64_t i = 0; i < n && in; ++i) {
    uint64_t name_len = 0, numel = 0;
    in.read(reinterpret_cast<char*>(&name_len), 8);
    std::string name(name_len, '\0');
    in.read(name.data(), static_cast<std::streamsize>(name_len));
    in.read(reinterpret_cast<char*>(&numel), 8);
    std::vector<float> values(numel);
    in.read(reinterpret_cast<char*>(values.data()), static_cast<std::streamsize>(4 * numel));
    s.tensors[name] = std::move(values);
  }
  if (!in) throw std::runtime_error("truncated reference " + path);
  return s;
}

// How close a layout must come to the one-process run.
//   fp32: every iteration's lm loss within relative 1e-5, every final tensor within relative 1e-4 (max |a - b| over
//     max |b|): only the summation order differs.
//   bf16 / fp16 (16-bit weights and activations): a layout sums in another order before each rounding to 16 bits,
//     which moves single activations by one 16-bit ulp (2^-8 relative in bf16); Adam turns a gradient element of
//     almost no size but another sign into a step of about lr, so single weights can differ by whole updates. The
//     loss, an average over every token, stays within relative 1e-3 (measured: 2e-5); each tensor is compared by
//     the RMS of its difference over the RMS of the update the one-process run made (final - initial) plus the RMS
//     of one 16-bit ulp of its final values (a weight stored in 16 bits moves in whole ulps: norm weights near 1.0
//     cross a rounding threshold or not after a few small steps): a layout with a wrong gradient differs by about a
//     whole update (ratio ~1), reordering by a small fraction (measured at most 0.07); the bound is 0.25.
struct Tolerances {
  double loss = 1e-5;
  double param = 1e-4;
  const Snapshot* initial = nullptr;  // 16-bit runs: compare differences to the update (final - initial)
  int mantissa_bits = 0;              // of the 16-bit format (bf16 7, fp16 10)
};

// The spacing of 16-bit values with `mantissa_bits` around x (0 at 0).
double ulp(const float x, const int mantissa_bits) {
  if (x == 0.0f) return 0.0;
  return std::ldexp(1.0, std::ilogb(x) - mantissa_bits);
}

// Number of mismatches, each printed.
int compare(const Snapshot& got, const Snapshot& want, const Tolerances& tol) {
  int failures = 0;
  if (got.losses.size() != want.losses.size()) {
    std::cout << "FAIL: " << got.losses.size() << " iterations, the reference has " << want.losses.size() << "\n";
    return 1;
  }
  double worst_loss = 0.0, worst_param = 0.0;
  std::string worst_name;
  for (size_t i = 0; i < got.losses.size(); ++i) {
    const double rel = std::abs(got.losses[i] - want.losses[i]) / std::abs(want.losses[i]);
    worst_loss = std::max(worst_loss, rel);
    if (!(rel <= tol.loss)) {
      std::cout << "FAIL: iteration " << i + 1 << " lm loss " << got.losses[i] << " vs " << want.losses[i]
                << " (relative " << rel << ")\n";
      ++failures;
    }
  }
  for (const auto& [name, ref] : want.tensors) {
    const auto it = got.tensors.find(name);
    if (it == got.tensors.end() || it->second.size() != ref.size()) {
      std::cout << "FAIL: " << name << " missing or of another size\n";
      ++failures;
      continue;
    }
    double diff = 0.0, scale = 0.0;
    if (tol.initial != nullptr) {  // RMS of the difference over RMS of the reference's update + one ulp
      const std::vector<float>& init = tol.initial->tensors.at(name);
      double quantum = 0.0;
      for (size_t i = 0; i < ref.size(); ++i) {
        diff += std::pow(static_cast<double>(it->second[i]) - ref[i], 2);
        scale += std::pow(static_cast<double>(ref[i]) - init[i], 2);
        quantum += std::pow(ulp(ref[i], tol.mantissa_bits), 2);
      }
      diff = std::sqrt(diff);
      scale = std::sqrt(scale) + std::sqrt(quantum);
    } else {
      for (size_t i = 0; i < ref.size(); ++i) {
        diff = std::max(diff, static_cast<double>(std::abs(it->second[i] - ref[i])));
        scale = std::max(scale, static_cast<double>(std::abs(ref[i])));
      }
    }
    const double rel = scale > 0 ? diff / scale : diff;
    if (rel > worst_param) {
      worst_param = rel;
      worst_name = name;
    }
    if (!(rel <= tol.param)) {
      std::cout << "FAIL: " << name << " differs by relative " << rel << "\n";
      ++failures;
    }
  }
  if (got.tensors.size() != want.tensors.size()) {
    std::cout << "FAIL: " << got.tensors.size() << " tensors, the reference has " << want.tensors.size() << "\n";
    ++failures;
  }
  std::cout << "worst relative difference: lm loss " << worst_loss << ", parameters " << worst_param << " ("
            << worst_name << ") over " << got.losses.size() << " iterations and " << want.tensors.size()
            << " tensors\n";
  return failures;
}

}  // namespace

int main(int argc, char** argv) {
  std::vector<std::string> args(argv + 1, argv + argc);
  if (args.size() < 3 || (args[0] != "--out" && args[0] != "--compare") || args[2] != "--") {
    std::cerr << "usage: dist_equivalence_test (--out|--compare) FILE -- <moecore train flags>\n";
    return 2;
  }
  const bool reference = args[0] == "--out";
  const std::string path = args[1];
  const std::vector<std::string> train_args(args.begin() + 3, args.end());
  std::optional<moecore::parallel::MpiRuntime> mpi;
  int world_size = 1;
  if (moecore::parallel::launched_by_mpi()) {
    mpi.emplace(&argc, &argv);
    world_size = moecore::parallel::ProcessGroup::world().size();
  }
  try {
    const moecore::TrainingArgs parsed = moecore::parse_train_args(train_args, world_size);
    const moecore::parallel::ParallelState parallel = moecore::make_parallel_state(parsed);
    Snapshot got;
    std::ostringstream log;
    const moecore::TrainResult result =
        moecore::run_training(parsed, log, parallel, [&](const moecore::GPTModel& full) { got = snapshot(full, {}); });
    if (parallel.rank != 0) return 0;
    got.losses = result.train_losses;
    if (reference) {
      write(got, path);
      std::cout << "wrote " << path << ": " << got.losses.size() << " losses, " << got.tensors.size() << " tensors\n";
      return 0;
    }
    Tolerances tol;
    Snapshot initial;
    if (parsed.model.params_dtype != moecore::DType::kF32) {
      // The initial one-process model (every layout starts from it): the same seed, the padded vocabulary.
      const moecore::TrainingArgs run_args = moecore::with_padded_vocabulary(parsed, moecore::build_vocabulary(parsed));
      const moecore::GPTModel start(run_args.model, static_cast<uint64_t>(run_args.seed));
      initial = snapshot(start, {});
      tol = Tolerances{1e-3, 0.25, &initial, parsed.model.params_dtype == moecore::DType::kBF16 ? 7 : 10};
    }
    const int failures = compare(got, read(path), tol);
    std::cout << (failures == 0 ? "PASS" : "FAILED") << " on " << world_size << " ranks\n";
    return failures == 0 ? 0 : 1;
  } catch (const std::exception& e) {
    std::cerr << "error: " << e.what() << '\n';
    if (world_size > 1) moecore::parallel::abort_world(1);
    return 1;
  }
}
