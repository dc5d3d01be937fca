#include "moecore/tokenizer/gpt2_bpe.h"

#include <algorithm>
#include <fstream>
#include <functional>
#include <mutex>
#include <nlohmann/json.hpp>
#include <queue>
#include <sstream>

#include "moecore/tokenizer/gpt2_pretokenizer.h"
#include "moecore/tokenizer/utf8.h"

namespace moecore {
namespace {

constexpr std::string_view kEndOfText = "<|endoftext|>";
constexpr size_t kMaxCachedPieceBytes = 64;

// GPT-2's bytes_to_unicode: printable Latin-1 bytes stand for themselves, the other 68 bytes for
// U+0100, U+0101, ... in byte order.
std::array<char32_t, 256> bytes_to_unicode() {
  std::array<char32_t, 256> table{};
  const auto printable = [](int b) { return (b >= '!' && b <= '~') || (b >= 0xA1 && b <= 0xAC) || (b >= 0xAE); };
  char32_t next_extra = 256;
  for (int b = 0; b < 256; ++b) table[b] = printable(b) ? static_cast<char32_t>(b) : next_extra++;
  return table;
}

std::string read_file(const std::string& path, const char* what) {
  std::ifstream in(path, std::ios::binary);
  if (!in) throw TokenizerError(std::string("cannot open ") + what + " " + path);
  std::ostringstream contents;
  contents << in.rdbuf();
  return contents.str();
}

uint64_t pair_key(int32_t left, int32_t right) {
  return (static_cast<uint64_t>(static_cast<uint32_t>(left)) << 32) | static_cast<uint32_t>(right);
}

struct StringHash {
  using is_transparent = void;
  size_t operator()(std::string_view s) const { return std::hash<std::string_view>{}(s); }
};

}  // namespace

// Piece -> ids, shared by all threads; sharded so that workers rarely wait on each other.
class Gpt2BpeTokenizer::WordCache {
 public:
  bool lookup(std::string_view piece, size_t hash, std::vector<int32_t>& ids) const {
    const Shard& shard = shards_[hash % kShards];
    const std::lock_guard<std::mutex> lock(shard.mutex);
    const auto it = shard.map.find(piece);
    if (it == shard.map.end()) return false;
    ids.insert(ids.end(), it->second.begin(), it->second.end());
    return true;
  }
  void insert(std::string_view piece, size_t hash, std::vector<int32_t> piece_ids) {
    Shard& shard = shards_[hash % kShards];
    const std::lock_guard<std::mutex> lock(shard.mutex);
    if (shard.map.size() >= kMaxEntriesPerShard) shard.map.clear();  // bounds memory on endless new words
    shard.map.emplace(std::string(piece), std::move(piece_ids));
  }

 private:
  static constexpr size_t kShards = 64;
  static constexpr size_t kMaxEntriesPerShard = 4096;
  struct Shard {
    mutable std::mutex mutex;
    std::unordered_map<std::string, std::vector<int32_t>, StringHash, std::equal_to<>> map;
  };
  std::array<Shard, kShards> shards_;
};

Gpt2BpeTokenizer::Gpt2BpeTokenizer(const std::string& vocab_file, const std::string& merge_file)
    : cache_(std::make_unique<WordCache>()) {
  const std::array<char32_t, 256> byte_to_char = bytes_to_unicode();
  std::unordered_map<char32_t, uint8_t> char_to_byte;
  for (int b = 0; b < 256; ++b) char_to_byte[byte_to_char[b]] = static_cast<uint8_t>(b);

  // Vocabulary.
  nlohmann::json vocab;
  try {
    vocab = nlohmann::json::parse(read_file(vocab_file, "vocab file"));
  } catch (const nlohmann::json::exception& e) {
    throw TokenizerError("vocab file " + vocab_file + " is not valid JSON: " + e.what());
  }
  if (!vocab.is_object() || vocab.empty()) {
    throw TokenizerError("vocab file " + vocab_file + " must be a non-empty JSON object token -> id");
  }
  int32_t max_id = -1;
  encoder_.reserve(vocab.size());
  for (const auto& [token, value] : vocab.items()) {
    if (!value.is_number_integer() || value.get<int64_t>() < 0 || value.get<int64_t>() > (1LL << 30)) {
      throw TokenizerError("vocab file " + vocab_file + ": token '" + token + "' has no valid integer id");
    }
    const auto id = static_cast<int32_t>(value.get<int64_t>());
    encoder_.emplace(token, id);
    max_id = std::max(max_id, id);
  }
  num_tokens_ = static_cast<int64_t>(encoder_.size());
  id_to_bytes_.assign(static_cast<size_t>(max_id) + 1, std::string());
  id_present_.assign(static_cast<size_t>(max_id) + 1, false);
  for (const auto& [token, id] : encoder_) {
    std::string bytes;
    for (size_t pos = 0; pos < token.size();) {
      const utf8::DecodedChar c = utf8::decode(token, pos);
      const auto it = char_to_byte.find(c.code_point);
      if (!c.valid || it == char_to_byte.end()) {
        throw TokenizerError("vocab file " + vocab_file + ": token '" + token +
                             "' uses a character outside GPT-2's byte alphabet");
      }
      bytes += static_cast<char>(it->second);
      pos += c.length;
    }
    id_to_bytes_[id] = std::move(bytes);
    id_present_[id] = true;
  }
  for (int b = 0; b < 256; ++b) {
    std::string spelling;
    utf8::append(spelling, byte_to_char[b]);
    const auto it = encoder_.find(spelling);
    if (it == encoder_.end()) {
      throw TokenizerError("vocab file " + vocab_file + " lacks the single-byte token for byte " + std::to_string(b));
    }
    byte_to_id_[b] = it->second;
  }
  const auto eod = encoder_.find(std::string(kEndOfText));
  if (eod == encoder_.end()) throw TokenizerError("vocab file " + vocab_file + " has no <|endoftext|> token");
  eod_id_ = eod->second;

  // Merges: rank = position among the merge lines (a repeated pair keeps its last rank, like GPT-2's dict).
  const std::string merges_text = read_file(merge_file, "merge file");
  merges_.reserve(static_cast<size_t>(std::count(merges_text.begin(), merges_text.end(), '\n')) + 1);
  std::istringstream lines(merges_text);
  std::string line;
  int64_t line_number = 0;
  int32_t rank = 0;
  while (std::getline(lines, line)) {
    ++line_number;
    if (!line.empty() && line.back() == '\r') line.pop_back();
    if (line.empty() || (line_number == 1 && line.starts_with("#version"))) continue;
    const size_t space = line.find(' ');
    if (space == std::string::npos || space == 0 || space + 1 == line.size() ||
        line.find(' ', space + 1) != std::string::npos) {
      throw TokenizerError("merge file " + merge_file + " line " + std::to_string(line_number) +
                           ": expected two tokens separated by one space, got '" + line.substr(0, 60) + "'");
    }
    const std::string left = line.substr(0, space);
    const std::string right = line.substr(space + 1);
    const int32_t left_id = token_to_id(left);
    const int32_t right_id = token_to_id(right);
    const int32_t merged_id = token_to_id(left + right);
    if (left_id < 0 || right_id < 0 || merged_id < 0) {
      const std::string& missing = left_id < 0 ? left : right_id < 0 ? right : left + right;
      throw TokenizerError("merge file " + merge_file + " line " + std::to_string(line_number) + ": token '" + missing +
                           "' is not in the vocab file " + vocab_file);
    }
    merges_[pair_key(left_id, right_id)] = Merge{rank++, merged_id};
  }
  if (merges_.empty()) throw TokenizerError("merge file " + merge_file + " has no merges");
}

Gpt2BpeTokenizer::~Gpt2BpeTokenizer() = default;

int32_t Gpt2BpeTokenizer::token_to_id(const std::string& token) const {
  const auto it = encoder_.find(token);
  return it == encoder_.end() ? -1 : it->second;
}

const Gpt2BpeTokenizer::Merge* Gpt2BpeTokenizer::find_merge(int32_t left, int32_t right) const {
  const auto it = merges_.find(pair_key(left, right));
  return it == merges_.end() ? nullptr : &it->second;
}

// GPT-2's bpe(): repeatedly take the adjacent pair with the lowest rank and merge all its occurrences,
// left to right and without overlap, until no pair has a rank. A heap keyed by (rank, position) over a
// linked list does each pass in O(log n) per merge, so even a megabyte-long piece is fast.
void Gpt2BpeTokenizer::apply_merges(std::vector<int32_t>& symbols) const {
  const auto n = static_cast<int32_t>(symbols.size());
  if (n < 2) return;
  std::vector<int32_t> next(n);
  std::vector<int32_t> prev(n);
  std::vector<char> alive(n, 1);
  for (int32_t i = 0; i < n; ++i) {
    next[i] = i + 1 < n ? i + 1 : -1;
    prev[i] = i - 1;
  }
  struct Candidate {
    int32_t rank;
    int32_t pos;
    int32_t left;
    int32_t right;
    int32_t merged;
  };
  const auto later = [](const Candidate& a, const Candidate& b) {
    return a.rank != b.rank ? a.rank > b.rank : a.pos > b.pos;
  };
  std::priority_queue<Candidate, std::vector<Candidate>, decltype(later)> heap(later);
  const auto push_pair_at = [&](int32_t pos) {
    if (pos < 0 || next[pos] < 0) return;
    if (const Merge* merge = find_merge(symbols[pos], symbols[next[pos]])) {
      heap.push({merge->rank, pos, symbols[pos], symbols[next[pos]], merge->merged_id});
    }
  };
  for (int32_t i = 0; i + 1 < n; ++i) push_pair_at(i);

  std::vector<Candidate> pass;
  while (!heap.empty()) {
    const int32_t rank = heap.top().rank;
    pass.clear();
    while (!heap.empty() && heap.top().rank == rank) {
      pass.push_back(heap.top());
      heap.pop();
    }
    for (const Candidate& c : pass) {  // ascending positions
      const int32_t right = next[c.pos];
      if (!alive[c.pos] || right < 0 || symbols[c.pos] != c.left || symbols[right] != c.right) continue;
      symbols[c.pos] = c.merged;
      alive[right] = 0;
      next[c.pos] = next[right];
      if (next[right] >= 0) prev[next[right]] = c.pos;
      push_pair_at(prev[c.pos]);
      push_pair_at(c.pos);
    }
  }
  int32_t out = 0;
  for (int32_t i = 0; i >= 0; i = next[i]) symbols[out++] = symbols[i];
  symbols.resize(out);
}

void Gpt2BpeTokenizer::encode_piece(std::string_view piece, std::vector<int32_t>& ids) const {
  if (piece.size() == 1) {
    ids.push_back(byte_to_id_[static_cast<uint8_t>(piece[0])]);
    return;
  }
  const bool cacheable = piece.size() <= kMaxCachedPieceBytes;
  const size_t hash = cacheable ? StringHash{}(piece) : 0;
  if (cacheable && cache_->lookup(piece, hash, ids)) return;
  std::vector<int32_t> symbols(piece.size());
  for (size_t i = 0; i < piece.size(); ++i) symbols[i] = byte_to_id_[static_cast<uint8_t>(piece[i])];
  apply_merges(symbols);
  ids.insert(ids.end(), symbols.begin(), symbols.end());
  if (cacheable) cache_->insert(piece, hash, std::move(symbols));
}

std::vector<int32_t> Gpt2BpeTokenizer::tokenize(std::string_view text) const {
  std::vector<std::string_view> pieces;
  pieces.reserve(text.size() / 4 + 1);
  gpt2_pretokenize(text, pieces);
  std::vector<int32_t> ids;
  ids.reserve(pieces.size() + pieces.size() / 4);
  for (const std::string_view piece : pieces) encode_piece(piece, ids);
  return ids;
}

std::string Gpt2BpeTokenizer::detokenize_bytes(const std::vector<int32_t>& ids) const {
  std::string bytes;
  for (const int32_t id : ids) {
    if (id < 0 || static_cast<size_t>(id) >= id_present_.size() || !id_present_[id]) {
      throw TokenizerError("GPT2BPETokenizer: token id " + std::to_string(id) + " is not in the vocabulary");
    }
    bytes += id_to_bytes_[id];
  }
  return bytes;
}

std::string Gpt2BpeTokenizer::detokenize(const std::vector<int32_t>& ids) const {
  return utf8::replace_invalid(detokenize_bytes(ids));
}

}  // namespace moecore
