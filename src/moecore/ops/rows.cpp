#include "moecore/ops/rows.h"

#include "moecore/ops/dispatch.h"
#include "moecore/ops/precision.h"
#include "moecore/ops/row_blocks.h"

namespace moecore::ops {
using detail::opt;
using detail::ptr;
namespace {

// Rows of width W in t; fails when t is not whole rows.
int64_t rows_of(const char* op, const char* name, const Tensor& t, const int64_t W) {
  if (W <= 0 || t.numel() % W != 0) {
    detail::fail(op, std::string(name) + " " + t.shape_str() + " is not rows of width " + std::to_string(W));
  }
  return t.numel() / W;
}

// Tokens of the fused qkv rows [T, (N + 2G) d], checking the split q [T, N, d], k and v [T, G, d].
int64_t qkv_tokens(const char* op, const Tensor& qkv_TQ, const Tensor& q_TNd, const Tensor& k_TGd, const Tensor& v_TGd,
                   const int64_t N, const int64_t G, const int64_t d) {
  if (G <= 0 || N % G != 0) detail::fail(op, "query heads must be a multiple of query groups");
  const int64_t T = rows_of(op, "qkv_TQ", qkv_TQ, (N + 2 * G) * d);
  detail::check_numel(op, "q_TNd", q_TNd, T * N * d);
  detail::check_numel(op, "k_TGd", k_TGd, T * G * d);
  detail::check_numel(op, "v_TGd", v_TGd, T * G * d);
  return T;
}

}  // namespace

void split_qkv(Tensor& q_TNd, Tensor& k_TGd, Tensor& v_TGd, const Tensor& qkv_TQ, const int64_t N, const int64_t G,
               const int64_t d) {
  constexpr const char* op = "split_qkv";
  detail::check_tensors(op, {&q_TNd, &k_TGd, &v_TGd, &qkv_TQ});
  const int64_t T = qkv_tokens(op, qkv_TQ, q_TNd, k_TGd, v_TGd, N, G, d);
  if (detail::same_16bit({&q_TNd, &k_TGd, &v_TGd, &qkv_TQ})) {
    kernels::cpu::split_qkv(q_TNd.data<uint16_t>(), k_TGd.data<uint16_t>(), v_TGd.data<uint16_t>(),
                            qkv_TQ.data<uint16_t>(), T, N, G, d);
    return;
  }
  detail::Staging staging;
  for (Tensor* out : {&q_TNd, &k_TGd, &v_TGd}) staging.write_only(*out, {&qkv_TQ});
  detail::dispatch(op, qkv_TQ, [&]<typename S>(auto k) {
    k.split_qkv(ptr<S>(q_TNd), ptr<S>(k_TGd), ptr<S>(v_TGd), ptr<S>(qkv_TQ), T, N, G, d);
  });
}

void merge_qkv(Tensor& qkv_TQ, const Tensor& q_TNd, const Tensor& k_TGd, const Tensor& v_TGd, const int64_t N,
               const int64_t G, const int64_t d) {
  constexpr const char* op = "merge_qkv";
  detail::check_tensors(op, {&qkv_TQ, &q_TNd, &k_TGd, &v_TGd});
  const int64_t T = qkv_tokens(op, qkv_TQ, q_TNd, k_TGd, v_TGd, N, G, d);
  if (detail::same_16bit({&qkv_TQ, &q_TNd, &k_TGd, &v_TGd})) {
    kernels::cpu::merge_qkv(qkv_TQ.data<uint16_t>(), q_TNd.data<uint16_t>(), k_TGd.data<uint16_t>(),
                            v_TGd.data<uint16_t>(), T, N, G, d);
    return;
  }
  detail::Staging staging;
  staging.write_only(qkv_TQ, {&q_TNd, &k_TGd, &v_TGd});
  detail::dispatch(op, qkv_TQ, [&]<typename S>(auto k) {
    k.merge_qkv(ptr<S>(qkv_TQ), ptr<S>(q_TNd), ptr<S>(k_TGd), ptr<S>(v_TGd), T, N, G, d);
  });
}

void copy_columns(Tensor& dst, const int64_t dst_width, const int64_t dst_col, const Tensor& src,
                  const int64_t src_width, const int64_t src_col, const int64_t width, const bool accumulate) {
  constexpr const char* op = "copy_columns";
  const detail::Staging staging;
  detail::check_tensors(op, {&dst, &src});
  if (width < 0 || dst_col < 0 || src_col < 0 || dst_col + width > dst_width || src_col + width > src_width) {
    detail::fail(op, "columns [" + std::to_string(src_col) + ", +" + std::to_string(width) + ") of rows " +
                         std::to_string(src_width) + " wide into [" + std::to_string(dst_col) + ", +" +
                         std::to_string(width) + ") of rows " + std::to_string(dst_width) + " wide");
  }
  const int64_t R = rows_of(op, "src", src, src_width);
  detail::check_numel(op, "dst", dst, R * dst_width);
  detail::dispatch(op, src, [&]<typename S>(auto k) {
    k.copy_columns(ptr<S>(dst), dst_width, dst_col, ptr<S>(src), src_width, src_col, R, width, accumulate);
  });
  detail::round_activations({&dst});
}

void add_bias_rows(Tensor& y_RW, const Tensor& bias_W) {
  constexpr const char* op = "add_bias_rows";
  const detail::Staging staging;
  detail::check_tensors(op, {&y_RW, &bias_W});
  const int64_t W = bias_W.numel(), R = rows_of(op, "y_RW", y_RW, W);
  detail::dispatch(op, y_RW, [&]<typename S>(auto k) { k.add_bias_rows(ptr<S>(y_RW), ptr<S>(bias_W), R, W); });
  detail::round_activations({&y_RW});
}

void bias_grad_rows(Tensor& dbias_W, const Tensor& dy_RW) {
  constexpr const char* op = "bias_grad_rows";
  const detail::Staging staging;
  detail::check_tensors(op, {&dbias_W, &dy_RW});
  const int64_t W = dbias_W.numel(), R = rows_of(op, "dy_RW", dy_RW, W);
  detail::dispatch(op, dy_RW, [&]<typename S>(auto k) { k.bias_grad_rows(ptr<S>(dbias_W), ptr<S>(dy_RW), R, W); });
}

void scale_rows(Tensor& out_RW, const Tensor& x_RW, const Tensor& s_R) {
  constexpr const char* op = "scale_rows";
  const detail::Staging staging;
  detail::check_tensors(op, {&out_RW, &x_RW, &s_R});
  const int64_t R = s_R.numel(), W = R == 0 ? 0 : x_RW.numel() / R;
  detail::check_numel(op, "x_RW", x_RW, R * W);
  detail::check_numel(op, "out_RW", out_RW, R * W);
  detail::dispatch(op, x_RW,
                   [&]<typename S>(auto k) { k.scale_rows(ptr<S>(out_RW), ptr<S>(x_RW), ptr<S>(s_R), R, W); });
  detail::round_activations({&out_RW});
}

void scale_rows_backward(Tensor* dx_RW, Tensor* ds_R, const Tensor& dout_RW, const Tensor& x_RW, const Tensor& s_R) {
  constexpr const char* op = "scale_rows_backward";
  const detail::Staging staging;
  detail::check_tensors(op, {dx_RW, ds_R, &dout_RW, &x_RW, &s_R});
  const int64_t R = s_R.numel(), W = R == 0 ? 0 : x_RW.numel() / R;
  detail::check_numel(op, "x_RW", x_RW, R * W);
  detail::check_numel(op, "dout_RW", dout_RW, R * W);
  if (dx_RW != nullptr) detail::check_numel(op, "dx_RW", *dx_RW, R * W);
  if (ds_R != nullptr) detail::check_numel(op, "ds_R", *ds_R, R);
  detail::dispatch(op, x_RW, [&]<typename S>(auto k) {
    k.scale_rows_backward(opt<S>(dx_RW), opt<S>(ds_R), ptr<S>(dout_RW), ptr<S>(x_RW), ptr<S>(s_R), R, W);
  });
  detail::round_activations({dx_RW});
}

void add_outer(Tensor& y_RW, const Tensor& s_R, const Tensor& b_W) {
  constexpr const char* op = "add_outer";
  const detail::Staging staging;
  detail::check_tensors(op, {&y_RW, &s_R, &b_W});
  const int64_t R = s_R.numel(), W = b_W.numel();
  detail::check_numel(op, "y_RW", y_RW, R * W);
  detail::dispatch(op, y_RW, [&]<typename S>(auto k) { k.add_outer(ptr<S>(y_RW), ptr<S>(s_R), ptr<S>(b_W), R, W); });
  detail::round_activations({&y_RW});
}

void add_outer_backward(Tensor* ds_R, Tensor* db_W, const Tensor& dy_RW, const Tensor& s_R, const Tensor& b_W) {
  constexpr const char* op = "add_outer_backward";
  const detail::Staging staging;
  detail::check_tensors(op, {ds_R, db_W, &dy_RW, &s_R, &b_W});
  const int64_t R = s_R.numel(), W = b_W.numel();
  detail::check_numel(op, "dy_RW", dy_RW, R * W);
  if (ds_R != nullptr) detail::check_numel(op, "ds_R", *ds_R, R);
  if (db_W != nullptr) detail::check_numel(op, "db_W", *db_W, W);
  detail::dispatch(op, dy_RW, [&]<typename S>(auto k) {
    k.add_outer_backward(opt<S>(ds_R), opt<S>(db_W), ptr<S>(dy_RW), ptr<S>(s_R), ptr<S>(b_W), R, W);
  });
}

void row_dot(Tensor& out_R, const Tensor& x_RW, const Tensor& w_W) {
  constexpr const char* op = "row_dot";
  const detail::Staging staging;
  detail::check_tensors(op, {&out_R, &x_RW, &w_W});
  const int64_t W = w_W.numel(), R = rows_of(op, "x_RW", x_RW, W);
  detail::check_numel(op, "out_R", out_R, R);
  detail::dispatch(op, x_RW, [&]<typename S>(auto k) { k.row_dot(ptr<S>(out_R), ptr<S>(x_RW), ptr<S>(w_W), R, W); });
  detail::round_activations({&out_R});
}

void sigmoid_forward(Tensor& out, const Tensor& x) {
  constexpr const char* op = "sigmoid_forward";
  const detail::Staging staging;
  detail::check_tensors(op, {&out, &x});
  detail::check_numel(op, "out", out, x.numel());
  detail::dispatch(op, x, [&]<typename S>(auto k) { k.sigmoid_forward(ptr<S>(out), ptr<S>(x), x.numel()); });
  detail::round_activations({&out});
}

void sigmoid_backward(Tensor& dx, const Tensor& dout, const Tensor& y) {
  constexpr const char* op = "sigmoid_backward";
  const detail::Staging staging;
  detail::check_tensors(op, {&dx, &dout, &y});
  detail::check_numel(op, "dout", dout, y.numel());
  detail::check_numel(op, "dx", dx, y.numel());
  detail::dispatch(op, y,
                   [&]<typename S>(auto k) { k.sigmoid_backward(ptr<S>(dx), ptr<S>(dout), ptr<S>(y), y.numel()); });
  detail::round_activations({&dx});
}

void gather_rows(Tensor& out_RW, const Tensor& in_NW, const std::span<const int64_t> index_R) {
  constexpr const char* op = "gather_rows";
  const detail::Staging staging;
  detail::check_tensors(op, {&out_RW, &in_NW});
  const auto R = static_cast<int64_t>(index_R.size());
  const int64_t N = in_NW.ndim() == 0 ? 0 : in_NW.dim(0),
                W = N == 0 ? (R == 0 ? 0 : out_RW.numel() / R) : in_NW.numel() / N;
  detail::check_numel(op, "out_RW", out_RW, R * W);
  for (const int64_t n : index_R) {
    if (n >= N) detail::fail(op, "row index " + std::to_string(n) + " out of " + std::to_string(N) + " rows");
  }
  detail::dispatch(op, out_RW,
                   [&]<typename S>(auto k) { k.gather_rows(ptr<S>(out_RW), ptr<S>(in_NW), index_R.data(), R, N, W); });
}

void scatter_add_rows(Tensor& out_NW, const Tensor& in_RW, const std::span<const int64_t> index_R) {
  constexpr const char* op = "scatter_add_rows";
  const detail::Staging staging;
  detail::check_tensors(op, {&out_NW, &in_RW});
  const auto R = static_cast<int64_t>(index_R.size());
  const int64_t N = out_NW.ndim() == 0 ? 0 : out_NW.dim(0), W = N == 0 ? 0 : out_NW.numel() / N;
  detail::check_numel(op, "in_RW", in_RW, R * W);
  for (const int64_t n : index_R) {
    if (n >= N) detail::fail(op, "row index " + std::to_string(n) + " out of " + std::to_string(N) + " rows");
  }
  detail::dispatch(op, out_NW, [&]<typename S>(auto k) {
    k.scatter_add_rows(ptr<S>(out_NW), ptr<S>(in_RW), index_R.data(), R, N, W);
  });
  detail::round_activations({&out_NW});
}

void add_position_embedding(Tensor& x_TH, const Tensor& pos_PH, const int64_t B, const int64_t row_offset) {
  constexpr const char* op = "add_position_embedding";
  const detail::Staging staging;
  detail::check_tensors(op, {&x_TH, &pos_PH});
  const int64_t P = pos_PH.dim(0), H = pos_PH.numel() / P, T = rows_of(op, "x_TH", x_TH, H);
  if (T > 0 && (row_offset + T - 1) / B >= P) detail::fail(op, "positions beyond the " + std::to_string(P) + " rows");
  detail::dispatch(op, x_TH, [&]<typename S>(auto k) {
    k.add_position_embedding(ptr<S>(x_TH), ptr<S>(pos_PH), T, B, H, row_offset);
  });
  detail::round_activations({&x_TH});
}

void position_embedding_backward(Tensor& dpos_PH, const Tensor& dx_TH, const int64_t B, const int64_t row_offset) {
  constexpr const char* op = "position_embedding_backward";
  const detail::Staging staging;
  detail::check_tensors(op, {&dpos_PH, &dx_TH});
  const int64_t P = dpos_PH.dim(0), H = dpos_PH.numel() / P, T = rows_of(op, "dx_TH", dx_TH, H);
  if (T > 0 && (row_offset + T - 1) / B >= P) detail::fail(op, "positions beyond the " + std::to_string(P) + " rows");
  detail::dispatch(op, dx_TH, [&]<typename S>(auto k) {
    k.position_embedding_backward(ptr<S>(dpos_PH), ptr<S>(dx_TH), T, B, H, row_offset);
  });
}

}  // namespace moecore::ops
