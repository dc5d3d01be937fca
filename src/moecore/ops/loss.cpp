#include "moecore/ops/loss.h"

#include "moecore/ops/dispatch.h"
#include "moecore/ops/precision.h"

namespace moecore::ops {
using detail::ptr;
namespace {

int64_t tokens(const std::span<const int32_t> ids) { return static_cast<int64_t>(ids.size()); }

}  // namespace

void embedding_forward(Tensor& out_TD, const std::span<const int32_t> ids_T, const Tensor& weight_VlD, const int64_t V,
                       const int64_t vocab_begin) {
  constexpr const char* op = "embedding_forward";
  const detail::Staging staging;
  detail::check_tensors(op, {&out_TD, &weight_VlD});
  const int64_t T = tokens(ids_T), Vl = weight_VlD.dim(0), D = weight_VlD.numel() / Vl;
  detail::check_numel(op, "out_TD", out_TD, T * D);
  detail::dispatch(op, weight_VlD, [&]<typename S>(auto k) {
    k.vocab_embedding_forward(ptr<S>(out_TD), ids_T.data(), ptr<S>(weight_VlD), T, V, vocab_begin, Vl, D);
  });
}

void embedding_backward(Tensor& dweight_VlD, const Tensor& dout_TD, const std::span<const int32_t> ids_T,
                        const int64_t vocab_begin) {
  constexpr const char* op = "embedding_backward";
  const detail::Staging staging;
  detail::check_tensors(op, {&dweight_VlD, &dout_TD});
  const int64_t T = tokens(ids_T), Vl = dweight_VlD.dim(0), D = dweight_VlD.numel() / Vl;
  detail::check_numel(op, "dout_TD", dout_TD, T * D);
  detail::dispatch(op, dout_TD, [&]<typename S>(auto k) {
    k.vocab_embedding_backward(ptr<S>(dweight_VlD), ptr<S>(dout_TD), ids_T.data(), T, vocab_begin, Vl, D);
  });
}

void cross_entropy_forward(Tensor& losses_T, Tensor& lse_T, const Tensor& logits_TV,
                           const std::span<const int32_t> targets_T) {
  constexpr const char* op = "cross_entropy_forward";
  const detail::Staging staging;
  detail::check_tensors(op, {&losses_T, &lse_T, &logits_TV});
  const int64_t T = tokens(targets_T), V = T == 0 ? 0 : logits_TV.numel() / T;
  detail::check_numel(op, "logits_TV", logits_TV, T * V);
  detail::check_numel(op, "losses_T", losses_T, T);
  detail::check_numel(op, "lse_T", lse_T, T);
  detail::dispatch(op, logits_TV, [&]<typename S>(auto k) {
    k.cross_entropy_forward(ptr<S>(losses_T), ptr<S>(lse_T), ptr<S>(logits_TV), targets_T.data(), T, V);
  });
}

void cross_entropy_backward(Tensor& dlogits_TV, const Tensor& dlosses_T, const Tensor& logits_TV, const Tensor& lse_T,
                            const std::span<const int32_t> targets_T) {
  constexpr const char* op = "cross_entropy_backward";
  const detail::Staging staging;
  detail::check_tensors(op, {&dlogits_TV, &dlosses_T, &logits_TV, &lse_T});
  const int64_t T = tokens(targets_T), V = T == 0 ? 0 : logits_TV.numel() / T;
  detail::check_numel(op, "logits_TV", logits_TV, T * V);
  detail::check_numel(op, "dlogits_TV", dlogits_TV, T * V);
  detail::check_numel(op, "dlosses_T", dlosses_T, T);
  detail::check_numel(op, "lse_T", lse_T, T);
  detail::dispatch(op, logits_TV, [&]<typename S>(auto k) {
    k.cross_entropy_backward(ptr<S>(dlogits_TV), ptr<S>(dlosses_T), ptr<S>(logits_TV), ptr<S>(lse_T), targets_T.data(),
                             T, V);
  });
  detail::round_activations({&dlogits_TV});
}

void vocab_ce_local_max(Tensor& max_T, const Tensor& logits_TVl) {
  constexpr const char* op = "vocab_ce_local_max";
  const detail::Staging staging;
  detail::check_tensors(op, {&max_T, &logits_TVl});
  const int64_t T = max_T.numel(), Vl = T == 0 ? 0 : logits_TVl.numel() / T;
  detail::check_numel(op, "logits_TVl", logits_TVl, T * Vl);
  detail::dispatch(op, logits_TVl,
                   [&]<typename S>(auto k) { k.vocab_ce_local_max(ptr<S>(max_T), ptr<S>(logits_TVl), T, Vl); });
}

void vocab_ce_local_stats(Tensor& stats_2T, const Tensor& logits_TVl, const Tensor& max_T,
                          const std::span<const int32_t> targets_T, const int64_t V, const int64_t vocab_begin) {
  constexpr const char* op = "vocab_ce_local_stats";
  const detail::Staging staging;
  detail::check_tensors(op, {&stats_2T, &logits_TVl, &max_T});
  const int64_t T = tokens(targets_T), Vl = T == 0 ? 0 : logits_TVl.numel() / T;
  detail::check_numel(op, "logits_TVl", logits_TVl, T * Vl);
  detail::check_numel(op, "max_T", max_T, T);
  detail::check_numel(op, "stats_2T", stats_2T, 2 * T);
  detail::dispatch(op, logits_TVl, [&]<typename S>(auto k) {
    k.vocab_ce_local_stats(ptr<S>(stats_2T), ptr<S>(logits_TVl), ptr<S>(max_T), targets_T.data(), T, V, vocab_begin,
                           Vl);
  });
}

void vocab_ce_finish(Tensor& losses_T, Tensor& lse_T, const Tensor& max_T, const Tensor& stats_2T) {
  constexpr const char* op = "vocab_ce_finish";
  const detail::Staging staging;
  detail::check_tensors(op, {&losses_T, &lse_T, &max_T, &stats_2T});
  const int64_t T = max_T.numel();
  detail::check_numel(op, "losses_T", losses_T, T);
  detail::check_numel(op, "lse_T", lse_T, T);
  detail::check_numel(op, "stats_2T", stats_2T, 2 * T);
  detail::dispatch(op, max_T, [&]<typename S>(auto k) {
    k.vocab_ce_finish(ptr<S>(losses_T), ptr<S>(lse_T), ptr<S>(max_T), ptr<S>(stats_2T), T);
  });
}

void vocab_ce_backward(Tensor& dlogits_TVl, const Tensor& dlosses_T, const Tensor& logits_TVl, const Tensor& lse_T,
                       const std::span<const int32_t> targets_T, const int64_t vocab_begin) {
  constexpr const char* op = "vocab_ce_backward";
  const detail::Staging staging;
  detail::check_tensors(op, {&dlogits_TVl, &dlosses_T, &logits_TVl, &lse_T});
  const int64_t T = tokens(targets_T), Vl = T == 0 ? 0 : logits_TVl.numel() / T;
  detail::check_numel(op, "logits_TVl", logits_TVl, T * Vl);
  detail::check_numel(op, "dlogits_TVl", dlogits_TVl, T * Vl);
  detail::check_numel(op, "dlosses_T", dlosses_T, T);
  detail::check_numel(op, "lse_T", lse_T, T);
  detail::dispatch(op, logits_TVl, [&]<typename S>(auto k) {
    k.vocab_ce_backward(ptr<S>(dlogits_TVl), ptr<S>(dlosses_T), ptr<S>(logits_TVl), ptr<S>(lse_T), targets_T.data(), T,
                        vocab_begin, Vl);
  });
  detail::round_activations({&dlogits_TVl});
}

}  // namespace moecore::ops
