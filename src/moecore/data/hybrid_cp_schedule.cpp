#include "moecore/data/hybrid_cp_schedule.h"

#include <algorithm>
#include <deque>
#include <limits>
#include <map>
#include <set>
#include <stdexcept>
#include <string>

#include "moecore/data/indexed_dataset.h"
#include "moecore/util/checked_math.h"

namespace moecore {
namespace {

constexpr double kBalanceSlack = 0.05;   // next_hdp_group's delta
constexpr double kBucketOverfill = 1.1;  // make_buckets_equal closes a bucket above 1.1 x target

using Bucket = std::deque<CpSample>;

struct Group {
  std::vector<int64_t> members;  // contiguous ranks, ascending
  int64_t size = 0;
};

// One round in progress; the per-rank vectors mirror next_hdp_group's micro_batches, exec_times, sample_ids_per_gpu.
struct RoundState {
  explicit RoundState(const int64_t ranks)
      : lengths(static_cast<size_t>(ranks)),
        ids(static_cast<size_t>(ranks)),
        work(static_cast<size_t>(ranks), 0.0),
        group_of(static_cast<size_t>(ranks), -1) {}
  std::vector<std::vector<int64_t>> lengths;
  std::vector<std::vector<int64_t>> ids;
  std::vector<double> work;
  std::vector<int64_t> group_of;  // -1: a free rank
  std::vector<Group> groups;      // by group id, in the order opened

  double max_work() const { return *std::max_element(work.begin(), work.end()); }
  double min_work() const { return *std::min_element(work.begin(), work.end()); }
  bool has_idle_rank() const {
    return std::any_of(lengths.begin(), lengths.end(), [](const auto& l) { return l.empty(); });
  }
};

class BalancedCpScheduler {
 public:
  BalancedCpScheduler(const int64_t ranks, const int64_t max_seqlen_per_rank)
      : ranks_(ranks), max_seqlen_per_rank_(max_seqlen_per_rank) {}

  // next_hdp_group: schedules one round from `waiting` and leaves the samples it did not place there.
  HybridCpRound next_round(std::vector<CpSample>& waiting) const {
    std::vector<Bucket> buckets = make_buckets_equal(waiting);
    RoundState state(ranks_);
    place_samples(buckets, state);
    std::vector<CpSample> leftovers;
    for (const Bucket& bucket : buckets) leftovers.insert(leftovers.end(), bucket.begin(), bucket.end());
    trim_overload(state, leftovers);
    while (state.has_idle_rank()) fill_empty_ranks(state);
    waiting = std::move(leftovers);
    return finish(state);
  }

 private:
  int64_t needed(const int64_t length) const { return hybrid_cp_ranks_needed(length, max_seqlen_per_rank_); }
  double own_work(const int64_t length) const { return hybrid_cp_work(length, needed(length)); }

  std::vector<Bucket> make_buckets_equal(const std::vector<CpSample>& samples) const {
    std::set<int64_t> sizes;
    double total_work = 0.0;
    for (const CpSample& s : samples) {
      sizes.insert(needed(s.length));
      total_work += own_work(s.length);
    }
    const auto k = static_cast<int64_t>(sizes.size());
    const double target = total_work / static_cast<double>(k);
    const auto n = static_cast<int64_t>(samples.size());
    std::vector<Bucket> buckets;
    Bucket current;
    double current_work = 0.0;
    int64_t remaining_k = k;
    for (int64_t i = 0; i < n; ++i) {
      const CpSample& sample = samples[static_cast<size_t>(i)];
      const double work = own_work(sample.length);
      const bool too_much = current_work + work > target * kBucketOverfill;
      const bool save_for_later = n - i <= remaining_k - static_cast<int64_t>(buckets.size());
      if (!current.empty() && (too_much || save_for_later)) {
        buckets.push_back(std::move(current));
        current.clear();
        current_work = 0.0;
        remaining_k -= 1;
      }
      current.push_back(sample);
      current_work += work;
    }
    if (!current.empty()) buckets.push_back(std::move(current));
    return buckets;
  }

  bool placeable(const int64_t size, const RoundState& state) const {
    const bool group_exists =
        std::any_of(state.groups.begin(), state.groups.end(), [&](const Group& g) { return g.size == size; });
    return group_exists || std::count(state.group_of.begin(), state.group_of.end(), -1) >= size;
  }

  void place_samples(std::vector<Bucket>& buckets, RoundState& state) const {
    int64_t first_needed = 0;  // Megatron's prev_needed: set by the round's first sample, never updated
    bool check_balance = false;
    while (!buckets.empty()) {
      // Step 1: the head of the first bucket that fits an existing group or the free ranks.
      auto bucket = std::find_if(buckets.begin(), buckets.end(), [&](const Bucket& b) {
        return !b.empty() && placeable(needed(b.front().length), state);
      });
      if (bucket == buckets.end()) break;
      const CpSample sample = bucket->front();
      const int64_t size = needed(sample.length);
      if (first_needed == 0) first_needed = size;

      // (a) the existing group of this size whose busiest rank has the least work; (b) a new group on free ranks.
      int64_t best_group = -1;
      double best_load = std::numeric_limits<double>::infinity();
      for (size_t g = 0; g < state.groups.size(); ++g) {
        if (state.groups[g].size != size) continue;
        double load = 0.0;
        for (size_t m = 0; m < state.groups[g].members.size(); ++m) {
          const double w = state.work[static_cast<size_t>(state.groups[g].members[m])];
          load = m == 0 ? w : std::max(load, w);
        }
        if (load < best_load) {
          best_group = static_cast<int64_t>(g);
          best_load = load;
        }
      }
      std::vector<int64_t> free_ranks;
      for (int64_t r = 0; r < ranks_; ++r) {
        if (state.group_of[static_cast<size_t>(r)] == -1) free_ranks.push_back(r);
      }
      std::vector<int64_t> members;
      if (static_cast<int64_t>(free_ranks.size()) >= size) {
        std::stable_sort(free_ranks.begin(), free_ranks.end(), [&](const int64_t a, const int64_t b) {
          return state.work[static_cast<size_t>(a)] < state.work[static_cast<size_t>(b)];
        });
        free_ranks.resize(static_cast<size_t>(size));
        if (state.work[static_cast<size_t>(free_ranks.back())] < best_load) {
          best_group = -1;
          members = free_ranks;
        }
      }
      // Step 2: open the new group.
      if (best_group == -1) {
        best_group = static_cast<int64_t>(state.groups.size());
        state.groups.push_back(Group{members, size});
        for (const int64_t r : members) state.group_of[static_cast<size_t>(r)] = best_group;
      }
      // Step 3: every rank of the group runs the sample.
      const double cost = own_work(sample.length);
      for (const int64_t r : state.groups[static_cast<size_t>(best_group)].members) {
        state.lengths[static_cast<size_t>(r)].push_back(sample.length);
        state.work[static_cast<size_t>(r)] += cost;
        state.ids[static_cast<size_t>(r)].push_back(sample.id);
      }
      bucket->pop_front();
      // Step 4: drop the emptied leading buckets; stop once smaller samples have started and the ranks balance.
      while (!buckets.empty() && buckets.front().empty()) buckets.erase(buckets.begin());
      if (size < first_needed) check_balance = true;
      if (check_balance && !buckets.empty() &&
          state.max_work() - state.min_work() <= kBalanceSlack * state.max_work()) {
        break;
      }
    }
  }

  void trim_overload(RoundState& state, std::vector<CpSample>& leftovers) const {
    while (true) {
      const double max_work = state.max_work();
      const double min_work = state.min_work();
      const double slack = max_work - min_work;
      if (slack <= kBalanceSlack * max_work || min_work == 0.0) return;  // balanced, or idle ranks to fill
      const auto busiest =
          static_cast<size_t>(std::find(state.work.begin(), state.work.end(), max_work) - state.work.begin());
      if (state.lengths[busiest].size() <= 1) return;
      const Group& group = state.groups[static_cast<size_t>(state.group_of[busiest])];
      const int64_t length = state.lengths[busiest].back();
      const double cost = own_work(length);
      std::vector<double> projected = state.work;
      for (const int64_t r : group.members) projected[static_cast<size_t>(r)] -= cost;
      const auto [low, high] = std::minmax_element(projected.begin(), projected.end());
      if (!(*high - *low < slack)) return;
      leftovers.push_back(CpSample{state.ids[busiest].back(), length});
      for (const int64_t r : group.members) {
        state.lengths[static_cast<size_t>(r)].pop_back();
        state.work[static_cast<size_t>(r)] -= cost;
        state.ids[static_cast<size_t>(r)].pop_back();
      }
    }
  }

  // fill_empty_gpus, one expansion: the first group of the smallest size doubles; the groups after it shift up.
  void fill_empty_ranks(RoundState& state) const {
    if (state.groups.empty()) throw std::logic_error("hybrid CP schedule: idle ranks but no group to expand");
    int64_t smallest = state.groups.front().size;
    for (const Group& g : state.groups) smallest = std::min(smallest, g.size);
    const auto expanded = static_cast<size_t>(
        std::find_if(state.groups.begin(), state.groups.end(), [&](const Group& g) { return g.size == smallest; }) -
        state.groups.begin());
    const int64_t grown = std::min(smallest * 2, ranks_) - smallest;
    const int64_t end = state.groups[expanded].members.back();
    const auto first_idle = static_cast<int64_t>(
        std::find_if(state.lengths.begin(), state.lengths.end(), [](const auto& l) { return l.empty(); }) -
        state.lengths.begin());
    if (first_idle + grown > ranks_) throw std::logic_error("hybrid CP schedule: too few idle ranks to expand");

    // Ranks (end, first_idle) move up by `grown`; the expanded group's ranks all take its samples.
    for (int64_t r = first_idle - 1; r > end; --r) {
      state.lengths[static_cast<size_t>(r + grown)] = state.lengths[static_cast<size_t>(r)];
      state.ids[static_cast<size_t>(r + grown)] = state.ids[static_cast<size_t>(r)];
    }
    for (int64_t r = end + 1; r <= end + grown; ++r) {
      state.lengths[static_cast<size_t>(r)] = state.lengths[static_cast<size_t>(end)];
      state.ids[static_cast<size_t>(r)] = state.ids[static_cast<size_t>(end)];
    }
    state.groups[expanded].size += grown;
    for (int64_t r = end + 1; r <= end + grown; ++r) state.groups[expanded].members.push_back(r);
    for (size_t g = expanded + 1; g < state.groups.size(); ++g) {
      for (int64_t& r : state.groups[g].members) r += grown;
    }
  }

  HybridCpRound finish(const RoundState& state) const {
    HybridCpRound round;
    round.sample_ids_per_rank = state.ids;
    std::map<int64_t, int64_t> holders;  // sample id -> number of ranks running it
    for (const auto& ids : state.ids) {
      for (const int64_t id : ids) ++holders[id];
    }
    std::set<int64_t> placed;
    for (int64_t r = 0; r < ranks_; ++r) {
      const auto& ids = state.ids[static_cast<size_t>(r)];
      for (size_t k = 0; k < ids.size(); ++k) {
        if (!placed.insert(ids[k]).second) continue;
        const CpPlacement placement{ids[k], state.lengths[static_cast<size_t>(r)][k], r, holders[ids[k]]};
        for (int64_t q = r; q < r + placement.cp_size; ++q) {
          const auto* other = q < ranks_ ? &state.ids[static_cast<size_t>(q)] : nullptr;
          if (other == nullptr || std::find(other->begin(), other->end(), ids[k]) == other->end()) {
            throw std::logic_error("hybrid CP schedule: sample " + std::to_string(ids[k]) + " on non-contiguous ranks");
          }
        }
        round.placements.push_back(placement);
      }
    }
    std::map<int64_t, int64_t> cp_size_of;
    for (const CpPlacement& p : round.placements) cp_size_of[p.sample_id] = p.cp_size;
    round.work_per_rank.assign(static_cast<size_t>(ranks_), 0.0);
    for (int64_t r = 0; r < ranks_; ++r) {
      for (size_t k = 0; k < state.ids[static_cast<size_t>(r)].size(); ++k) {
        round.work_per_rank[static_cast<size_t>(r)] +=
            hybrid_cp_work(state.lengths[static_cast<size_t>(r)][k], cp_size_of[state.ids[static_cast<size_t>(r)][k]]);
      }
    }
    return round;
  }

  int64_t ranks_;
  int64_t max_seqlen_per_rank_;
};

bool is_power_of_two(const int64_t n) { return n > 0 && (n & (n - 1)) == 0; }

}  // namespace

int64_t hybrid_cp_ranks_needed(const int64_t length, const int64_t max_seqlen_per_rank) {
  if (length < 1 || max_seqlen_per_rank < 1) {
    throw DataError("hybrid CP: sample length " + std::to_string(length) + " and --max-seqlen-per-dp-cp-rank " +
                    std::to_string(max_seqlen_per_rank) + " must be positive");
  }
  const int64_t shards = (length + max_seqlen_per_rank - 1) / max_seqlen_per_rank;  // ceil(L / max), >= 1
  int64_t ranks = 1;
  while (ranks < shards) ranks *= 2;
  return ranks;
}

double hybrid_cp_work(const int64_t length, const int64_t cp_size) {
  return static_cast<double>(checked_mul(length, length, "hybrid CP work")) / static_cast<double>(cp_size);
}

std::vector<HybridCpRound> schedule_hybrid_cp(std::span<const CpSample> samples, const int64_t total_ranks,
                                              const int64_t max_seqlen_per_rank) {
  if (!is_power_of_two(total_ranks)) {
    throw DataError("hybrid CP: DP x CP = " + std::to_string(total_ranks) + " ranks is not a power of two");
  }
  std::set<int64_t> ids;
  for (const CpSample& s : samples) {
    if (hybrid_cp_ranks_needed(s.length, max_seqlen_per_rank) > total_ranks) {
      throw DataError("hybrid CP: sample " + std::to_string(s.id) + " of " + std::to_string(s.length) +
                      " tokens does not fit " + std::to_string(total_ranks) + " ranks of --max-seqlen-per-dp-cp-rank " +
                      std::to_string(max_seqlen_per_rank));
    }
    if (!ids.insert(s.id).second) throw DataError("hybrid CP: sample id " + std::to_string(s.id) + " repeats");
  }
  std::vector<CpSample> waiting(samples.begin(), samples.end());
  std::stable_sort(waiting.begin(), waiting.end(),
                   [](const CpSample& a, const CpSample& b) { return a.length > b.length; });
  const BalancedCpScheduler scheduler(total_ranks, max_seqlen_per_rank);
  std::vector<HybridCpRound> rounds;
  while (!waiting.empty()) rounds.push_back(scheduler.next_round(waiting));
  return rounds;
}

}  // namespace moecore
