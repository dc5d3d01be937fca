#include "moecore/kernels/cpu/onednn_matmul.h"

#include <omp.h>

#include <cstddef>
#include <dnnl.hpp>
#include <map>
#include <memory>
#include <mutex>
#include <stdexcept>
#include <tuple>
#include <unordered_map>
#include <vector>

namespace moecore::kernels::cpu {

int onednn_matmul_threads() { return omp_in_parallel() ? 1 : omp_get_max_threads(); }

#if DNNL_VERSION_MAJOR == 2
namespace {

auto tied(const MatmulShape& s) {
  return std::tie(s.input, s.low_dst, s.trans_a, s.trans_b, s.bias, s.M, s.N, s.K, s.lda, s.ldb, s.ldc, s.alpha, s.beta,
                  s.threads);
}
struct ShapeLess {
  bool operator()(const MatmulShape& a, const MatmulShape& b) const { return tied(a) < tied(b); }
};

struct Compiled {
  dnnl::matmul::primitive_desc pd;
  dnnl::matmul primitive;
};

const dnnl::engine& cpu_engine() {
  static const dnnl::engine engine(dnnl::engine::kind::cpu, 0);
  return engine;
}

dnnl::memory::data_type onednn_type(const MatmulInput input) {
  switch (input) {
    case MatmulInput::kBF16: return dnnl::memory::data_type::bf16;
    case MatmulInput::kF16: return dnnl::memory::data_type::f16;
    case MatmulInput::kF32: break;
  }
  return dnnl::memory::data_type::f32;
}

// Throws dnnl::error when oneDNN has no implementation.
dnnl::matmul::primitive_desc make_pd(const MatmulShape& s) {
  using dims = dnnl::memory::dims;
  const auto in = onednn_type(s.input);
  const dnnl::memory::desc a_md(dims{s.M, s.K}, in, s.trans_a ? dims{1, s.lda} : dims{s.lda, 1});
  const dnnl::memory::desc b_md(dims{s.K, s.N}, in, s.trans_b ? dims{1, s.ldb} : dims{s.ldb, 1});
  const dnnl::memory::desc c_md(dims{s.M, s.N}, s.low_dst ? in : dnnl::memory::data_type::f32, dims{s.ldc, 1});
  dnnl::primitive_attr attr;
  attr.set_scratchpad_mode(dnnl::scratchpad_mode::user);  // per-thread scratchpads: safe to run concurrently
  dnnl::post_ops post_ops;
  if (s.alpha != 1.0f) post_ops.append_eltwise(1.0f, dnnl::algorithm::eltwise_linear, s.alpha, 0.0f);
  if (s.beta != 0.0f) post_ops.append_sum(s.beta);
  attr.set_post_ops(post_ops);
  if (s.bias) {
    const dnnl::memory::desc bias_md(dims{1, s.N}, dnnl::memory::data_type::f32, dims{s.N, 1});
    return {dnnl::matmul::desc(a_md, b_md, bias_md, c_md), attr, cpu_engine()};
  }
  return {dnnl::matmul::desc(a_md, b_md, c_md), attr, cpu_engine()};
}

// Compiled primitives by shape (as dnnl_sgemm caches its own). Expert GEMMs see a new row count most steps, so the
// cache is emptied when it grows past a bound.
std::shared_ptr<const Compiled> compiled(const MatmulShape& shape) {
  static std::mutex mutex;
  static std::map<MatmulShape, std::shared_ptr<const Compiled>, ShapeLess> cache;
  constexpr size_t kMaxEntries = 1024;
  {
    const std::lock_guard lock(mutex);
    const auto it = cache.find(shape);
    if (it != cache.end()) return it->second;
  }
  auto pd = make_pd(shape);
  auto entry = std::make_shared<const Compiled>(Compiled{pd, dnnl::matmul(pd)});
  const std::lock_guard lock(mutex);
  if (cache.size() >= kMaxEntries) cache.clear();
  cache.emplace(shape, entry);
  return entry;
}

// A primitive's arguments on one thread: memory objects made once, pointed at each call's operands (set_data_handle),
// and the thread's scratchpad. Making them per call cost 2-3 us, as much as the GEMM of a 16-row expert tile.
struct Bound {
  std::shared_ptr<const Compiled> gemm;  // keeps the descriptors alive while the global cache may drop them
  std::unordered_map<int, dnnl::memory> args;
};

Bound& bound_on_this_thread(const std::shared_ptr<const Compiled>& gemm) {
  constexpr size_t kMaxBound = 256;
  thread_local std::unordered_map<const Compiled*, Bound> bound;
  thread_local std::vector<std::byte> scratch;
  const auto it = bound.find(gemm.get());
  if (it != bound.end() && it->second.gemm == gemm) return it->second;
  const size_t scratch_bytes = gemm->pd.scratchpad_desc().get_size();
  if (scratch.size() < scratch_bytes) {
    scratch.resize(scratch_bytes);
    bound.clear();  // their scratchpad memory objects point at the old buffer
  }
  if (bound.size() >= kMaxBound) bound.clear();
  const dnnl::engine& engine = cpu_engine();
  Bound entry{gemm,
              {{DNNL_ARG_SRC, dnnl::memory(gemm->pd.src_desc(), engine, nullptr)},
               {DNNL_ARG_WEIGHTS, dnnl::memory(gemm->pd.weights_desc(), engine, nullptr)},
               {DNNL_ARG_DST, dnnl::memory(gemm->pd.dst_desc(), engine, nullptr)},
               {DNNL_ARG_SCRATCHPAD, dnnl::memory(gemm->pd.scratchpad_desc(), engine, scratch.data())}}};
  if (gemm->pd.bias_desc().get_size() > 0) {
    entry.args.emplace(DNNL_ARG_BIAS, dnnl::memory(gemm->pd.bias_desc(), engine, nullptr));
  }
  return bound.insert_or_assign(gemm.get(), std::move(entry)).first->second;
}

std::string type_name(const MatmulInput input) {
  switch (input) {
    case MatmulInput::kBF16: return "bf16";
    case MatmulInput::kF16: return "fp16";
    case MatmulInput::kF32: break;
  }
  return "fp32";
}

}  // namespace

bool onednn_matmul_built() { return true; }

std::string onednn_matmul_impl(const MatmulShape& shape) {
  try {
    return make_pd(shape).impl_info_str();
  } catch (const dnnl::error&) {
    return "";
  }
}

void onednn_matmul(const char* caller, const MatmulShape& shape, const void* A, const void* B, void* C,
                   const float* bias_N) {
  std::shared_ptr<const Compiled> gemm;
  try {
    gemm = compiled(shape);
  } catch (const dnnl::error& error) {
    throw std::runtime_error(std::string(caller) + ": oneDNN has no " + type_name(shape.input) +
                             " matmul for M=" + std::to_string(shape.M) + " N=" + std::to_string(shape.N) +
                             " K=" + std::to_string(shape.K) + " (" + error.what() + ")");
  }
  Bound& bound = bound_on_this_thread(gemm);
  bound.args.at(DNNL_ARG_SRC).set_data_handle(const_cast<void*>(A));
  bound.args.at(DNNL_ARG_WEIGHTS).set_data_handle(const_cast<void*>(B));
  bound.args.at(DNNL_ARG_DST).set_data_handle(C);
  if (shape.bias) bound.args.at(DNNL_ARG_BIAS).set_data_handle(const_cast<float*>(bias_N));
  thread_local dnnl::stream stream(cpu_engine());
  gemm->primitive.execute(stream, bound.args);
  stream.wait();
}
#else
bool onednn_matmul_built() { return false; }
std::string onednn_matmul_impl(const MatmulShape&) { return ""; }
void onednn_matmul(const char* caller, const MatmulShape&, const void*, const void*, void*, const float*) {
  throw std::logic_error(std::string(caller) + ": moecore's matmul primitives use the oneDNN 2.x API");
}
#endif

}  // namespace moecore::kernels::cpu
