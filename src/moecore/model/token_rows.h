// Where a rank's token rows sit in the one-process micro-batch, whose S * B rows are ordered t = s * B + b (sequence-
// major, as Megatron): a list of runs of consecutive rows. Counter-RNG draws (dropout, router jitter, forced-balance
// logits) and learned positions are keyed by the one-process row, so every layout draws the one-process values. One
// run without context parallelism (a sequence-parallel shard is a contiguous slice); two per sequence-parallel-free
// rank under context parallelism (Megatron's load-balanced split: chunks r and 2 CP - 1 - r of 2 CP).
#pragma once

#include <algorithm>
#include <cstdint>
#include <stdexcept>
#include <string>
#include <vector>

namespace moecore {

class TokenRows {
 public:
  struct Run {
    int64_t local = 0;   // first local row
    int64_t global = 0;  // its one-process row
    int64_t count = 0;
  };

  TokenRows() = default;
  // Rows [global_begin, global_begin + count) in one run.
  static TokenRows contiguous(const int64_t global_begin, const int64_t count) {
    TokenRows rows;
    if (count > 0) rows.runs_.push_back({0, global_begin, count});
    return rows;
  }
  // Context-parallel rank `rank` of `size` on sequences of S positions and B samples: sequence chunks rank and
  // 2 size - 1 - rank of 2 size equal chunks, in that order (Megatron's get_batch_on_this_cp_rank).
  static TokenRows context_parallel(const int64_t S, const int64_t B, const int rank, const int size) {
    if (size == 1) return contiguous(0, S * B);
    if (S % (2 * size) != 0) {
      throw std::invalid_argument("sequence length " + std::to_string(S) + " is not divisible by 2 x " +
                                  std::to_string(size) + " context-parallel ranks");
    }
    const int64_t chunk = S / (2 * size) * B;
    TokenRows rows;
    rows.runs_.push_back({0, rank * chunk, chunk});
    rows.runs_.push_back({chunk, (2 * size - 1 - rank) * chunk, chunk});
    return rows;
  }

  const std::vector<Run>& runs() const { return runs_; }
  int64_t count() const { return runs_.empty() ? 0 : runs_.back().local + runs_.back().count; }
  bool contiguous() const { return runs_.size() <= 1; }

  // Local rows [begin, begin + count) (a sequence-parallel shard), renumbered from 0.
  TokenRows slice(const int64_t begin, const int64_t count) const {
    TokenRows out;
    for (const Run& run : runs_) {
      const int64_t lo = std::max(begin, run.local), hi = std::min(begin + count, run.local + run.count);
      if (lo < hi) out.runs_.push_back({lo - begin, run.global + (lo - run.local), hi - lo});
    }
    if (out.count() != count) throw std::out_of_range("token rows: slice outside the rows");
    return out;
  }

  // The one-process row of local row t.
  int64_t global(const int64_t t) const {
    for (const Run& run : runs_) {
      if (t >= run.local && t < run.local + run.count) return run.global + (t - run.local);
    }
    throw std::out_of_range("token rows: local row " + std::to_string(t) + " outside the rows");
  }

 private:
  std::vector<Run> runs_;
};

}  // namespace moecore
