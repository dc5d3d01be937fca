#include "moecore/train/nonfinite_diagnosis.h"

#include <algorithm>
#include <cmath>
#include <sstream>

#include "moecore/parallel/agreement.h"
#include "moecore/tensor/finite_check.h"

namespace moecore {
namespace {

std::string number(const double value) {
  if (std::isnan(value)) return "nan";  // never "-nan"
  std::ostringstream out;
  out.precision(4);
  out << value;
  return out.str();
}

std::string module_name(const int64_t module, const int64_t num_layers) {
  if (module < 0) return "the embedding";
  if (module >= num_layers) return "the output layer";
  return "decoder layer " + std::to_string(module);
}

std::optional<NonFiniteTensor> describe_tensor(const Param& p, const Tensor& values) {
  if (!values.defined()) return std::nullopt;  // a Megatron-FSDP shard held elsewhere (optim/fsdp.h)
  const std::optional<NonFiniteElement> bad = first_nonfinite(values);
  if (!bad) return std::nullopt;
  return NonFiniteTensor{
      p.module, p.name + " (" + nonfinite_name(bad->value) + " at element " + std::to_string(bad->index) + ")"};
}

// "module\tdescription" or "" (descriptions hold no tab: parameter names and numbers).
std::string encode(const std::optional<NonFiniteTensor>& t) {
  return t ? std::to_string(t->module) + "\t" + t->description : std::string();
}

std::optional<NonFiniteTensor> decode(const std::string& text) {
  if (text.empty()) return std::nullopt;
  const size_t tab = text.find('\t');
  return NonFiniteTensor{std::stoll(text.substr(0, tab)), text.substr(tab + 1)};
}

std::string headline(const NonFiniteStepFacts& facts) {
  if (facts.norm_overflow) {
    return "iteration " + std::to_string(facts.iteration) + ": " + describe_norm_overflow(*facts.norm_overflow);
  }
  return facts.grad_norm
             ? "grad norm is not finite at iteration " + std::to_string(facts.iteration)
             : "lm loss is " + nonfinite_name(facts.lm_loss) + " at iteration " + std::to_string(facts.iteration);
}

// Which weights grew too large for the norm's input, and what to change.
std::string describe_norm_overflow_step(const NonFiniteDiagnosis& d) {
  const NonFiniteStepFacts& step = d.step;
  const std::string effect = std::isfinite(step.lm_loss)
                                 ? "the norm outputs zeros there, so the lm loss (" + number(step.lm_loss) +
                                       ") stays finite but training learns nothing"
                                 : "its output is not usable (lm loss " + number(step.lm_loss) + ")";
  const std::string line = headline(step) + ": " + effect + "; ";
  const std::string largest = d.scan.first_weight ? "first non-finite: " + d.scan.first_weight->description
                                                  : "largest |w| " + number(d.scan.largest_weight);
  if (!d.previous_losses.empty()) {
    return line + "the weights grew during training (" + largest + ", initialized with std " +
           number(d.init_method_std) + "): lower --lr (now " + number(d.lr) + ")";
  }
  if (!d.loaded_from.empty()) {
    return line + "the weights come from --load " + d.loaded_from + " (" + largest + "): check its values";
  }
  return line + "the initial weights are too large (" + largest + "): check --init-method-std (now " +
         number(d.init_method_std) + ")";
}

}  // namespace

NonFiniteStep::NonFiniteStep(const NonFiniteStepFacts& facts) : TrainingError(headline(facts)), facts_(facts) {}

NonFiniteScan scan_model_for_nonfinite(const GPTModel& model, const parallel::ProcessGroup& world) {
  NonFiniteScan local;
  for (const Param& p : model.params()) {  // the lowest module, the first of its parameters
    if (local.first_weight && local.first_weight->module <= p.module) continue;
    if (std::optional<NonFiniteTensor> weight = describe_tensor(p, p.value)) local.first_weight = std::move(weight);
  }
  for (const Param& p : model.params()) {
    if (!p.value.defined() || p.value.dtype() != DType::kF32) continue;
    for (const float w : p.value.span<const float>()) {
      if (std::isfinite(w)) local.largest_weight = std::max(local.largest_weight, static_cast<double>(std::fabs(w)));
    }
  }
  for (const Param& p : model.params()) {  // the backward pass reaches the highest module first
    if (local.last_grad && local.last_grad->module >= p.module) continue;
    if (std::optional<NonFiniteTensor> grad = describe_tensor(p, p.grad)) local.last_grad = std::move(grad);
  }
  if (world.size() == 1) return local;
  const std::vector<std::string> all = parallel::all_gather_text(
      world, encode(local.first_weight) + "\n" + encode(local.last_grad) + "\n" + std::to_string(local.largest_weight));
  NonFiniteScan scan;
  for (const std::string& text : all) {
    const size_t newline = text.find('\n');
    const size_t second = text.find('\n', newline + 1);
    const std::optional<NonFiniteTensor> weight = decode(text.substr(0, newline));
    const std::optional<NonFiniteTensor> grad = decode(text.substr(newline + 1, second - newline - 1));
    scan.largest_weight = std::max(scan.largest_weight, std::stod(text.substr(second + 1)));
    if (weight && (!scan.first_weight || weight->module < scan.first_weight->module)) scan.first_weight = weight;
    if (grad && (!scan.last_grad || grad->module > scan.last_grad->module)) scan.last_grad = grad;
  }
  return scan;
}

std::string describe_nonfinite(const NonFiniteDiagnosis& d) {
  if (d.step.norm_overflow) return describe_norm_overflow_step(d);
  const NonFiniteStepFacts& step = d.step;
  const int64_t n = step.iteration;
  std::string line = step.grad_norm ? "grad norm is not finite at iteration " + std::to_string(n) + " (lm loss " +
                                          number(step.lm_loss) + ", grad norm " + number(*step.grad_norm)
                                    : "lm loss is " + nonfinite_name(step.lm_loss) + " at iteration " +
                                          std::to_string(n) + " (lm loss " + number(step.lm_loss);
  line += ", learning rate " + number(step.learning_rate) + ")";
  const int64_t first = n - static_cast<int64_t>(d.previous_losses.size());  // the first iteration of this run

  if (d.scan.first_weight) {
    if (d.previous_losses.empty()) {
      return line + ": the weights were not finite before the first update of this run (first: " +
             d.scan.first_weight->description + "); " +
             (d.loaded_from.empty()
                  ? std::string("check --init-method-std")
                  : "they come from --load " + d.loaded_from + ": check its values" +
                        (d.fp16 ? " (a weight beyond fp16's 65504 becomes Inf under --fp16)" : std::string()));
    }
    line += ": the optimizer step of iteration " + std::to_string(n - 1) + " turned finite gradients (grad norm " +
            (d.previous_grad_norm ? number(*d.previous_grad_norm) : std::string("unknown")) +
            ") into non-finite weights (first: " + d.scan.first_weight->description + ")";
    if (d.adam_eps <= 0.0) {
      return line + "; with --adam-eps " + number(d.adam_eps) +
             " Adam's update m / (sqrt(v) + eps) is 0 / 0 wherever a gradient element has been 0: use a positive "
             "--adam-eps (Megatron's default 1e-8)";
    }
    return line + "; check the optimizer flags (--lr " + number(d.lr) + ", --adam-eps " + number(d.adam_eps) +
           ", --weight-decay " + number(d.weight_decay) + ")";
  }

  // The weights are finite: did the loss grow before? The finite losses of this run, the current one included.
  std::vector<std::pair<int64_t, double>> losses;
  for (size_t i = 0; i < d.previous_losses.size(); ++i) {
    if (std::isfinite(d.previous_losses[i])) losses.emplace_back(first + static_cast<int64_t>(i), d.previous_losses[i]);
  }
  if (std::isfinite(step.lm_loss)) losses.emplace_back(n, step.lm_loss);
  const std::string where = d.scan.last_grad ? "; the backward pass first produced non-finite gradients in " +
                                                   module_name(d.scan.last_grad->module, d.num_layers) + " (" +
                                                   d.scan.last_grad->description + ")"
                                             : std::string();
  if (losses.size() >= 2) {
    const auto lowest = std::min_element(losses.begin(), losses.end() - 1,
                                         [](const auto& a, const auto& b) { return a.second < b.second; });
    const auto& latest = losses.back();
    if (latest.second > 2.0 * lowest->second && latest.second > lowest->second + 1.0) {
      return line + ": the loss grew from " + number(lowest->second) + " at iteration " +
             std::to_string(lowest->first) + " to " + number(latest.second) + " at iteration " +
             std::to_string(latest.first) + ", so training diverged" + where + "; lower --lr (now " + number(d.lr) +
             ")" + (d.clip_grad <= 0.0 ? " and clip the gradients (--clip-grad 1.0)" : "");
    }
  }
  // Adam moves every weight by up to about lr per step: weights far beyond their initial scale mean the updates
  // outgrew the model even when the loss did not show it (a saturated softmax gives ln V and zero gradients).
  if (d.scan.largest_weight > std::max(10.0, 1000.0 * d.init_method_std)) {
    return line + ": the weights are finite but grew large (largest |w| " + number(d.scan.largest_weight) +
           ", initialized with std " + number(d.init_method_std) + "), so the updates overflowed the model" + where +
           "; lower --lr (now " + number(d.lr) + ")";
  }
  if (d.previous_losses.empty()) {
    return line + ": the weights are finite, so the forward or backward pass of the initial model overflowed" + where +
           "; check the model's scale flags (--init-method-std and the MoE router's scaling factors) and the data";
  }
  return line + ": the weights are finite and the loss had not grown (" + number(d.previous_losses.back()) +
         " at iteration " + std::to_string(n - 1) + "), so this batch overflowed the forward or backward pass" + where +
         "; check the data and the model's scale flags";
}

}  // namespace moecore
