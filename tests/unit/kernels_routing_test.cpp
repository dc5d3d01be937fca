// Routing kernels (kernels/cpu/routing.h): the fast kernels against the naive references on random logits, with the
// scores rounded to fp32 as Megatron evaluates them, past the OpenMP threshold; the per-sequence (periodic) form of
// the aux scores' backward against the per-token form; the capacity mask's Megatron order on a hand-made case.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <numeric>
#include <random>
#include <string>
#include <vector>

#include "kernel_test_util.h"
#include "moecore/kernels/cpu/above_mask.h"
#include "moecore/kernels/cpu/routing.h"

namespace moecore::kernels {
namespace {

using test::random_vector;

struct Routed {
  std::vector<int32_t> idx;
  std::vector<double> probs;
  std::vector<uint8_t> map;
  std::vector<double> probs_TE;
  std::vector<int64_t> counts;
  std::vector<double> dlogits;
};

// Forward, routing map and backward of one backend on fp64 logits.
template <bool kFast>
Routed route(const std::vector<double>& logits, const std::vector<float>& bias, const int64_t n, const int64_t E,
             const int64_t k, const TopkRoutingSpec& spec, const int64_t capacity, const RoutingDropPolicy policy,
             const bool pad) {
  Routed r;
  r.idx.resize(static_cast<size_t>(n * k));
  r.probs.resize(static_cast<size_t>(n * k));
  r.map.resize(static_cast<size_t>(n * E));
  r.probs_TE.resize(static_cast<size_t>(n * E));
  r.counts.resize(static_cast<size_t>(E));
  r.dlogits.assign(static_cast<size_t>(n * E), 0.0);
  const std::vector<double> dprobs = random_vector<double>(static_cast<size_t>(n * E), 17);
  const float* bias_E = bias.empty() ? nullptr : bias.data();
  if constexpr (kFast) {
    cpu::topk_routing_forward<double>(r.idx.data(), r.probs.data(), logits.data(), bias_E, nullptr, n, E, k, spec);
    cpu::routing_map<double>(r.map.data(), r.probs_TE.data(), r.counts.data(), r.idx.data(), r.probs.data(), n, E, k,
                             capacity, policy, pad);
    cpu::topk_routing_backward<double>(r.dlogits.data(), dprobs.data(), r.map.data(), r.idx.data(), logits.data(), n, E,
                                       k, spec);
  } else {
    ref::topk_routing_forward<double>(r.idx.data(), r.probs.data(), logits.data(), bias_E, nullptr, n, E, k, spec);
    ref::routing_map<double>(r.map.data(), r.probs_TE.data(), r.counts.data(), r.idx.data(), r.probs.data(), n, E, k,
                             capacity, policy, pad);
    ref::topk_routing_backward<double>(r.dlogits.data(), dprobs.data(), r.map.data(), r.idx.data(), logits.data(), n, E,
                                       k, spec);
  }
  return r;
}

// A routing spec from a test variant's fields.
TopkRoutingSpec routing_spec(const RoutingScore score, const bool pre_softmax, const int64_t groups,
                             const int64_t group_topk, const double factor) {
  TopkRoutingSpec spec;
  spec.score = score;
  spec.pre_softmax = pre_softmax;
  spec.num_groups = groups;
  spec.group_topk = group_topk;
  spec.scaling_factor = factor;
  return spec;
}

TEST(RoutingKernels, FastMatchesReferenceWithFp32Scores) {
  const int64_t n = 300, E = 64;  // n * E past the OpenMP threshold
  const std::vector<double> logits = random_vector<double>(static_cast<size_t>(n * E), 5, -3.0, 3.0);
  const std::vector<float> bias = random_vector<float>(static_cast<size_t>(E), 6, -0.05f, 0.05f);
  struct Variant {
    const char* name;
    RoutingScore score;
    bool pre_softmax;
    int64_t k, groups, group_topk;
    double factor;
    bool bias;
    int64_t capacity;
    RoutingDropPolicy policy;
    bool pad;
  };
  const Variant variants[] = {
      {"softmax", RoutingScore::kSoftmax, false, 2, 0, 0, 0.0, false, -1, RoutingDropPolicy::kProbs, false},
      {"pre_softmax_capacity", RoutingScore::kSoftmax, true, 4, 0, 0, 0.0, false, 12, RoutingDropPolicy::kProbs, false},
      {"sigmoid_groups_bias", RoutingScore::kSigmoid, false, 6, 8, 3, 2.5, true, 30, RoutingDropPolicy::kPosition,
       true},
      {"sqrtsoftplus", RoutingScore::kSqrtSoftplus, false, 3, 0, 0, 0.0, true, 9, RoutingDropPolicy::kProbs, true},
      {"softmax_k20_sorted", RoutingScore::kSoftmax, true, 20, 0, 0, 0.0, false, -1, RoutingDropPolicy::kProbs, false},
  };
  for (const Variant& v : variants) {
    const TopkRoutingSpec spec = routing_spec(v.score, v.pre_softmax, v.groups, v.group_topk, v.factor);
    const std::vector<float> b = v.bias ? bias : std::vector<float>{};
    const Routed fast = route<true>(logits, b, n, E, v.k, spec, v.capacity, v.policy, v.pad);
    const Routed naive = route<false>(logits, b, n, E, v.k, spec, v.capacity, v.policy, v.pad);
    EXPECT_EQ(fast.idx, naive.idx) << v.name;
    EXPECT_EQ(fast.probs, naive.probs) << v.name;  // fp32 numbers from the same double formulas
    for (const double p : fast.probs) ASSERT_EQ(p, static_cast<double>(static_cast<float>(p))) << v.name;
    EXPECT_EQ(fast.map, naive.map) << v.name;
    EXPECT_EQ(fast.probs_TE, naive.probs_TE) << v.name;
    EXPECT_EQ(fast.counts, naive.counts) << v.name;
    EXPECT_LT(test::max_rel_error(fast.dlogits, naive.dlogits, 1e-12), 1e-9) << v.name;
  }
}

// Router replay (TopkRoutingSpec::given_selection): replaying a selection the kernel made gives its probabilities bit
// for bit; replaying another (random distinct experts, in any order) gives the reference's probabilities at it, i.e.
// Megatron's gather from the scores, then the softmax over the k, the normalisation or the scaling of the score
// function, with the expert bias and the groups not consulted.
TEST(RoutingKernels, GivenSelectionGathersTheScoresAtIt) {
  const int64_t n = 300, E = 64;
  const std::vector<double> logits = random_vector<double>(static_cast<size_t>(n * E), 8, -3.0, 3.0);
  const std::vector<float> bias = random_vector<float>(static_cast<size_t>(E), 9, -0.05f, 0.05f);
  struct Variant {
    const char* name;
    RoutingScore score;
    bool pre_softmax;
    int64_t k, groups, group_topk;
    double factor;
    bool bias;
  };
  const Variant variants[] = {
      {"softmax", RoutingScore::kSoftmax, false, 2, 0, 0, 0.0, false},
      {"pre_softmax_scaled", RoutingScore::kSoftmax, true, 4, 0, 0, 1.5, false},
      {"sigmoid_groups_bias", RoutingScore::kSigmoid, false, 6, 8, 3, 2.5, true},
      {"sqrtsoftplus_bias", RoutingScore::kSqrtSoftplus, false, 3, 0, 0, 0.0, true},
      {"sigmoid_top1", RoutingScore::kSigmoid, false, 1, 0, 0, 0.0, false},
  };
  std::mt19937 rng(10);
  for (const Variant& v : variants) {
    const TopkRoutingSpec spec = routing_spec(v.score, v.pre_softmax, v.groups, v.group_topk, v.factor);
    const float* bias_E = v.bias ? bias.data() : nullptr;
    const size_t nk = static_cast<size_t>(n * v.k);
    std::vector<int32_t> chosen(nk), replayed(nk);
    std::vector<double> probs(nk), replayed_probs(nk, -1.0);
    cpu::topk_routing_forward<double>(chosen.data(), probs.data(), logits.data(), bias_E, nullptr, n, E, v.k, spec);
    TopkRoutingSpec given = spec;
    given.given_selection = true;
    replayed = chosen;
    cpu::topk_routing_forward<double>(replayed.data(), replayed_probs.data(), logits.data(), bias_E, nullptr, n, E, v.k,
                                      given);
    EXPECT_EQ(replayed, chosen) << v.name << ": the given selection is left as it is";
    EXPECT_EQ(replayed_probs, probs) << v.name << ": its own selection replays bit for bit";
    // Rows without a record (first entry negative) select from the scores: every third row here.
    std::vector<int32_t> partly(nk, 0);
    for (int64_t t = 0; t < n; ++t) {
      for (int64_t i = 0; i < v.k; ++i) partly[static_cast<size_t>(t * v.k + i)] = t % 3 == 0 ? -1 : v.k - 1 - i;
    }
    std::vector<double> partly_probs(nk), partly_ref_probs(nk);
    std::vector<int32_t> partly_ref = partly;
    cpu::topk_routing_forward<double>(partly.data(), partly_probs.data(), logits.data(), bias_E, nullptr, n, E, v.k,
                                      given);
    ref::topk_routing_forward<double>(partly_ref.data(), partly_ref_probs.data(), logits.data(), bias_E, nullptr, n, E,
                                      v.k, given);
    EXPECT_EQ(partly, partly_ref) << v.name;
    EXPECT_EQ(partly_probs, partly_ref_probs) << v.name;
    for (int64_t t = 0; t < n; ++t) {
      for (int64_t i = 0; i < v.k; ++i) {
        const auto at = static_cast<size_t>(t * v.k + i);
        EXPECT_EQ(partly[at], t % 3 == 0 ? chosen[at] : static_cast<int32_t>(v.k - 1 - i)) << v.name << " row " << t;
        if (t % 3 == 0) {
          EXPECT_EQ(partly_probs[at], probs[at]) << v.name << " row " << t;
        }
      }
    }

    std::vector<int32_t> other(nk);
    for (int64_t t = 0; t < n; ++t) {
      std::vector<int32_t> experts(static_cast<size_t>(E));
      std::iota(experts.begin(), experts.end(), 0);
      std::shuffle(experts.begin(), experts.end(), rng);
      std::copy_n(experts.begin(), v.k, other.begin() + t * v.k);
    }
    std::vector<int32_t> fast_idx = other, ref_idx = other;
    std::vector<double> fast_probs(nk), ref_probs(nk);
    cpu::topk_routing_forward<double>(fast_idx.data(), fast_probs.data(), logits.data(), bias_E, nullptr, n, E, v.k,
                                      given);
    ref::topk_routing_forward<double>(ref_idx.data(), ref_probs.data(), logits.data(), bias_E, nullptr, n, E, v.k,
                                      given);
    EXPECT_EQ(fast_idx, other) << v.name;
    EXPECT_EQ(ref_idx, other) << v.name;
    EXPECT_EQ(fast_probs, ref_probs) << v.name;
    // Megatron's formulas at the first token, by hand.
    std::vector<double> scores(static_cast<size_t>(E));
    for (int64_t e = 0; e < E; ++e) {
      const double l = logits[static_cast<size_t>(e)];
      scores[static_cast<size_t>(e)] = v.score == RoutingScore::kSigmoid        ? 1.0 / (1.0 + std::exp(-l))
                                       : v.score == RoutingScore::kSqrtSoftplus ? std::sqrt(std::log1p(std::exp(l)))
                                                                                : l;
    }
    std::vector<double> expected(static_cast<size_t>(v.k));
    double sum = 0.0;
    for (int64_t i = 0; i < v.k; ++i) {
      const double s = scores[static_cast<size_t>(other[static_cast<size_t>(i)])];
      expected[static_cast<size_t>(i)] = v.score == RoutingScore::kSoftmax ? std::exp(s) : s;
      sum += expected[static_cast<size_t>(i)];
    }
    if (v.score == RoutingScore::kSoftmax && v.pre_softmax) {
      sum = 0.0;
      for (int64_t e = 0; e < E; ++e) sum += std::exp(scores[static_cast<size_t>(e)]);
    }
    for (int64_t i = 0; i < v.k; ++i) {
      double p = expected[static_cast<size_t>(i)];
      if (v.score == RoutingScore::kSoftmax || v.k > 1) p /= sum;
      if (v.factor != 0.0) p *= v.factor;
      EXPECT_NEAR(fast_probs[static_cast<size_t>(i)], p, 1e-6 * std::abs(p)) << v.name << " expert " << i;
    }
  }
}

TEST(RoutingKernels, AuxScoresZLossAndSumsMatchReference) {
  const int64_t n = 260, E = 72, k = 3, B = 4;
  const std::vector<double> logits = random_vector<double>(static_cast<size_t>(n * E), 9, -4.0, 4.0);
  for (const RoutingScore score : {RoutingScore::kSoftmax, RoutingScore::kSigmoid, RoutingScore::kSqrtSoftplus}) {
    std::vector<double> s_fast(static_cast<size_t>(n * E)), s_ref(s_fast.size());
    std::vector<int32_t> i_fast(static_cast<size_t>(n * k)), i_ref(i_fast.size());
    cpu::aux_scores_forward<double>(s_fast.data(), i_fast.data(), logits.data(), n, E, k, score, true);
    ref::aux_scores_forward<double>(s_ref.data(), i_ref.data(), logits.data(), n, E, k, score, true);
    EXPECT_EQ(s_fast, s_ref);
    EXPECT_EQ(i_fast, i_ref);
    // The per-sequence gradient [B, E] equals the same gradient repeated on every token of each sequence.
    const std::vector<double> ds_BE = random_vector<double>(static_cast<size_t>(B * E), 10);
    std::vector<double> ds_TE(static_cast<size_t>(n * E));
    for (int64_t t = 0; t < n; ++t) {
      for (int64_t e = 0; e < E; ++e)
        ds_TE[static_cast<size_t>(t * E + e)] = ds_BE[static_cast<size_t>((t % B) * E + e)];
    }
    std::vector<double> d_periodic(static_cast<size_t>(n * E), 0.0), d_dense = d_periodic, d_ref = d_periodic;
    cpu::aux_scores_backward<double>(d_periodic.data(), ds_BE.data(), B, s_fast.data(), logits.data(), n, E, score);
    cpu::aux_scores_backward<double>(d_dense.data(), ds_TE.data(), n, s_fast.data(), logits.data(), n, E, score);
    ref::aux_scores_backward<double>(d_ref.data(), ds_BE.data(), B, s_fast.data(), logits.data(), n, E, score);
    EXPECT_EQ(d_periodic, d_dense);
    EXPECT_LT(test::max_rel_error(d_periodic, d_ref, 1e-12), 1e-9);

    std::vector<double> sums_fast(static_cast<size_t>(E + 2 * B * E)), sums_ref(sums_fast.size());
    cpu::aux_loss_sums<double>(sums_fast.data(), sums_fast.data() + E, sums_fast.data() + E + B * E, s_fast.data(),
                               i_fast.data(), n, B, E, k);
    ref::aux_loss_sums<double>(sums_ref.data(), sums_ref.data() + E, sums_ref.data() + E + B * E, s_fast.data(),
                               i_fast.data(), n, B, E, k);
    EXPECT_LT(test::max_rel_error(sums_fast, sums_ref, 1e-12), 1e-12);
  }
  std::vector<double> lse_fast(static_cast<size_t>(n)), lse_ref(lse_fast.size());
  const double z_fast = cpu::z_loss_forward<double>(lse_fast.data(), logits.data(), n, E);
  const double z_ref = ref::z_loss_forward<double>(lse_ref.data(), logits.data(), n, E);
  EXPECT_NEAR(z_fast, z_ref, 1e-12 * z_ref);
  EXPECT_LT(test::max_rel_error(lse_fast, lse_ref, 1e-12), 1e-12);
}

// Values with many exact ties (a few levels) and some -inf entries, or continuous ones.
std::vector<double> tied_or_random(const int64_t n, const uint32_t seed, const int levels) {
  std::mt19937 gen(seed);
  std::vector<double> v(static_cast<size_t>(n));
  if (levels == 0) {
    std::normal_distribution<double> dist(0.0, 1.0);
    for (double& x : v) x = dist(gen);
    return v;
  }
  std::uniform_int_distribution<int> level(0, levels);
  for (double& x : v) {
    const int l = level(gen);
    x = l == 0 ? -std::numeric_limits<double>::infinity() : 0.125 * l;
  }
  return v;
}

// The fp32 softmax scores of rows of 32 or more logits run in vector loops and fall back to the scalar softmax near an
// fp32 rounding boundary (routing.cpp); either way they are the reference's bit for bit: normal, wide and tied
// logits, -inf, and rows with +inf or NaN (which always fall back). Thousands of rows per width, so that rows near a
// boundary (about 1e-3 of them) occur.
TEST(RoutingKernels, Fp32SoftmaxScoresEqualTheReferenceBitForBit) {
  const int64_t k = 2;
  for (const int64_t E : {32, 37, 64, 256, 1000}) {
    const int64_t n = 400'000 / E;
    std::vector<double> logits;
    std::mt19937 gen(static_cast<uint32_t>(E));
    std::normal_distribution<double> normal(0.0, 1.0);
    for (int64_t t = 0; t < n; ++t) {
      if (t % 4 == 3) {
        const std::vector<double> row = tied_or_random(E, static_cast<uint32_t>(t), 1 + static_cast<int>(t % 7));
        logits.insert(logits.end(), row.begin(), row.end());
        continue;
      }
      const double scale = t % 4 == 0 ? 1.0 : (t % 4 == 1 ? 30.0 : 1e-4);
      for (int64_t e = 0; e < E; ++e) logits.push_back(scale * normal(gen));
    }
    logits[static_cast<size_t>(5 * E + 3)] = std::numeric_limits<double>::infinity();
    logits[static_cast<size_t>(6 * E + 1)] = std::numeric_limits<double>::quiet_NaN();
    logits[static_cast<size_t>(7 * E)] = -std::numeric_limits<double>::infinity();
    std::vector<double> fast(logits.size()), want(logits.size());
    std::vector<int32_t> i_fast(static_cast<size_t>(n * k)), i_want(i_fast.size());
    cpu::aux_scores_forward<double>(fast.data(), i_fast.data(), logits.data(), n, E, k, RoutingScore::kSoftmax, true);
    ref::aux_scores_forward<double>(want.data(), i_want.data(), logits.data(), n, E, k, RoutingScore::kSoftmax, true);
    for (size_t i = 0; i < fast.size(); ++i) {
      ASSERT_EQ(std::memcmp(&fast[i], &want[i], sizeof(double)), 0)
          << "E " << E << " row " << i / static_cast<size_t>(E) << ": " << fast[i] << " vs " << want[i];
    }
    EXPECT_EQ(i_fast, i_want) << "E " << E;
  }
}

// The selection alone (softmax scores without pre-softmax rank the raw logits): the one-pass top-k (and the sorting
// one past 16) picks exactly what the reference's full sort picks, in the same order, with ties and -inf.
std::vector<int32_t> selection(const bool fast, const std::vector<double>& v, const int64_t E, const int64_t k,
                               const int64_t groups, const int64_t group_topk) {
  TopkRoutingSpec spec;
  spec.num_groups = groups;
  spec.group_topk = group_topk;
  std::vector<int32_t> idx(static_cast<size_t>(k));
  std::vector<double> probs(static_cast<size_t>(k));
  (fast ? cpu::topk_routing_forward<double> : ref::topk_routing_forward<double>)(idx.data(), probs.data(), v.data(),
                                                                                 nullptr, nullptr, 1, E, k, spec);
  return idx;
}

// The top-k's block test: each vector form this CPU runs gives the portable mask, which is the comparison's, on
// values with ties at the bound, infinities and NaN.
TEST(RoutingKernels, AboveMaskFormsAgree) {
  std::mt19937_64 gen(7);
  std::uniform_int_distribution<int> pick(0, 9);
  const double nan = std::numeric_limits<double>::quiet_NaN(), inf = std::numeric_limits<double>::infinity();
  for (int trial = 0; trial < 2000; ++trial) {
    const double bound = trial % 5 == 0 ? -inf : static_cast<double>(pick(gen)) * 0.25;
    double values[16];
    for (double& v : values) {
      const int kind = pick(gen);
      v = kind == 0   ? nan
          : kind == 1 ? inf
          : kind == 2 ? -inf
          : kind == 3 ? bound
                      : static_cast<double>(pick(gen)) * 0.25;
    }
    uint32_t want = 0;
    for (uint32_t j = 0; j < 16; ++j) want |= (values[j] > bound ? 1u : 0u) << j;
    ASSERT_EQ(cpu::above_mask16_portable(values, bound), want) << trial;
    if (cpu::above_mask16_avx_usable()) {
      ASSERT_EQ(cpu::above_mask16_avx(values, bound), want) << trial;
    }
    if (cpu::above_mask16_avx512_usable()) {
      ASSERT_EQ(cpu::above_mask16_avx512(values, bound), want) << trial;
    }
    ASSERT_EQ(cpu::best_above_mask16()(values, bound), want) << trial;
  }
}

TEST(RoutingKernels, TopkEqualsTheFullSortWithTiesAndInfinities) {
  for (const int64_t E : {1, 2, 7, 64, 257}) {
    for (const int64_t k : {int64_t{1}, int64_t{2}, int64_t{3}, int64_t{8}, int64_t{16}, int64_t{20}}) {
      if (k > E) continue;
      for (uint32_t seed = 0; seed < 20; ++seed) {
        const std::vector<double> v = tied_or_random(E, seed + 100, seed % 2 == 0 ? 0 : 1 + static_cast<int>(seed % 5));
        ASSERT_EQ(selection(true, v, E, k, 0, 0), selection(false, v, E, k, 0, 0))
            << "E " << E << " k " << k << " seed " << seed;
      }
    }
  }
  struct Case {
    int64_t E, k, groups, group_topk;
  };
  for (const Case c : {Case{8, 2, 4, 2}, Case{8, 3, 4, 2}, Case{64, 4, 8, 2}, Case{256, 8, 8, 4}, Case{128, 6, 64, 3},
                       Case{160, 4, 80, 4}, Case{64, 18, 8, 3}}) {
    for (uint32_t seed = 0; seed < 20; ++seed) {
      const std::vector<double> v = tied_or_random(c.E, seed + 200, seed % 2 == 0 ? 0 : 2 + static_cast<int>(seed % 4));
      ASSERT_EQ(selection(true, v, c.E, c.k, c.groups, c.group_topk),
                selection(false, v, c.E, c.k, c.groups, c.group_topk))
          << "E " << c.E << " groups " << c.groups << " seed " << seed;
    }
  }
}

// The bucketed capacity mask against the reference's stable sort over all tokens: probs with ties, zeros and
// negatives, every policy, dropping and padding, capacities from 0 past T.
TEST(RoutingKernels, CapacityMaskEqualsTheReferenceOnRandomData) {
  const int64_t T = 37;
  for (const int64_t E : {1, 4, 16}) {
    for (const int64_t k : {int64_t{1}, int64_t{2}, int64_t{4}}) {
      if (k > E) continue;
      for (uint32_t seed = 0; seed < 12; ++seed) {
        std::mt19937 gen(seed + 300);
        std::vector<int32_t> idx(static_cast<size_t>(T * k));
        std::vector<double> probs(static_cast<size_t>(T * k));
        std::vector<int32_t> order(static_cast<size_t>(E));
        std::uniform_int_distribution<int> level(-1, 6);
        for (int64_t t = 0; t < T; ++t) {
          std::iota(order.begin(), order.end(), 0);
          std::shuffle(order.begin(), order.end(), gen);
          for (int64_t i = 0; i < k; ++i) {
            idx[static_cast<size_t>(t * k + i)] = order[static_cast<size_t>(i)];
            probs[static_cast<size_t>(t * k + i)] = 0.125 * level(gen);
          }
        }
        for (const RoutingDropPolicy policy : {RoutingDropPolicy::kProbs, RoutingDropPolicy::kPosition}) {
          for (const bool pad : {false, true}) {
            for (const int64_t capacity :
                 {int64_t{-1}, int64_t{0}, int64_t{1}, int64_t{3}, T * k / E, T - 1, T, T + 5}) {
              std::vector<uint8_t> map_fast(static_cast<size_t>(T * E), 7), map_ref(map_fast.size(), 9);
              std::vector<double> p_fast(map_fast.size(), 7.0), p_ref(map_fast.size(), 9.0);
              std::vector<int64_t> c_fast(static_cast<size_t>(E), 7), c_ref(c_fast.size(), 9);
              cpu::routing_map<double>(map_fast.data(), p_fast.data(), c_fast.data(), idx.data(), probs.data(), T, E, k,
                                       capacity, policy, pad);
              ref::routing_map<double>(map_ref.data(), p_ref.data(), c_ref.data(), idx.data(), probs.data(), T, E, k,
                                       capacity, policy, pad);
              const std::string what = "E " + std::to_string(E) + " k " + std::to_string(k) + " seed " +
                                       std::to_string(seed) + " capacity " + std::to_string(capacity);
              ASSERT_EQ(map_fast, map_ref) << what;
              ASSERT_EQ(p_fast, p_ref) << what;
              ASSERT_EQ(c_fast, c_ref) << what;
            }
          }
        }
      }
    }
  }
}

// Megatron's order for one expert over all tokens: positive probs descending (ties to the earlier token), then the
// zero-probability tokens in token order. Expert 0 is selected by tokens 1, 2, 4 with probs 0.5, 0.7, 0.5.
TEST(RoutingKernels, CapacityMaskOrder) {
  const int64_t n = 5, E = 2, k = 1;
  const std::vector<int32_t> idx = {1, 0, 0, 1, 0};
  const std::vector<double> probs = {0.9, 0.5, 0.7, 0.8, 0.5};
  for (const bool fast : {true, false}) {
    std::vector<uint8_t> map(static_cast<size_t>(n * E));
    std::vector<double> probs_TE(map.size());
    std::vector<int64_t> counts(static_cast<size_t>(E));
    const auto run = fast ? cpu::routing_map<double> : ref::routing_map<double>;
    run(map.data(), probs_TE.data(), counts.data(), idx.data(), probs.data(), n, E, k, 2, RoutingDropPolicy::kProbs,
        false);
    // Expert 0 keeps tokens 2 (0.7) and 1 (0.5, earlier than 4); expert 1 keeps tokens 0 and 3.
    EXPECT_EQ(map, (std::vector<uint8_t>{0, 1, 1, 0, 1, 0, 0, 1, 0, 0})) << fast;
    EXPECT_EQ(counts, (std::vector<int64_t>{2, 2})) << fast;
    run(map.data(), probs_TE.data(), counts.data(), idx.data(), probs.data(), n, E, k, 4, RoutingDropPolicy::kProbs,
        true);
    // Padded to capacity 4: expert 0 takes its 3 tokens, then the first unselected token (0); expert 1 its 2 tokens,
    // then tokens 1 and 2 at probability 0.
    EXPECT_EQ(map, (std::vector<uint8_t>{1, 1, 1, 1, 1, 1, 0, 1, 1, 0})) << fast;
    EXPECT_EQ(probs_TE, (std::vector<double>{0, 0.9, 0.5, 0, 0.7, 0, 0, 0.8, 0.5, 0})) << fast;
    EXPECT_EQ(counts, (std::vector<int64_t>{4, 4})) << fast;
  }
}

}  // namespace
}  // namespace moecore::kernels
