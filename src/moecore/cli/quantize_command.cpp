// `moecore quantize`: quantizes every 2-D fp32 tensor of a safetensors file with one of TransformerEngine's
// recipes (the training path's code, quant/quantize.h) and writes codes, scales and decoded values.
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <exception>
#include <filesystem>
#include <iomanip>
#include <iostream>
#include <limits>
#include <optional>
#include <sstream>
#include <stdexcept>
#include <string>
#include <vector>

#include "moecore/ckpt/safetensors.h"
#include "moecore/cli/commands.h"
#include "moecore/quant/quantize.h"
#include "moecore/util/flag_parser.h"

namespace {

using namespace moecore;

// The stochastic-rounding seed of --as gradient under nvfp4 when --seed is not given.
constexpr uint64_t kDefaultSeed = 1234;

const char* kUsage =
    "usage: moecore quantize --recipe {tensorwise,blockwise,mxfp8,nvfp4} --format {e4m3,e5m2}\n"
    "                        --as {activation,weight,gradient} --input IN.safetensors --output OUT.safetensors\n"
    "                        [--usage {rowwise,columnwise}] [--seed N]\n\n"
    "Quantizes every 2-D fp32 tensor NAME of IN as TransformerEngine's recipe does for that role and writes\n"
    "  NAME.codes    uint8, one code per element of the stored data (E2M1 codes unpacked, 0..15)\n"
    "  NAME.scales   fp32 decode scale of each block, shaped by the block grid\n"
    "  NAME.decoded  fp32, NAME's shape\n"
    "  NAME.global_amax  fp32 [1], nvfp4 only (the per-tensor level of its two-level scale)\n"
    "and prints error statistics per tensor. Blocks: blockwise 1x128 (128x128 for --as weight), mxfp8 1x32,\n"
    "nvfp4 1x16 (16x16 for weights). --format is ignored for nvfp4 (E2M1 with E4M3 block scales); --as gradient\n"
    "rounds nvfp4 codes stochastically with --seed (default 1234). --usage columnwise quantizes along the first\n"
    "dimension (stored transposed, [cols, rows]), with nvfp4's random Hadamard transform for activations and\n"
    "gradients; NAME.decoded is then transposed back with the transform undone. mxfp8 needs both dimensions\n"
    "divisible by 32, nvfp4 by 16.\n\n";

struct QuantizeArgs {
  quant::Recipe recipe = quant::Recipe::kTensorwise;
  quant::ElementFormat format = quant::ElementFormat::kE4M3;
  quant::Role role = quant::Role::kActivation;
  quant::Usage usage = quant::Usage::kRowwise;
  uint64_t seed = kDefaultSeed;
  std::string input;
  std::string output;
  bool help = false;
};

// clang-format off
const std::vector<FlagSpec<QuantizeArgs>>& quantize_flag_table() {
  static const std::vector<FlagSpec<QuantizeArgs>> table = {
    {"--recipe", Arity::kOne, "{tensorwise,blockwise,mxfp8,nvfp4}", "TransformerEngine's scaling recipe (required)",
     [](QuantizeArgs& a, const FlagValue& v) {
       a.recipe = quant::parse_recipe(v.text());
       if (a.recipe == quant::Recipe::kDelayed) {
         throw FlagError("--recipe delayed needs an amax history over steps; choices: tensorwise, blockwise, "
                         "mxfp8, nvfp4");
       }
     }},
    {"--format", Arity::kOne, "{e4m3,e5m2}", "FP8 element format (required; ignored for nvfp4)",
     [](QuantizeArgs& a, const FlagValue& v) {
       a.format = v.choice({"e4m3", "e5m2"}) == "e4m3" ? quant::ElementFormat::kE4M3 : quant::ElementFormat::kE5M2;
     }},
    {"--as", Arity::kOne, "{activation,weight,gradient}", "the tensors' role (required)",
     [](QuantizeArgs& a, const FlagValue& v) { a.role = quant::parse_role(v.text()); }},
    {"--input", Arity::kOne, "IN.safetensors", "fp32 tensors to quantize (required)",
     [](QuantizeArgs& a, const FlagValue& v) { a.input = v.text(); }},
    {"--output", Arity::kOne, "OUT.safetensors", "codes, scales and decoded values (required)",
     [](QuantizeArgs& a, const FlagValue& v) { a.output = v.text(); }},
    {"--usage", Arity::kOne, "{rowwise,columnwise}", "quantize along rows (default) or the first dimension",
     [](QuantizeArgs& a, const FlagValue& v) { a.usage = quant::parse_usage(v.text()); }},
    {"--seed", Arity::kOne, "N", "nvfp4 --as gradient: stochastic-rounding seed (default 1234)",
     [](QuantizeArgs& a, const FlagValue& v) { a.seed = v.unsigned_integer(); }},
  };
  return table;
}
// clang-format on

QuantizeArgs parse_args(const std::vector<std::string>& args) {
  QuantizeArgs parsed;
  ParsedFlags flags;
  try {
    flags = parse_flags(quantize_flag_table(), args, parsed);
  } catch (const FlagError& error) {
    throw std::invalid_argument(error.what());
  }
  if (flags.help_requested) {
    parsed.help = true;
    return parsed;
  }
  for (const char* required : {"--recipe", "--format", "--as", "--input", "--output"}) {
    if (!flags.given.contains(required)) throw std::invalid_argument(std::string("missing ") + required);
  }
  return parsed;
}

std::string shape_text(const std::vector<int64_t>& shape) {
  std::string text = "[";
  for (size_t i = 0; i < shape.size(); ++i) text += (i ? ", " : "") + std::to_string(shape[i]);
  return text + "]";
}

// Error statistics of decoded against x over the finite inputs, and how many inputs were not finite.
struct ErrorStats {
  double max_abs_error = 0;
  double relative_rms_error = 0;
  double saturated_share = 0;  // coded at the format's largest magnitude below |x|: clipped by saturation
  double zeroed_share = 0;     // non-zero inputs decoded to zero (underflow)
  int64_t nonfinite = 0;       // NaN / Inf inputs
  int64_t nonfinite_kept = 0;  // of those, decoded to a finite value (a satfinite cast of Inf)
};

ErrorStats error_stats(const float* x, const float* decoded, const std::vector<float>& stored_max, const int64_t n) {
  ErrorStats stats;
  double err2 = 0, ref2 = 0;
  int64_t finite = 0, saturated = 0, zeroed = 0;
  for (int64_t i = 0; i < n; ++i) {
    if (!std::isfinite(x[i])) {
      ++stats.nonfinite;
      if (std::isfinite(decoded[i])) ++stats.nonfinite_kept;
      continue;
    }
    ++finite;
    const double err = std::fabs(double(decoded[i]) - x[i]);
    stats.max_abs_error = std::max(stats.max_abs_error, err);
    err2 += err * err;
    ref2 += double(x[i]) * x[i];
    if (x[i] != 0.0f && decoded[i] == 0.0f) ++zeroed;
    if (stored_max[i] != 0.0f && std::fabs(x[i]) > std::fabs(decoded[i])) ++saturated;
  }
  stats.relative_rms_error = ref2 > 0 ? std::sqrt(err2 / ref2) : (err2 > 0 ? INFINITY : 0.0);
  stats.saturated_share = finite ? double(saturated) / finite : 0.0;
  stats.zeroed_share = finite ? double(zeroed) / finite : 0.0;
  return stats;
}

// 1 where the code has the format's largest finite magnitude, in the source's layout.
std::vector<float> at_max_mask(const quant::QuantizedTensor& q, const int64_t rows, const int64_t cols) {
  const float max = quant::format_max(q.format);
  std::vector<float> mask(static_cast<size_t>(rows * cols), 0.0f);
  for (int64_t r = 0; r < q.rows; ++r) {
    for (int64_t c = 0; c < q.cols; ++c) {
      const bool at_max = std::fabs(quant::decode(q.format, q.codes[r * q.cols + c])) == max;
      const int64_t source = q.usage == quant::Usage::kRowwise ? r * cols + c : c * cols + r;
      // Under the Hadamard transform an element of the stored data is not one source element: not counted.
      if (at_max && !q.rht) mask[source] = 1.0f;
    }
  }
  return mask;
}

// Writing the output over the input (the same path, or another path or link to the same file) would destroy it.
void check_output_is_not_input(const std::string& input, const std::string& output) {
  std::error_code ec;
  if (std::filesystem::exists(output, ec) && std::filesystem::equivalent(input, output, ec) && !ec) {
    throw std::invalid_argument("--output " + output + " is the --input file " + input +
                                ": writing it would destroy the input; choose another --output");
  }
}

int quantize_main(const QuantizeArgs& args) {
  check_output_is_not_input(args.input, args.output);
  const SafetensorsFile file = read_safetensors(args.input);
  if (file.tensors.empty()) throw std::invalid_argument(args.input + ": no tensors");
  const quant::QuantSpec spec = quant::make_spec(args.recipe, args.format, args.role);
  for (const auto& [name, tensor] : file.tensors) {  // check everything before writing anything
    if (tensor.dtype() != DType::kF32) {
      throw std::invalid_argument(args.input + ": tensor '" + name + "' is " + safetensors_dtype_code(tensor.dtype()) +
                                  "; moecore quantize takes F32 tensors");
    }
    if (tensor.ndim() != 2) {
      throw std::invalid_argument(args.input + ": tensor '" + name + "' has shape " + shape_text(tensor.shape()) +
                                  "; moecore quantize takes 2-D tensors");
    }
    try {
      quant::check_quantizable(tensor.dim(0), tensor.dim(1), spec);
    } catch (const std::invalid_argument& e) {
      throw std::invalid_argument(args.input + ": tensor '" + name + "': " + e.what());
    }
  }
  quant::QuantizeOptions options;
  options.seed = args.seed;
  std::vector<NamedTensor> outputs;
  for (const auto& [name, tensor] : file.tensors) {
    const int64_t rows = tensor.dim(0), cols = tensor.dim(1);
    const float* x = tensor.data<float>();
    const quant::QuantizedTensor q = quant::quantize(x, rows, cols, spec, args.usage, options);
    Tensor codes({q.rows, q.cols}, DType::kU8);
    std::copy(q.codes.begin(), q.codes.end(), codes.data<uint8_t>());
    Tensor scales({q.scale_rows, q.scale_cols}, DType::kF32);
    std::copy(q.scales.begin(), q.scales.end(), scales.data<float>());
    const Tensor decoded = quant::decode_to_source(q, options.rht_signs);
    outputs.emplace_back(name + ".codes", codes);
    outputs.emplace_back(name + ".scales", scales);
    outputs.emplace_back(name + ".decoded", decoded);
    if (args.recipe == quant::Recipe::kNvfp4) {
      Tensor global_amax({1}, DType::kF32);
      global_amax.data<float>()[0] = q.amax;
      outputs.emplace_back(name + ".global_amax", global_amax);
    }
    const ErrorStats stats = error_stats(x, decoded.data<float>(), at_max_mask(q, rows, cols), rows * cols);
    std::ostringstream line;
    line << name << ' ' << shape_text({rows, cols}) << ": " << quant::recipe_name(args.recipe) << ' '
         << quant::format_name(q.format) << ' ' << quant::role_name(args.role) << ' ' << quant::usage_name(args.usage)
         << (q.rht ? " (Hadamard)" : "") << ", blocks " << q.block_rows << 'x' << q.block_cols << ": max abs error "
         << std::setprecision(6) << stats.max_abs_error << ", relative RMS error " << stats.relative_rms_error
         << std::fixed << std::setprecision(2) << ", saturated " << 100 * stats.saturated_share << "%, zeroed "
         << 100 * stats.zeroed_share << "%, non-finite inputs " << stats.nonfinite;
    if (stats.nonfinite_kept > 0) line << " (" << stats.nonfinite_kept << " decoded finite)";
    std::cout << line.str() << '\n';
  }
  const SafetensorsMetadata metadata = {{"recipe", quant::recipe_name(args.recipe)},
                                        {"format", quant::format_name(spec.element)},
                                        {"role", quant::role_name(args.role)},
                                        {"usage", quant::usage_name(args.usage)},
                                        {"seed", std::to_string(args.seed)}};
  write_safetensors(args.output, outputs, metadata);
  return 0;
}

}  // namespace

int run_quantize(int argc, char** argv) {
  try {
    const QuantizeArgs args = parse_args(std::vector<std::string>(argv + 1, argv + argc));
    if (args.help) {
      std::cout << kUsage << flags_help(quantize_flag_table());
      return 0;
    }
    return quantize_main(args);
  } catch (const std::exception& e) {
    std::cout.flush();
    std::cerr << "error: " << e.what() << '\n';
    return 1;
  }
}
