// `moecore preprocess`: Megatron's tools/preprocess_data.py. Reads JSONL (one JSON object = one document per
// line), tokenizes the text under each --json-keys key on --workers threads, and writes Megatron indexed
// datasets {output_prefix}_{key}_document.bin/.idx, documents in input order. The command line is
// cli/preprocess_command.h.
//
// Each key's value, per line:
//  - a string: one sequence, tokenized; a list of strings: one sequence per non-empty element.
//  - a list of integers (already tokenized, e.g. RL rollouts {"tokens": [5, 17, 3], "loss_mask": [0, 1, 1]};
//    not in Megatron): one sequence written as is, without the tokenizer and without --append-eod's EOD. Each id
//    must be an integer in [0, 2^31) and below the tokenizer's vocab_size(), since training reads the dataset
//    with that tokenizer; the .bin dtype still follows that vocabulary (Megatron's best_fitting_dtype).
//  - an empty list (of either kind), or text that tokenizes to nothing: a document with no sequences.
// Keys of one line may mix these; each key gets its own dataset.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "moecore/tokenizer/tokenizer.h"

namespace moecore {

struct PreprocessOptions {
  std::string input;                           // --input (required)
  std::vector<std::string> json_keys{"text"};  // --json-keys
  bool split_sentences = false;                // --split-sentences (needs NLTK in Megatron: rejected)
  bool keep_newlines = false;                  // --keep-newlines (only affects sentence splitting)
  TokenizerOptions tokenizer;                  // --tokenizer-type, --vocab-file, --merge-file, --vocab-size
  bool append_eod = false;                     // --append-eod
  std::string lang = "english";                // --lang (only affects sentence splitting)
  std::string output_prefix;                   // --output-prefix (required)
  int64_t workers = 0;                         // --workers (required, >= 1)
  int64_t partitions = 1;                      // --partitions (1 only)
  int64_t log_interval = 1000;                 // --log-interval
  bool quiet = false;                          // no progress output (tests); not a command-line flag
};

struct PreprocessStats {
  int64_t documents = 0;
  int64_t input_bytes = 0;              // bytes of the JSONL lines read
  std::vector<int64_t> tokens_per_key;  // in --json-keys order
  double seconds = 0.0;                 // tokenizing and writing, after start-up
};

// Runs the conversion. Throws (one line) on unreadable input, malformed JSON (with its line number), a
// missing key, text the tokenizer rejects, an invalid id in an integer list (with its line number and key), or
// an unwritable output.
PreprocessStats preprocess(const PreprocessOptions& options);

}  // namespace moecore
