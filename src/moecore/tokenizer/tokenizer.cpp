#include "moecore/tokenizer/tokenizer.h"

#include <algorithm>
#include <array>
#include <climits>

#include "moecore/tokenizer/gpt2_bpe.h"
#include "moecore/tokenizer/null_tokenizer.h"

namespace moecore {
namespace {

// The other --tokenizer-type choices of Megatron (megatron/training/arguments.py).
constexpr std::array<std::string_view, 10> kMegatronOnlyTypes = {
    "BertWordPieceLowerCase",  "BertWordPieceCase", "SentencePieceTokenizer", "GPTSentencePieceTokenizer",
    "HuggingFaceTokenizer",    "Llama2Tokenizer",   "TikTokenizer",           "MultimodalTokenizer",
    "NullMultimodalTokenizer", "SFTTokenizer"};

}  // namespace

std::unique_ptr<Tokenizer> build_tokenizer(const TokenizerOptions& options) {
  if (options.type == "GPT2BPETokenizer") {
    if (options.vocab_file.empty()) throw TokenizerError("GPT2BPETokenizer needs --vocab-file");
    if (options.merge_file.empty()) throw TokenizerError("GPT2BPETokenizer needs --merge-file");
    return std::make_unique<Gpt2BpeTokenizer>(options.vocab_file, options.merge_file);
  }
  if (options.type == "NullTokenizer") {
    if (options.vocab_size < 0) throw TokenizerError("NullTokenizer needs --vocab-size");
    return std::make_unique<NullTokenizer>(options.vocab_size);
  }
  if (options.type.empty()) throw TokenizerError("no tokenizer type given (--tokenizer-type)");
  if (std::find(kMegatronOnlyTypes.begin(), kMegatronOnlyTypes.end(), options.type) != kMegatronOnlyTypes.end()) {
    throw TokenizerError("tokenizer type " + options.type + " is a Megatron tokenizer not implemented in moecore yet");
  }
  throw TokenizerError("unknown tokenizer type " + options.type);
}

int64_t padded_vocab_size(int64_t vocab_size, int64_t make_vocab_size_divisible_by, int64_t tensor_parallel_size) {
  if (vocab_size < 0) throw TokenizerError("vocab size must be >= 0, got " + std::to_string(vocab_size));
  if (make_vocab_size_divisible_by < 1) {
    throw TokenizerError("--make-vocab-size-divisible-by must be >= 1, got " +
                         std::to_string(make_vocab_size_divisible_by));
  }
  if (tensor_parallel_size < 1) {
    throw TokenizerError("--tensor-model-parallel-size must be >= 1, got " + std::to_string(tensor_parallel_size));
  }
  // Token ids are int32 (the indexed dataset, the embedding's lookups): the padded vocabulary must stay below 2^31.
  int64_t multiple = 0;
  int64_t padded = 0;
  if (__builtin_mul_overflow(make_vocab_size_divisible_by, tensor_parallel_size, &multiple) ||
      __builtin_add_overflow(vocab_size, multiple - 1, &padded) ||
      (padded = padded / multiple * multiple) > INT32_MAX) {
    throw TokenizerError("the vocabulary of " + std::to_string(vocab_size) +
                         " tokens padded to a multiple of --make-vocab-size-divisible-by (" +
                         std::to_string(make_vocab_size_divisible_by) + ") x --tensor-model-parallel-size (" +
                         std::to_string(tensor_parallel_size) + ") exceeds 2^31 - 1 token ids");
  }
  return padded;
}

}  // namespace moecore
