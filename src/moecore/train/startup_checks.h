// What `moecore train` checks before it builds its model, so that a run that could not save, export, sample or read
// its data stops in its first seconds instead of after training (each check throws ConfigError with one line naming
// the flag). None calls a collective: the trainer runs them under parallel::run_on_all_ranks, since a folder or a
// file can fail on some ranks only.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "moecore/config/arguments.h"
#include "moecore/data/data_loader.h"
#include "moecore/train/training_setup.h"

namespace moecore {

// --save: a folder the run can create and write into. --load: not a file (a missing folder is Megatron's fresh
// start). --export-hf (`writes_export`: on the rank that exports): the model has an HF model type
// (hf_model_type's message), the folder is usable (hf_export_dir_problem), and --save does not lie in it.
// --sample-prompt: the tokenizer turns it into at least one token. --save holding checkpoints whose newest one was
// saved with other model flags (or is not moecore's) is refused unless --save-overwrite-other-model (a resume with
// --load of the same folder is checked by the load instead).
void check_outputs(const TrainingArgs& run_args, const Vocabulary& vocabulary, bool writes_export);

// The one-line warning (without "WARNING: ") when a run starting at `start_iteration` would save an iteration below
// the one --save's tracker names (the tracker would go back: e.g. the same run restarted without --load); "" when not.
std::string save_tracker_regression(const TrainingArgs& args, int64_t start_iteration);

// --split against what the run reads from --data-path: the train split needs a positive weight, and so does the
// valid split when --eval-interval asks for evaluations (moecore, like Megatron, evaluates only when the valid split
// exists and --eval-iters > 0). Mock data is always split 1,1,1.
void check_split_weights(const TrainingArgs& args);

// The built datasets hold what the run reads: train_iters x global_batch_size training samples (an unweighted blend
// holds one epoch only) and, when it evaluates, one global batch of validation samples (evaluation wraps around).
void check_built_splits(const TrainingArgs& args, const GPTDataProvider& data);

// The token ids of the first sequences of each --data-path dataset, about `max_tokens` in all (shared by a blend's
// datasets), lie in [0, vocab_size): the tokenizer's vocabulary, not the padded one. Bounded, as a full scan of a
// large .bin would take minutes: every token the run reads is checked again as GPTDataset reads it (gpt_dataset.h),
// against the padded vocabulary.
void check_token_ids(const std::vector<std::string>& data_path, int64_t vocab_size, int64_t max_tokens);

}  // namespace moecore
