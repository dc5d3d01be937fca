// Validation (Megatron's evaluate / evaluate_and_print_results) and the unigram baseline printed before training.
#pragma once

#include <cstdint>
#include <iosfwd>
#include <string>
#include <string_view>

#include "moecore/config/arguments.h"
#include "moecore/data/data_loader.h"
#include "moecore/model/gpt_model.h"
#include "moecore/parallel/parallel_state.h"

namespace moecore {

// Megatron's evaluate(): eval_iters global batches of the validation split from sample `first_sample` (wrapping to
// sample 0 when the split runs out), dealt to DP ranks as training batches are; the lm loss is token-weighted over
// all of them ([loss sum, tokens] reduced over dp-cp). Returns the loss; `samples_read` gets eval_iters x gbs.
// Throws TrainingError on every rank, naming the norm and `prefix`, when a norm overflowed on any rank (its output
// was zeros: the loss is meaningless).
double evaluate(const TrainingArgs& args, GPTModel& model, const GPTDataProvider& data,
                const parallel::ParallelState& parallel, int64_t first_sample, int64_t& samples_read,
                std::string_view prefix);

// Megatron's evaluate_and_print_results: evaluates from `consumed_valid_samples` (advancing it) and prints
// " validation loss at <prefix> | lm loss value: ... | lm loss PPL: ... | " between two rules. Returns the loss.
double evaluate_and_print(const TrainingArgs& args, GPTModel& model, const GPTDataProvider& data,
                          const parallel::ParallelState& parallel, std::string_view prefix,
                          int64_t& consumed_valid_samples, std::ostream& log);

// Megatron's prefixes: "iteration N" during training, "iteration N on validation set" after it (pretrain()).
std::string validation_prefix_during_training(int64_t iteration);
std::string validation_prefix_after_training(int64_t iteration);

// Cross-entropy of the validation tokens under the unigram (token frequency) distribution of the training
// samples, add-one smoothed over the real vocabulary: the loss a model without context would reach.
double unigram_baseline(const GPTDataProvider& data, int64_t vocab, int64_t train_samples, int64_t valid_samples);

}  // namespace moecore
