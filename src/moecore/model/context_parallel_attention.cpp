#include "moecore/model/context_parallel_attention.h"

#include <initializer_list>
#include <span>
#include <utility>
#include <vector>

#include "moecore/model/config.h"
#include "moecore/ops/convert.h"
#include "moecore/ops/elementwise.h"
#include "moecore/ops/precision.h"
#include "moecore/ops/rows.h"
#include "moecore/parallel/comm_stats.h"

namespace moecore {
namespace {

constexpr int kKeyValueTag = 11;
constexpr int kKeyValueGradTag = 12;

Tensor activations(std::vector<int64_t> shape) {
  return Tensor(std::move(shape), DType::kF32, MemCategory::kActivations);
}

// Rows that travel exactly (all-to-all, all-gather): in the dtype of the rows they come from (bf16 / fp16 under
// 16-bit activation storage, ops/precision.h).
Tensor activations(std::vector<int64_t> shape, const DType dtype) {
  return Tensor(std::move(shape), dtype, MemCategory::kActivations);
}

// An output that spans several kernel calls, kept in fp32 while they run (16-bit activation storage): the fp32 path's
// arithmetic, narrowed once by finish() after round_once (exact then).
class Fp32Output {
 public:
  explicit Fp32Output(Tensor& target) : target_(target), f32_(target) {
    if (target.dtype() != DType::kF32) {
      f32_ = activations(target.shape());
      ops::convert(f32_, target);
    }
  }
  Tensor& get() { return f32_; }
  void finish() {
    if (!f32_.shares_storage(target_)) ops::convert(target_, f32_);
  }

 private:
  Tensor& target_;
  Tensor f32_;
};

// Attention that spans several kernel calls (the ring's steps, a reduce-scatter of partial key / value gradients)
// keeps its partial results in fp32 and rounds them to the activation dtype once, as TransformerEngine's
// AttnFuncWithCPAndKVP2P corrects each step's output in fp32 and casts once: the ops inside run under an fp32
// scope, and round_once applies the caller's dtype to what the attention hands back (an op would round it so).
void round_once(const DType activation_dtype, std::initializer_list<Tensor*> tensors) {
  for (Tensor* t : tensors) {
    if (t->dtype() == DType::kF32) ops::round_to_dtype_(*t, activation_dtype);
  }
}

// The block fields of dims for queries at q_index against keys at k_index (documents when packed).
struct Block {
  std::vector<int64_t> q_index, k_index;
  std::vector<int32_t> q_documents, k_documents;
  ops::AttentionDims apply_to(ops::AttentionDims dims, const int64_t S_whole) const {
    if (!q_index.empty()) dims.S = static_cast<int64_t>(q_index.size());
    if (!k_index.empty()) dims.Sk = static_cast<int64_t>(k_index.size());
    dims.q_index = q_index.empty() ? nullptr : q_index.data();
    dims.k_index = k_index.empty() ? nullptr : k_index.data();
    dims.q_document_SB = q_documents.empty() ? nullptr : q_documents.data();
    dims.k_document_SB = k_documents.empty() ? nullptr : k_documents.data();
    dims.dropout_seq_len = S_whole;
    return dims;
  }
};

// One whole local sequence without context parallelism: no indices (the kernels' plain causal path).
Block whole(const SequenceInfo& seq) {
  Block out;
  if (!seq.packed()) return out;
  out.q_documents = seq.documents_of(seq.local_index());
  out.k_documents = out.q_documents;
  return out;
}

Block block(const SequenceInfo& seq, std::vector<int64_t> q_index, std::vector<int64_t> k_index) {
  Block out;
  out.q_documents = seq.documents_of(q_index);
  out.k_documents = seq.documents_of(k_index);
  out.q_index = std::move(q_index);
  out.k_index = std::move(k_index);
  return out;
}

std::vector<int64_t> all_indices(const SequenceInfo& seq) {  // every rank's positions, in rank order
  std::vector<int64_t> index;
  for (int r = 0; r < seq.cp_size; ++r) {
    const std::vector<int64_t> part = seq.index_of_rank(r);
    index.insert(index.end(), part.begin(), part.end());
  }
  return index;
}

// ---- a2a: [T_l, X, d] (all X heads of this rank's rows, T_l = S_l B) <-> [CP T_l, X / CP, d] (this rank's head
// group for every rank's rows, in rank order).
Tensor sequence_to_heads(const Tensor& x, const int64_t X, const int64_t d, const parallel::ProcessGroup& cp) {
  const int P = cp.size();
  const int64_t rows = x.numel() / (X * d), Xp = X / P, part = rows * Xp * d;
  Tensor send = activations({P * part}, x.dtype());
  const Tensor x_rows = x.view({rows, X * d});
  for (int j = 0; j < P; ++j) {  // head group j of every row: block j of the send buffer
    Tensor block = send.view({P * rows, Xp * d}).slice_rows(j * rows, (j + 1) * rows);
    ops::copy_columns(block, Xp * d, 0, x_rows, X * d, j * Xp * d, Xp * d);
  }
  Tensor out = activations({P * rows, Xp, d}, x.dtype());
  const std::vector<size_t> counts(static_cast<size_t>(P), static_cast<size_t>(part));
  const parallel::CommTimer timer(parallel::CommKind::kContextParallel);
  cp.all_to_all_v(send, counts, out, counts);
  return out;
}

Tensor heads_to_sequence(const Tensor& x_h, const int64_t X, const int64_t d, const parallel::ProcessGroup& cp) {
  const int P = cp.size();
  const int64_t Xp = X / P, part = x_h.numel() / P, rows = part / (Xp * d);
  Tensor received = activations({P * part}, x_h.dtype());
  const std::vector<size_t> counts(static_cast<size_t>(P), static_cast<size_t>(part));
  {
    const parallel::CommTimer timer(parallel::CommKind::kContextParallel);
    cp.all_to_all_v(x_h, counts, received, counts);
  }
  Tensor out = activations({rows, X, d}, x_h.dtype());
  Tensor out_rows = out.view({rows, X * d});
  for (int j = 0; j < P; ++j) {  // block j of the received buffer: head group j of every row
    const Tensor block = received.view({P * rows, Xp * d}).slice_rows(j * rows, (j + 1) * rows);
    ops::copy_columns(out_rows, X * d, j * Xp * d, block, Xp * d, 0, Xp * d);
  }
  return out;
}

int64_t value_dim(const ops::AttentionDims& dims) { return dims.v_head_dim > 0 ? dims.v_head_dim : dims.head_dim; }

ops::AttentionDims head_shard_dims(ops::AttentionDims dims, const parallel::ProcessGroup& cp) {
  const int64_t N = dims.N;
  dims.N /= cp.size();
  dims.G /= cp.size();
  if (dims.dropout_total_heads == 0) dims.dropout_total_heads = N;
  dims.dropout_head_offset += cp.rank() * dims.N;
  return dims;
}

// ---- all_gather
Tensor gather_sequence(const Tensor& x, const parallel::ProcessGroup& cp) {
  std::vector<int64_t> shape = x.shape();
  shape[0] *= cp.size();
  Tensor out = activations(shape, x.dtype());
  const parallel::CommTimer timer(parallel::CommKind::kContextParallel);
  cp.all_gather(x, out);
  return out;
}

void reduce_scatter_add(Tensor& local, const Tensor& all, const parallel::ProcessGroup& cp) {
  Tensor mine = activations(local.shape());
  {
    const parallel::CommTimer timer(parallel::CommKind::kContextParallel);
    cp.reduce_scatter(all, mine, parallel::ReduceOp::kSum);
  }
  ops::add_(local, mine);
}

// ---- p2p: the ring. Step i holds the keys and values of rank (r - i) mod CP.
int ring_source(const parallel::ProcessGroup& cp, const int step) { return (cp.rank() - step + cp.size()) % cp.size(); }

// Sends `tensors` to the next rank and receives the same shapes and dtypes from the previous one into fresh tensors.
struct RingTransfer {
  std::vector<Tensor> incoming;
  std::vector<parallel::Work> works;
  void start(const std::vector<const Tensor*>& outgoing, const parallel::ProcessGroup& cp, const int tag) {
    const int next = (cp.rank() + 1) % cp.size(), prev = (cp.rank() - 1 + cp.size()) % cp.size();
    for (const Tensor* t : outgoing) {
      incoming.push_back(activations(t->shape(), t->dtype()));
      works.push_back(cp.recv_async(incoming.back(), prev, tag));
    }
    for (const Tensor* t : outgoing) works.push_back(cp.send_async(*t, next, tag));
  }
  std::vector<Tensor> finish() {
    const parallel::CommTimer timer(parallel::CommKind::kContextParallel);
    for (parallel::Work& w : works) w.wait();
    works.clear();
    return std::move(incoming);
  }
};

}  // namespace

CpCommType parse_cp_comm_type(const std::string& name) {
  if (name == "p2p") return CpCommType::kP2P;
  if (name == "all_gather") return CpCommType::kAllGather;
  if (name == "a2a") return CpCommType::kA2A;
  if (name == "a2a+p2p") {
    throw ConfigError("--cp-comm-type a2a+p2p is not implemented yet (moecore implements p2p, all_gather, a2a)");
  }
  throw ConfigError("invalid value '" + name + "' for --cp-comm-type (choose from p2p, all_gather, a2a, a2a+p2p)");
}

const char* cp_comm_type_name(const CpCommType type) {
  switch (type) {
    case CpCommType::kP2P: return "p2p";
    case CpCommType::kAllGather: return "all_gather";
    case CpCommType::kA2A: return "a2a";
  }
  return "?";
}

namespace {

void cp_attention_forward(Tensor& out_SBNd, Tensor& lse_BNS, const Tensor& q_SBNd, const Tensor& k_SBGd,
                          const Tensor& v_SBGd, ops::AttentionDims dims, const ops::DropoutSpec& dropout,
                          const SequenceInfo& seq, const parallel::ProcessGroup& cp, const CpCommType type) {
  const std::vector<int64_t> local = seq.local_index();
  if (type == CpCommType::kAllGather) {
    const Block b = block(seq, local, all_indices(seq));
    const Tensor k_all = gather_sequence(k_SBGd, cp), v_all = gather_sequence(v_SBGd, cp);
    ops::attention_forward(out_SBNd, lse_BNS, q_SBNd, k_all, v_all, b.apply_to(dims, seq.S), dropout);
    return;
  }
  if (type == CpCommType::kA2A) {
    const int64_t N = dims.N, G = dims.G, d = dims.head_dim, dv = value_dim(dims), B = seq.B;
    const Tensor q_h = sequence_to_heads(q_SBNd, N, d, cp), k_h = sequence_to_heads(k_SBGd, G, d, cp),
                 v_h = sequence_to_heads(v_SBGd, G, dv, cp);
    const std::vector<int64_t> index = all_indices(seq);
    const Block b = block(seq, index, index);
    const ops::AttentionDims hd = b.apply_to(head_shard_dims(dims, cp), seq.S);
    Tensor out_h = activations({q_h.shape()[0], N / cp.size(), dv});
    Tensor lse_h = lse_BNS.view({B, N / cp.size(), seq.S});
    ops::attention_forward(out_h, lse_h, q_h, k_h, v_h, hd, dropout);
    out_SBNd.copy_from(heads_to_sequence(out_h, N, dv, cp));
    return;
  }
  // p2p ring: step 0 is this rank's own block; each later step's keys arrive while the previous block computes.
  // The running (out, lse) stays fp32 across the steps; out is rounded once after the last merge.
  const DType activation_dtype = ops::activation_dtype();
  const int P = cp.size();
  Tensor k_cur = k_SBGd, v_cur = v_SBGd;
  const ops::ScopedActivationDType fp32_ring(DType::kF32);
  for (int step = 0; step < P; ++step) {
    RingTransfer transfer;
    if (step + 1 < P) transfer.start({&k_cur, &v_cur}, cp, kKeyValueTag);
    const Block b = block(seq, local, seq.index_of_rank(ring_source(cp, step)));
    if (step == 0) {
      ops::attention_forward(out_SBNd, lse_BNS, q_SBNd, k_cur, v_cur, b.apply_to(dims, seq.S), dropout);
    } else {
      Tensor part_out = activations(out_SBNd.shape()), part_lse = activations(lse_BNS.shape());
      ops::attention_forward(part_out, part_lse, q_SBNd, k_cur, v_cur, b.apply_to(dims, seq.S), dropout);
      ops::attention_merge(out_SBNd, lse_BNS, part_out, part_lse, b.apply_to(dims, seq.S));
    }
    if (step + 1 < P) {
      std::vector<Tensor> next = transfer.finish();
      k_cur = std::move(next[0]);
      v_cur = std::move(next[1]);
    }
  }
  round_once(activation_dtype, {&out_SBNd});
}

void cp_attention_backward(Tensor& dq_SBNd, Tensor& dk_SBGd, Tensor& dv_SBGd, const Tensor& dout_SBNd,
                           const Tensor& q_SBNd, const Tensor& k_SBGd, const Tensor& v_SBGd, const Tensor& out_SBNd,
                           const Tensor& lse_BNS, ops::AttentionDims dims, const ops::DropoutSpec& dropout,
                           const SequenceInfo& seq, const parallel::ProcessGroup& cp, const CpCommType type) {
  const std::vector<int64_t> local = seq.local_index();
  if (type == CpCommType::kAllGather) {
    // Every rank's share of the key / value gradients is summed in fp32 and rounded once.
    const Block b = block(seq, local, all_indices(seq));
    const Tensor k_all = gather_sequence(k_SBGd, cp), v_all = gather_sequence(v_SBGd, cp);
    Tensor dk_all = activations(k_all.shape()), dv_all = activations(v_all.shape());
    const DType activation_dtype = ops::activation_dtype();
    const ops::ScopedActivationDType fp32_shares(DType::kF32);
    ops::attention_backward(dq_SBNd, dk_all, dv_all, dout_SBNd, q_SBNd, k_all, v_all, out_SBNd, lse_BNS,
                            b.apply_to(dims, seq.S), dropout);
    reduce_scatter_add(dk_SBGd, dk_all, cp);
    reduce_scatter_add(dv_SBGd, dv_all, cp);
    round_once(activation_dtype, {&dq_SBNd, &dk_SBGd, &dv_SBGd});
    return;
  }
  if (type == CpCommType::kA2A) {
    const int64_t N = dims.N, G = dims.G, d = dims.head_dim, dv = value_dim(dims), B = seq.B;
    const Tensor q_h = sequence_to_heads(q_SBNd, N, d, cp), k_h = sequence_to_heads(k_SBGd, G, d, cp),
                 v_h = sequence_to_heads(v_SBGd, G, dv, cp), out_h = sequence_to_heads(out_SBNd, N, dv, cp),
                 dout_h = sequence_to_heads(dout_SBNd, N, dv, cp);
    const std::vector<int64_t> index = all_indices(seq);
    const Block b = block(seq, index, index);
    const ops::AttentionDims hd = b.apply_to(head_shard_dims(dims, cp), seq.S);
    Tensor dq_h = activations(q_h.shape()), dk_h = activations(k_h.shape()), dv_h = activations(v_h.shape());
    const Tensor lse_h = lse_BNS.view({B, N / cp.size(), seq.S});
    // The head-shard gradients stay fp32 until they are added to the caller's: one rounding.
    const DType activation_dtype = ops::activation_dtype();
    const ops::ScopedActivationDType fp32_shards(DType::kF32);
    ops::attention_backward(dq_h, dk_h, dv_h, dout_h, q_h, k_h, v_h, out_h, lse_h, hd, dropout);
    ops::add_(dq_SBNd, heads_to_sequence(dq_h, N, d, cp));
    ops::add_(dk_SBGd, heads_to_sequence(dk_h, G, d, cp));
    ops::add_(dv_SBGd, heads_to_sequence(dv_h, G, dv, cp));
    round_once(activation_dtype, {&dq_SBNd, &dk_SBGd, &dv_SBGd});
    return;
  }
  // p2p ring: keys, values and their gradient buffers travel together (each at its own shape: values and their
  // gradients may be narrower than keys, dims.v_head_dim); after CP steps the buffers of every block
  // have collected each rank's share, and one last transfer brings them home. dq and the travelling dk, dv buffers
  // accumulate in fp32 across the steps and are rounded once at the end.
  const DType activation_dtype = ops::activation_dtype();
  const ops::ScopedActivationDType fp32_ring(DType::kF32);
  const int P = cp.size();
  Tensor k_cur = k_SBGd, v_cur = v_SBGd;
  Tensor dk_cur = activations(k_SBGd.shape()), dv_cur = activations(v_SBGd.shape());
  for (int step = 0; step < P; ++step) {
    const Block b = block(seq, local, seq.index_of_rank(ring_source(cp, step)));
    ops::attention_backward(dq_SBNd, dk_cur, dv_cur, dout_SBNd, q_SBNd, k_cur, v_cur, out_SBNd, lse_BNS,
                            b.apply_to(dims, seq.S), dropout);
    RingTransfer transfer;
    if (step + 1 < P) {
      transfer.start({&k_cur, &v_cur, &dk_cur, &dv_cur}, cp, kKeyValueGradTag);
      std::vector<Tensor> next = transfer.finish();
      k_cur = std::move(next[0]);
      v_cur = std::move(next[1]);
      dk_cur = std::move(next[2]);
      dv_cur = std::move(next[3]);
    } else {
      transfer.start({&dk_cur, &dv_cur}, cp, kKeyValueGradTag);
      std::vector<Tensor> home = transfer.finish();
      ops::add_(dk_SBGd, home[0]);
      ops::add_(dv_SBGd, home[1]);
    }
  }
  round_once(activation_dtype, {&dq_SBNd, &dk_SBGd, &dv_SBGd});
}

}  // namespace

void context_parallel_attention_forward(Tensor& out_SBNd, Tensor& lse_BNS, const Tensor& q_SBNd, const Tensor& k_SBGd,
                                        const Tensor& v_SBGd, ops::AttentionDims dims, const ops::DropoutSpec& dropout,
                                        const SequenceInfo& seq, const parallel::ProcessGroup& layer_cp,
                                        const CpCommType type) {
  const parallel::ProcessGroup& cp = seq.cp_group != nullptr ? *seq.cp_group : layer_cp;
  if (cp.size() == 1) {
    ops::attention_forward(out_SBNd, lse_BNS, q_SBNd, k_SBGd, v_SBGd, whole(seq).apply_to(dims, seq.S), dropout);
    return;
  }
  Fp32Output out(out_SBNd);
  cp_attention_forward(out.get(), lse_BNS, q_SBNd, k_SBGd, v_SBGd, dims, dropout, seq, cp, type);
  out.finish();
}

void context_parallel_attention_backward(Tensor& dq_SBNd, Tensor& dk_SBGd, Tensor& dv_SBGd, const Tensor& dout_SBNd,
                                         const Tensor& q_SBNd, const Tensor& k_SBGd, const Tensor& v_SBGd,
                                         const Tensor& out_SBNd, const Tensor& lse_BNS, ops::AttentionDims dims,
                                         const ops::DropoutSpec& dropout, const SequenceInfo& seq,
                                         const parallel::ProcessGroup& layer_cp, const CpCommType type) {
  const parallel::ProcessGroup& cp = seq.cp_group != nullptr ? *seq.cp_group : layer_cp;
  if (cp.size() == 1) {
    ops::attention_backward(dq_SBNd, dk_SBGd, dv_SBGd, dout_SBNd, q_SBNd, k_SBGd, v_SBGd, out_SBNd, lse_BNS,
                            whole(seq).apply_to(dims, seq.S), dropout);
    return;
  }
  Fp32Output dq(dq_SBNd), dk(dk_SBGd), dv(dv_SBGd);
  cp_attention_backward(dq.get(), dk.get(), dv.get(), dout_SBNd, q_SBNd, k_SBGd, v_SBGd, out_SBNd, lse_BNS, dims,
                        dropout, seq, cp, type);
  dq.finish();
  dk.finish();
  dv.finish();
}

}  // namespace moecore
