#include "moecore/model/vocab_parallel.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <span>
#include <stdexcept>
#include <string>
#include <vector>

#include "moecore/parallel/comm_stats.h"

namespace moecore::tp {
namespace {

void check_id(const int32_t id, const int64_t V) {
  if (id < 0 || id >= V) {
    throw std::out_of_range("token id " + std::to_string(id) + " is outside the vocabulary [0, " + std::to_string(V) +
                            ")");
  }
}

}  // namespace

void vocab_embedding_forward(float* out_TH, const int32_t* ids_T, const float* weight_VlH, const int64_t T,
                             const int64_t V, const int64_t vocab_begin, const int64_t V_local, const int64_t H) {
  for (int64_t t = 0; t < T; ++t) check_id(ids_T[t], V);
#pragma omp parallel for schedule(static) if (T * H > 65536)
  for (int64_t t = 0; t < T; ++t) {
    const int64_t row = ids_T[t] - vocab_begin;
    float* out = out_TH + t * H;
    if (row >= 0 && row < V_local) {
      std::memcpy(out, weight_VlH + row * H, sizeof(float) * static_cast<size_t>(H));
    } else {
      std::fill_n(out, H, 0.0f);
    }
  }
}

void vocab_embedding_backward(float* dweight_VlH, const float* dout_TH, const int32_t* ids_T, const int64_t T,
                              const int64_t vocab_begin, const int64_t V_local, const int64_t H) {
  for (int64_t t = 0; t < T; ++t) {
    const int64_t row = ids_T[t] - vocab_begin;
    if (row < 0 || row >= V_local) continue;
    float* dw = dweight_VlH + row * H;
    const float* d = dout_TH + t * H;
    for (int64_t h = 0; h < H; ++h) dw[h] += d[h];
  }
}

void vocab_cross_entropy_forward(float* losses_T, float* lse_T, const float* logits_TVl, const int32_t* targets_T,
                                 const int64_t T, const int64_t V, const int64_t vocab_begin, const int64_t V_local,
                                 const parallel::ProcessGroup& group) {
  for (int64_t t = 0; t < T; ++t) check_id(targets_T[t], V);
  std::vector<float> max_T(static_cast<size_t>(T));
#pragma omp parallel for schedule(static)
  for (int64_t t = 0; t < T; ++t) {
    const float* row = logits_TVl + t * V_local;
    float m = -std::numeric_limits<float>::infinity();
    for (int64_t v = 0; v < V_local; ++v) m = std::max(m, row[v]);
    max_T[static_cast<size_t>(t)] = m;
  }
  if (group.size() > 1) {
    const parallel::CommTimer timer(parallel::CommKind::kTensorParallel);
    group.all_reduce(std::span<float>(max_T), parallel::ReduceOp::kMax);
  }
  // [sum of exp(logit - max) over this rank's columns | this rank's target logit or 0], summed over TP.
  std::vector<float> sums_2T(static_cast<size_t>(2 * T), 0.0f);
#pragma omp parallel for schedule(static)
  for (int64_t t = 0; t < T; ++t) {
    const float* row = logits_TVl + t * V_local;
    const float m = max_T[static_cast<size_t>(t)];
    double sum = 0.0;
    for (int64_t v = 0; v < V_local; ++v) sum += std::exp(static_cast<double>(row[v] - m));
    sums_2T[static_cast<size_t>(t)] = static_cast<float>(sum);
    const int64_t col = targets_T[t] - vocab_begin;
    if (col >= 0 && col < V_local) sums_2T[static_cast<size_t>(T + t)] = row[col];
  }
  if (group.size() > 1) {
    const parallel::CommTimer timer(parallel::CommKind::kTensorParallel);
    group.all_reduce(std::span<float>(sums_2T), parallel::ReduceOp::kSum);
  }
  for (int64_t t = 0; t < T; ++t) {
    const float lse = max_T[static_cast<size_t>(t)] + std::log(sums_2T[static_cast<size_t>(t)]);
    lse_T[t] = lse;
    losses_T[t] = lse - sums_2T[static_cast<size_t>(T + t)];
  }
}

void vocab_cross_entropy_backward(float* dlogits_TVl, const float* dlosses_T, const float* logits_TVl,
                                  const float* lse_T, const int32_t* targets_T, const int64_t T,
                                  const int64_t vocab_begin, const int64_t V_local) {
#pragma omp parallel for schedule(static)
  for (int64_t t = 0; t < T; ++t) {
    const float* row = logits_TVl + t * V_local;
    float* drow = dlogits_TVl + t * V_local;
    const float scale = dlosses_T[t], lse = lse_T[t];
    for (int64_t v = 0; v < V_local; ++v) drow[v] = scale * std::exp(row[v] - lse);
    const int64_t col = targets_T[t] - vocab_begin;
    if (col >= 0 && col < V_local) drow[col] -= scale;
  }
}

}  // namespace moecore::tp
