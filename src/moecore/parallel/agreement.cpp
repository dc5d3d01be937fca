#include "moecore/parallel/agreement.h"

#include <cstdint>
#include <cstring>
#include <exception>

namespace moecore::parallel {
namespace {

// Text as int32 words (bytes packed four to a word, zero-padded).
std::vector<int32_t> to_words(const std::string& text, const size_t words) {
  std::vector<int32_t> out(words, 0);
  std::memcpy(out.data(), text.data(), text.size());
  return out;
}

}  // namespace

std::vector<std::string> all_gather_text(const ProcessGroup& group, const std::string& text) {
  const auto n = static_cast<size_t>(group.size());
  std::vector<int64_t> lengths(n, 0);
  const int64_t mine = static_cast<int64_t>(text.size());
  group.all_gather(std::span<const int64_t>(&mine, 1), std::span<int64_t>(lengths));
  int64_t longest = 0;
  for (const int64_t l : lengths) longest = std::max(longest, l);
  const auto words = static_cast<size_t>((longest + 3) / 4);
  const std::vector<int32_t> send = to_words(text, words);
  std::vector<int32_t> all(words * n, 0);
  if (words > 0) group.all_gather(std::span<const int32_t>(send), std::span<int32_t>(all));
  std::vector<std::string> out(n);
  for (size_t r = 0; r < n; ++r) {
    out[r].assign(reinterpret_cast<const char*>(all.data() + r * words), static_cast<size_t>(lengths[r]));
  }
  return out;
}

std::string broadcast_text(const ProcessGroup& group, const std::string& text, const int root) {
  int64_t length = static_cast<int64_t>(text.size());
  group.broadcast(std::span<int64_t>(&length, 1), root);
  const auto words = static_cast<size_t>((length + 3) / 4);
  std::vector<int32_t> buffer = group.rank() == root ? to_words(text, words) : std::vector<int32_t>(words, 0);
  if (words > 0) group.broadcast(std::span<int32_t>(buffer), root);
  return std::string(reinterpret_cast<const char*>(buffer.data()), static_cast<size_t>(length));
}

void run_on_all_ranks(const ProcessGroup& group, const std::function<void()>& step) {
  std::string message;
  bool failed = false;
  try {
    step();
  } catch (const std::exception& e) {
    failed = true;
    message = e.what();
  }
  // The lowest failing rank, or size() when none failed.
  int64_t first_failing = failed ? group.rank() : group.size();
  std::vector<int64_t> negated{-first_failing};
  group.all_reduce(std::span<int64_t>(negated), ReduceOp::kMax);
  first_failing = -negated[0];
  if (first_failing == group.size()) return;
  throw GroupFailure(broadcast_text(group, message, static_cast<int>(first_failing)));
}

}  // namespace moecore::parallel
