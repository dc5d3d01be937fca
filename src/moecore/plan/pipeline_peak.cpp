#include "moecore/plan/pipeline_peak.h"

#include <algorithm>
#include <cstdint>
#include <stdexcept>

#include "moecore/model/config.h"
#include "moecore/pipeline/pipeline_schedule.h"
#include "moecore/util/checked_math.h"

namespace moecore::plan {
namespace {

// pipeline_schedule_table without building it: M micro-batches in F full groups of N and a last group of
// L = M mod N, each group run through chunk 0, then chunk 1, ...: blocks of N entries of one chunk (of L in the last
// group). One chunk: micro-batches 0 .. M-1, whatever N is.
class ScheduleTable {
 public:
  explicit ScheduleTable(const PipelineShape& s)
      : vpp_(s.vpp),
        group_(s.vpp == 1 ? s.microbatches : (s.group > 0 ? s.group : s.pp)),
        full_groups_(s.microbatches / group_),
        last_(s.microbatches % group_),
        period_(checked_mul(group_, s.vpp, "entries of one micro-batch group")),
        full_end_(checked_mul(full_groups_, period_, "entries of the full micro-batch groups")),
        size_(checked_mul(s.microbatches, s.vpp, "virtual micro-batches")) {}

  int64_t size() const { return size_; }
  int64_t period() const { return period_; }
  int64_t full_end() const { return full_end_; }

  // Chunk of entry n (0 <= n < size).
  int64_t chunk(const int64_t n) const { return n < full_end_ ? (n % period_) / group_ : (n - full_end_) / last_; }

  // Entries of chunk v among the first n.
  int64_t count(const int64_t v, const int64_t n) const {
    if (n <= full_end_) return n / period_ * group_ + std::clamp<int64_t>(n % period_ - v * group_, 0, group_);
    return full_groups_ * group_ + std::clamp<int64_t>(n - full_end_ - v * last_, 0, last_);
  }

  // Entries in [lo, hi] that start a block of one chunk, and the table's end if in range.
  void block_starts(int64_t lo, int64_t hi, std::vector<int64_t>& out) const {
    lo = std::max<int64_t>(lo, 0);
    hi = std::min(hi, size_);
    if (lo > hi) return;
    for (int64_t b = (lo + group_ - 1) / group_ * group_; b <= hi && b < full_end_; b += group_) out.push_back(b);
    for (int64_t c = 0; last_ > 0 && c < vpp_; ++c) {
      const int64_t b = full_end_ + c * last_;
      if (b >= lo && b <= hi) out.push_back(b);
    }
    if (size_ >= lo && size_ <= hi) out.push_back(size_);
  }

 private:
  int64_t vpp_, group_, full_groups_, last_, period_, full_end_, size_;
};

void check_shape(const PipelineShape& s) {
  if (s.pp > INT32_MAX || s.vpp > INT32_MAX) throw ConfigError("pipeline sizes beyond 32-bit integers");
  check_pipeline_schedule_sizes(static_cast<int>(s.pp), static_cast<int>(std::clamp<int64_t>(s.rank, -1, INT32_MAX)),
                                static_cast<int>(s.vpp), s.microbatches, s.group);
}

std::vector<int64_t> live_before(const PipelineShape& s, const ScheduleTable& table, const int64_t warmup,
                                 const int64_t k) {
  const int64_t forwards = std::min(k + warmup + 1, table.size());
  std::vector<int64_t> live(static_cast<size_t>(s.vpp));
  for (int64_t v = 0; v < s.vpp; ++v) {
    live[static_cast<size_t>(v)] = table.count(v, forwards) - table.count(s.vpp - 1 - v, k);
  }
  return live;
}

}  // namespace

int64_t warmup_microbatches(const PipelineShape& s) {
  if (s.pp == 1) return 0;
  if (s.vpp == 1) return std::min(s.pp - s.rank - 1, s.microbatches);
  const int64_t group = s.group > 0 ? s.group : s.pp;
  return std::min((s.pp - s.rank - 1) * 2 + checked_mul(s.vpp - 1, group, "interleaved warm-up micro-batches"),
                  checked_mul(s.microbatches, s.vpp, "virtual micro-batches"));
}

std::vector<int64_t> live_contexts_before_backward(const PipelineShape& shape, const int64_t k) {
  check_shape(shape);
  return live_before(shape, ScheduleTable(shape), warmup_microbatches(shape), k);
}

PipelinePeak pipeline_activation_peak(const PipelineShape& s, const std::vector<ChunkActivations>& chunks) {
  check_shape(s);
  if (chunks.size() != static_cast<size_t>(s.vpp)) throw std::invalid_argument("one ChunkActivations per chunk");
  const ScheduleTable table(s);
  const int64_t w = warmup_microbatches(s);
  const int64_t total = table.size();
  const int64_t period = table.period();

  // Backward k with P <= k and k + W + 1 <= (end of the full groups) has the live contexts and chunk of backward
  // k - P (P: one full group's entries): both counts grow by N. It cannot be the first peak, so only two windows
  // need looking at: [0, P) and [end of full groups - W, total).
  std::vector<std::pair<int64_t, int64_t>> windows;
  if (period <= table.full_end() - w - 1) {
    windows = {{0, period - 1}, {table.full_end() - w, total - 1}};
  } else {
    windows = {{0, total - 1}};
  }

  PipelinePeak peak;
  for (const auto& [lo, hi] : windows) {
    // Between two neighbouring candidates the forward's chunk, the backward's chunk and whether forwards remain are
    // fixed, so the total changes by the same amount each step: its first largest value is at one of the two.
    std::vector<int64_t> starts;
    table.block_starts(lo, hi + 1, starts);
    std::vector<int64_t> candidates{lo, hi};
    for (const int64_t b : starts) candidates.insert(candidates.end(), {b - 1, b});
    starts.clear();
    table.block_starts(lo + w + 1, hi + w + 1, starts);
    for (const int64_t b : starts) candidates.push_back(b - w - 1);
    std::sort(candidates.begin(), candidates.end());
    candidates.erase(std::unique(candidates.begin(), candidates.end()), candidates.end());
    for (const int64_t k : candidates) {
      if (k < lo || k > hi) continue;
      std::vector<int64_t> live = live_before(s, table, w, k);
      const int64_t chunk = s.vpp - 1 - table.chunk(k);
      double bytes = chunks[static_cast<size_t>(chunk)].transient;
      for (size_t v = 0; v < live.size(); ++v) bytes += static_cast<double>(live[v]) * chunks[v].kept;
      if (bytes > peak.bytes) {
        peak.found = true;
        peak.bytes = bytes;
        peak.backward = k;
        peak.chunk = chunk;
        peak.live = std::move(live);
      }
    }
  }
  if (!peak.found) peak.live.assign(static_cast<size_t>(s.vpp), 0);
  return peak;
}

}  // namespace moecore::plan
