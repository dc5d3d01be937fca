// Autoregressive text continuation with a GPTModel: greedy by default, or temperature / top-k sampling.
#pragma once

#include <cstdint>
#include <functional>
#include <span>
#include <vector>

#include "moecore/model/gpt_model.h"

namespace moecore {

struct SamplingOptions {
  int64_t max_new_tokens = 64;
  double temperature = 0.0;  // 0 = greedy (argmax)
  int64_t top_k = 0;         // 0 = all tokens
  uint64_t seed = 1234;
  int64_t vocab_limit = 0;  // ids >= this (vocabulary padding) are never produced; 0 = no limit
  int32_t stop_token = -1;  // stop after producing it; -1 = never
  // Keep a key / value cache (model/kv_cache.h) so each new token runs as one position; false: re-run the whole
  // context for every token (the reference the cache is tested against). Either gives the same tokens. Models the
  // cache cannot serve exactly (kv_cache_unsupported_reason) always re-run the context.
  bool kv_cache = true;
  // Router replay's RECORD (moecore generate --record-routing): the decoder's MoE routers report the top-k selection
  // of every position fed to the model (not owned; null: none). The window must not slide: std::invalid_argument when
  // the prompt and the new tokens outgrow --seq-length.
  RoutingRecorder* routing_recorder = nullptr;
};

// std::invalid_argument when the prompt is empty, longer than the model's context (--seq-length; Megatron's
// inference engine refuses such a prompt too) or holds an id outside the model's embedding rows.
void check_prompt(const GPTModel& model, std::span<const int32_t> prompt);

// Appends up to max_new_tokens ids to `prompt` (checked by check_prompt). Once the prompt and the new tokens outgrow
// the model's --seq-length, the context is its most recent tokens, at positions 0.. of the window. on_token, if set,
// is called with each new id as it is produced. With the cache the prompt is one prefill, then each token one
// position; once the window slides every position changes, so each further token re-prefills the window (exact, and
// as costly as the re-run).
std::vector<int32_t> generate(GPTModel& model, std::vector<int32_t> prompt, const SamplingOptions& options,
                              const std::function<void(int32_t)>& on_token = {});

// Picks the next id from logits_V under `options`, using `uniform` in [0, 1) for sampling.
int32_t sample_next(const float* logits_V, int64_t V, const SamplingOptions& options, double uniform);

}  // namespace moecore
