#include "moecore/train/generate.h"

#include <algorithm>
#include <cmath>
#include <numeric>
#include <optional>
#include <span>
#include <stdexcept>
#include <string>

#include "moecore/model/kv_cache.h"
#include "moecore/model/norm_overflow.h"
#include "moecore/tensor/finite_check.h"
#include "moecore/tensor/rng.h"

namespace moecore {

int32_t sample_next(const float* logits_V, int64_t V, const SamplingOptions& options, const double uniform) {
  if (options.vocab_limit > 0) V = std::min(V, options.vocab_limit);
  if (options.temperature <= 0.0) {
    return static_cast<int32_t>(std::max_element(logits_V, logits_V + V) - logits_V);
  }
  std::vector<int32_t> ids(static_cast<size_t>(V));
  std::iota(ids.begin(), ids.end(), 0);
  size_t keep = ids.size();
  if (options.top_k > 0 && options.top_k < V) {
    keep = static_cast<size_t>(options.top_k);
    std::partial_sort(ids.begin(), ids.begin() + static_cast<std::ptrdiff_t>(keep), ids.end(),
                      [&](int32_t a, int32_t b) { return logits_V[a] > logits_V[b]; });
  }
  double max_logit = -INFINITY;
  for (size_t i = 0; i < keep; ++i) max_logit = std::max(max_logit, static_cast<double>(logits_V[ids[i]]));
  std::vector<double> weights(keep);
  double total = 0.0;
  for (size_t i = 0; i < keep; ++i) {
    weights[i] = std::exp((logits_V[ids[i]] - max_logit) / options.temperature);
    total += weights[i];
  }
  double target = uniform * total;
  for (size_t i = 0; i < keep; ++i) {
    target -= weights[i];
    if (target < 0.0) return ids[i];
  }
  return ids[keep - 1];
}

void check_prompt(const GPTModel& model, const std::span<const int32_t> prompt) {
  if (prompt.empty()) throw std::invalid_argument("generate: the prompt has no tokens");
  const int64_t context = model.config().seq_length;
  if (static_cast<int64_t>(prompt.size()) > context) {
    throw std::invalid_argument("the prompt is " + std::to_string(prompt.size()) +
                                " tokens, longer than the model's context of " + std::to_string(context) +
                                " tokens: shorten it");
  }
  const int64_t rows = model.config().vocab_size;
  for (size_t i = 0; i < prompt.size(); ++i) {
    if (prompt[i] < 0 || prompt[i] >= rows) {
      throw std::invalid_argument("prompt token " + std::to_string(i) + " is id " + std::to_string(prompt[i]) +
                                  ", outside the model's " + std::to_string(rows) + " embedding rows");
    }
  }
}

namespace {

// The logits of the next token after `context` (the window's tokens), one step of generation: through the cache
// (only the tokens it does not hold yet run) or by re-running the whole window. window_start is the window's first
// index in the whole text; when it moves, every position changes and the cache starts over.
class NextTokenLogits {
 public:
  // capacity: the most positions a window holds (the cache's rows are allocated at once).
  NextTokenLogits(GPTModel& model, const bool use_cache, const int64_t capacity) : model_(model) {
    if (use_cache && kv_cache_unsupported_reason(model).empty()) cache_.emplace(model.config(), capacity);
  }

  // The position in the whole text of the first token the next call with this window start feeds to the model.
  int64_t first_fed(const int64_t window_start) const {
    return cache_ && window_start == cache_start_ ? cache_start_ + cache_->length() : window_start;
  }

  Tensor operator()(const std::span<const int32_t> window, const int64_t window_start) {
    if (!cache_) return model_.last_logits(window.data(), 1, static_cast<int64_t>(window.size()));
    if (window_start != cache_start_) {
      cache_->clear();
      cache_start_ = window_start;
    }
    return model_.decode_logits(*cache_, window.subspan(static_cast<size_t>(cache_->length())));
  }

 private:
  GPTModel& model_;
  std::optional<KvCache> cache_;
  int64_t cache_start_ = 0;
};

}  // namespace

std::vector<int32_t> generate(GPTModel& model, std::vector<int32_t> prompt, const SamplingOptions& options,
                              const std::function<void(int32_t)>& on_token) {
  check_prompt(model, prompt);
  const int64_t context = model.config().seq_length;
  const CounterRng rng(options.seed, stream_key("generate"));
  // The window never outgrows the prompt and the new tokens (an imported model's context can be 160k positions).
  const int64_t longest =
      std::min(context, static_cast<int64_t>(prompt.size()) + std::max<int64_t>(options.max_new_tokens, 0));
  NextTokenLogits next_logits(model, options.kv_cache, longest);
  RoutingRecorder* const recorder = options.routing_recorder;
  if (recorder != nullptr && static_cast<int64_t>(prompt.size()) + options.max_new_tokens - 1 > context) {
    throw std::invalid_argument(
        "recording the routing needs the prompt and the new tokens but the last within the "
        "model's context of " +
        std::to_string(context) + " tokens (the window would slide)");
  }
  model.set_routing_recorder(recorder);
  struct RecorderReset {
    GPTModel& model;
    ~RecorderReset() { model.set_routing_recorder(nullptr); }
  } const recorder_reset{model};
  for (int64_t step = 0; step < options.max_new_tokens; ++step) {
    const int64_t start = std::max<int64_t>(0, static_cast<int64_t>(prompt.size()) - context);
    const std::span<const int32_t> window(prompt.data() + start, prompt.size() - static_cast<size_t>(start));
    if (recorder != nullptr) recorder->begin_forward(next_logits.first_fed(start));
    const Tensor logits_BV = next_logits(window, start);
    // A norm whose sum of squares overflowed outputs zeros: finite logits that ignore the prompt.
    if (const std::optional<NormOverflow> overflow = model.take_norm_overflow()) {
      throw std::runtime_error(describe_norm_overflow(*overflow) + " at generation step " + std::to_string(step + 1) +
                               ": the norm outputs zeros there, so the logits ignore the prompt; check the model's "
                               "weights");
    }
    // Finite weights can still overflow in the forward; argmax over NaN logits would print token 0 forever.
    if (const std::optional<NonFiniteElement> bad = first_nonfinite(logits_BV)) {
      throw std::runtime_error("the model computed a non-finite logit (" + nonfinite_name(bad->value) +
                               ") for token id " + std::to_string(bad->index) + " at generation step " +
                               std::to_string(step + 1));
    }
    const int32_t next = sample_next(logits_BV.data<float>(), model.config().vocab_size, options,
                                     rng.uniform(static_cast<uint64_t>(step)));
    prompt.push_back(next);
    if (on_token) on_token(next);
    if (next == options.stop_token) break;
  }
  return prompt;
}

}  // namespace moecore
