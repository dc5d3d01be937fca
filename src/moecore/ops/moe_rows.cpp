#include "moecore/ops/moe_rows.h"

#include <algorithm>
#include <optional>
#include <string>
#include <vector>

#include "moecore/ops/dispatch.h"
#include "moecore/ops/precision.h"
#include "moecore/ops/row_blocks.h"

namespace moecore::ops {
using detail::opt;
using detail::ptr;
namespace {

int64_t rows_in(const Tensor& t) { return t.ndim() == 0 ? 0 : t.dim(0); }

// Every index below N.
void check_index(const char* op, std::span<const int64_t> index_R, const int64_t N) {
  for (const int64_t n : index_R) {
    if (n >= N) detail::fail(op, "row index " + std::to_string(n) + " out of " + std::to_string(N) + " rows");
  }
}

// Chunks inside [0, N), non-negative; returns their total rows.
int64_t check_chunks(const char* op, std::span<const int64_t> first_C, std::span<const int64_t> rows_C, const int64_t N,
                     const bool disjoint) {
  if (first_C.size() != rows_C.size()) {
    detail::fail(
        op, std::to_string(first_C.size()) + " chunk starts for " + std::to_string(rows_C.size()) + " chunk sizes");
  }
  int64_t total = 0;
  for (size_t c = 0; c < first_C.size(); ++c) {
    if (first_C[c] < 0 || rows_C[c] < 0 || first_C[c] + rows_C[c] > N) {
      detail::fail(op, "chunk " + std::to_string(c) + " rows [" + std::to_string(first_C[c]) + ", " +
                           std::to_string(first_C[c] + rows_C[c]) + ") out of " + std::to_string(N) + " rows");
    }
    total += rows_C[c];
  }
  if (disjoint) {
    std::vector<std::pair<int64_t, int64_t>> spans;
    for (size_t c = 0; c < first_C.size(); ++c) {
      if (rows_C[c] > 0) spans.emplace_back(first_C[c], first_C[c] + rows_C[c]);
    }
    std::sort(spans.begin(), spans.end());
    for (size_t i = 1; i < spans.size(); ++i) {
      if (spans[i].first < spans[i - 1].second) detail::fail(op, "chunks overlap");
    }
  }
  return total;
}

std::optional<kernels::LowpType> lowp_of(const Tensor& t) {
  if (t.dtype() == DType::kBF16) return kernels::LowpType::kBF16;
  if (t.dtype() == DType::kF16) return kernels::LowpType::kF16;
  return std::nullopt;
}

}  // namespace

void moe_permute(Tensor& out_RW, const Tensor& in_NW, const std::span<const int64_t> index_R) {
  constexpr const char* op = "moe_permute";
  detail::check_tensors(op, {&out_RW, &in_NW});
  const auto R = static_cast<int64_t>(index_R.size());
  const int64_t N = rows_in(in_NW), W = N == 0 ? (R == 0 ? 0 : out_RW.numel() / R) : in_NW.numel() / N;
  detail::check_numel(op, "out_RW", out_RW, R * W);
  check_index(op, index_R, N);
  if (detail::same_16bit({&out_RW, &in_NW})) {
    kernels::cpu::gather_rows(out_RW.data<uint16_t>(), in_NW.data<uint16_t>(), index_R.data(), R, N, W);
    return;
  }
  detail::Staging staging;
  staging.write_only(out_RW, {&in_NW});
  detail::dispatch(op, out_RW,
                   [&]<typename S>(auto k) { k.gather_rows(ptr<S>(out_RW), ptr<S>(in_NW), index_R.data(), R, N, W); });
}

void moe_unpermute(Tensor& out_NW, const Tensor& in_RW, const std::span<const int64_t> index_R, const Tensor* probs_R) {
  constexpr const char* op = "moe_unpermute";
  const detail::Staging staging;
  detail::check_tensors(op, {&out_NW, &in_RW});
  const auto R = static_cast<int64_t>(index_R.size());
  const int64_t N = rows_in(out_NW), W = N == 0 ? 0 : out_NW.numel() / N;
  detail::check_numel(op, "in_RW", in_RW, R * W);
  detail::check_tensors(op, {&out_NW, probs_R});
  if (probs_R != nullptr) detail::check_numel(op, "probs_R", *probs_R, R);
  check_index(op, index_R, N);
  if (detail::same_16bit({&out_NW, &in_RW}) && (probs_R == nullptr || probs_R->dtype() == DType::kF32)) {
    kernels::cpu::moe_unpermute16(*lowp_of(out_NW), out_NW.data<uint16_t>(), in_RW.data<uint16_t>(), index_R.data(),
                                  probs_R != nullptr ? probs_R->data<float>() : nullptr, R, N, W);
    return;
  }
  detail::dispatch(op, out_NW, [&]<typename S>(auto k) {
    k.moe_unpermute(ptr<S>(out_NW), ptr<S>(in_RW), index_R.data(), opt<S>(probs_R), R, N, W);
  });
  detail::round_activations({&out_NW});
}

void moe_unpermute_backward(Tensor* din_RW, Tensor* dprobs_R, const Tensor& dout_NW,
                            const std::span<const int64_t> index_R, const Tensor* probs_R, const Tensor* in_RW) {
  constexpr const char* op = "moe_unpermute_backward";
  const detail::Staging staging;
  detail::check_tensors(op, {&dout_NW, din_RW, dprobs_R, probs_R, in_RW});
  const auto R = static_cast<int64_t>(index_R.size());
  const int64_t N = rows_in(dout_NW), W = N == 0 ? 0 : dout_NW.numel() / N;
  if (din_RW != nullptr) detail::check_numel(op, "din_RW", *din_RW, R * W);
  if (probs_R != nullptr) detail::check_numel(op, "probs_R", *probs_R, R);
  if (dprobs_R != nullptr) {
    if (probs_R == nullptr || in_RW == nullptr) detail::fail(op, "dprobs_R needs probs_R and in_RW");
    detail::check_numel(op, "dprobs_R", *dprobs_R, R);
    detail::check_numel(op, "in_RW", *in_RW, R * W);
  }
  check_index(op, index_R, N);
  const bool activations16 = detail::same_16bit({&dout_NW}) &&
                             (din_RW == nullptr || detail::same_16bit({&dout_NW, din_RW})) &&
                             (in_RW == nullptr || detail::same_16bit({&dout_NW, in_RW}));
  const bool fp32_rest = (probs_R == nullptr || probs_R->dtype() == DType::kF32) &&
                         (dprobs_R == nullptr || dprobs_R->dtype() == DType::kF32);
  if (activations16 && fp32_rest) {
    kernels::cpu::moe_unpermute_backward16(*lowp_of(dout_NW), din_RW != nullptr ? din_RW->data<uint16_t>() : nullptr,
                                           dprobs_R != nullptr ? dprobs_R->data<float>() : nullptr,
                                           dout_NW.data<uint16_t>(),
                                           in_RW != nullptr ? in_RW->data<uint16_t>() : nullptr, index_R.data(),
                                           probs_R != nullptr ? probs_R->data<float>() : nullptr, R, W);
    return;
  }
  detail::dispatch(op, dout_NW, [&]<typename S>(auto k) {
    k.moe_unpermute_backward(opt<S>(din_RW), opt<S>(dprobs_R), ptr<S>(dout_NW), opt<S>(in_RW), index_R.data(),
                             opt<S>(probs_R), R, W);
  });
  detail::round_activations({din_RW});
}

void sort_chunks(Tensor& out_RW, const Tensor& in_NW, const std::span<const int64_t> first_C,
                 const std::span<const int64_t> rows_C) {
  constexpr const char* op = "sort_chunks";
  const detail::Staging staging;
  detail::check_tensors(op, {&out_RW, &in_NW});
  const int64_t N = rows_in(in_NW), W = N == 0 ? 0 : in_NW.numel() / N;
  const int64_t R = check_chunks(op, first_C, rows_C, N, false);
  detail::check_numel(op, "out_RW", out_RW, R * W);
  const auto C = static_cast<int64_t>(first_C.size());
  if (detail::same_16bit({&out_RW, &in_NW})) {
    kernels::cpu::sort_chunks(out_RW.data<uint16_t>(), in_NW.data<uint16_t>(), first_C.data(), rows_C.data(), C, W);
    return;
  }
  detail::dispatch(op, out_RW, [&]<typename S>(auto k) {
    k.sort_chunks(ptr<S>(out_RW), ptr<S>(in_NW), first_C.data(), rows_C.data(), C, W);
  });
}

void unsort_chunks(Tensor& out_NW, const Tensor& in_RW, const std::span<const int64_t> first_C,
                   const std::span<const int64_t> rows_C) {
  constexpr const char* op = "unsort_chunks";
  const detail::Staging staging;
  detail::check_tensors(op, {&out_NW, &in_RW});
  const int64_t N = rows_in(out_NW), W = N == 0 ? 0 : out_NW.numel() / N;
  const int64_t R = check_chunks(op, first_C, rows_C, N, true);
  detail::check_numel(op, "in_RW", in_RW, R * W);
  const auto C = static_cast<int64_t>(first_C.size());
  if (detail::same_16bit({&out_NW, &in_RW})) {
    kernels::cpu::unsort_chunks(out_NW.data<uint16_t>(), in_RW.data<uint16_t>(), first_C.data(), rows_C.data(), C, N,
                                W);
    return;
  }
  detail::dispatch(op, out_NW, [&]<typename S>(auto k) {
    k.unsort_chunks(ptr<S>(out_NW), ptr<S>(in_RW), first_C.data(), rows_C.data(), C, N, W);
  });
}

}  // namespace moecore::ops
