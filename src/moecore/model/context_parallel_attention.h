// Core attention (after q/k norms and RoPE, before the output projection) over one micro-batch whose sequence is
// split over the context-parallel group (Megatron's --cp-comm-type, TransformerEngine's context_parallel.py):
//   p2p        ring attention: the key/value chunks travel around the CP ring (non-blocking send / recv posted before
//              the block at hand is computed); each step's partial output merges through its log-sum-exp; backward
//              sends the keys and values around again with their gradient buffers, which end at their owner.
//   all_gather keys and values all-gathered, the local queries computed at once; key / value gradients
//              reduce-scattered back.
//   a2a        Ulysses: all-to-all from sequence shards to head shards (every rank sees the whole sequence for
//              N / CP query heads and G / CP key/value groups), whole-sequence attention, all-to-all back.
// The causal mask, the documents of packed sequences and the dropout counters all use each row's index in the
// whole sequence (SequenceInfo), so every layout computes the one-process attention and draws its dropout mask.
// With one CP rank all three are the plain attention over the local sequence. Under a 16-bit activation dtype
// (ops/precision.h) the partial results stay fp32 across the kernel calls (the ring's running output, its dq / dk / dv
// accumulators, gradients before a reduce-scatter or all-to-all) and what is returned is rounded once, as
// TransformerEngine's ring attention casts once: the fp32 result rounded to 16 bits.
#pragma once

#include <cstdint>
#include <string>

#include "moecore/model/sequence_info.h"
#include "moecore/ops/attention.h"
#include "moecore/parallel/process_group.h"
#include "moecore/tensor/tensor.h"

namespace moecore {

enum class CpCommType : uint8_t { kP2P, kAllGather, kA2A };

// Megatron's names: "p2p", "all_gather", "a2a" (throws ConfigError on anything else).
CpCommType parse_cp_comm_type(const std::string& name);
const char* cp_comm_type_name(CpCommType type);

// q_SBNd [S/CP, B, N, d], k_SBGd [S/CP, B, G, d], v_SBGd [S/CP, B, G, dv] this rank's rows; dims gives N, G,
// head_dim (d), v_head_dim (dv, 0: d), scale and the tensor-parallel dropout heads (its S, B and block fields are set
// here). out_SBNd [S/CP, B, N, dv], lse_BNS [B, N, S/CP] are
// overwritten (under a2a lse holds the head-shard layout [B, N/CP, S] that backward reads back). Collective over cp.
void context_parallel_attention_forward(Tensor& out_SBNd, Tensor& lse_BNS, const Tensor& q_SBNd, const Tensor& k_SBGd,
                                        const Tensor& v_SBGd, ops::AttentionDims dims, const ops::DropoutSpec& dropout,
                                        const SequenceInfo& sequence, const parallel::ProcessGroup& cp,
                                        CpCommType type);
// dq, dk, dv accumulate.
void context_parallel_attention_backward(Tensor& dq_SBNd, Tensor& dk_SBGd, Tensor& dv_SBGd, const Tensor& dout_SBNd,
                                         const Tensor& q_SBNd, const Tensor& k_SBGd, const Tensor& v_SBGd,
                                         const Tensor& out_SBNd, const Tensor& lse_BNS, ops::AttentionDims dims,
                                         const ops::DropoutSpec& dropout, const SequenceInfo& sequence,
                                         const parallel::ProcessGroup& cp, CpCommType type);

}  // namespace moecore
