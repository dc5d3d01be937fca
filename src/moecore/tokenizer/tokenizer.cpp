#include "moecore/tokenizer/tokenizer.h"

#include <algorithm>
#include <array>

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
  const int64_t multiple = make_vocab_size_divisible_by * tensor_parallel_size;
  return (vocab_size + multiple - 1) / multiple * multiple;
}

}  // namespace moecore
