// Packed sequences: the per-token position ids, document ids and loss mask of a GPT sample (Megatron's
// gpt_dataset.py: _get_ltor_masks_and_position_ids, called by GPTDataset.__getitem__ on the sample's input tokens,
// text[:-1]), and the cumulative sequence lengths of the THD layout (core/packed_seq_params.py) derived from them.
//
// Megatron builds a dense [1, S, S] attention mask; moecore keeps the same information as one document id per token.
// For every EOD token at input index i (the EOD ends its document and belongs to it):
//   --reset-position-ids    positions restart at 0 at index i + 1 (Megatron: position_ids[i+1:] -= i + 1 - prev),
//                           so position_ids[t] = t - (index of the last EOD before t) - 1, or t without one;
//   --reset-attention-mask  tokens from index i + 1 on form a new document (Megatron: mask[0, i+1:, :i+1] = 0 on the
//                           causal mask), so document_ids[t] = the number of EODs at indices < t; token q attends to
//                           token k iff k <= q and document_ids[k] == document_ids[q] (causal block-diagonal);
//   --eod-mask-loss         loss_mask[i] = 0: the prediction made at the EOD (the next document's first token) is
//                           not trained.
// An EOD at the last index changes no position and starts no document (the next document begins in the next
// sample). Without a flag: positions 0..S-1, every token in document 0, loss mask 1. The flags are independent, as in
// Megatron. (Megatron builds the mask only with create_attention_mask, its default; moecore does not implement
// --no-create-attention-mask-in-dataloader.)
//
// cu_seqlens: [0, end of document 0, end of document 1, ..., S] (int32), Megatron's PackedSeqParams.cu_seqlens_q/kv.
// Megatron emits them only with --dataloader-inter-document-masking, cut where the sample's stored sequences end
// (GPTDataset._query_document_sample_shuffle_indices); with data preprocessed with --append-eod every stored
// sequence ends with EOD and those cuts are exactly the document boundaries above.
#pragma once

#include <cstdint>
#include <span>
#include <vector>

namespace moecore {

struct SampleMaskOptions {
  int32_t eod_id = 0;
  bool reset_position_ids = false;    // --reset-position-ids
  bool reset_attention_mask = false;  // --reset-attention-mask
  bool eod_mask_loss = false;         // --eod-mask-loss
};

// One sample's S input tokens -> its S position ids, document ids and loss-mask values (every span S long;
// DataError otherwise).
void ltor_masks_and_position_ids(std::span<const int32_t> tokens_S, const SampleMaskOptions& options,
                                 std::span<int64_t> position_ids_S, std::span<int32_t> document_ids_S,
                                 std::span<float> loss_mask_S);

// cu_seqlens of one sample from its document ids (one entry per document, plus the leading 0; the last is S).
// document_ids_S must start at 0 and each id be the previous one or one more; DataError otherwise.
std::vector<int32_t> cu_seqlens_from_document_ids(std::span<const int32_t> document_ids_S);

// cu_seqlens of a [B, S] micro-batch flattened into one token stream, as Megatron's
// core/utils.py:flatten_batch_for_packed_sequences merges them: sample b's boundaries shifted by b * S (a document
// never spans two samples). Ends with B * S, which must fit int32.
std::vector<int32_t> packed_cu_seqlens(std::span<const int32_t> document_ids_BS, int64_t B, int64_t S);

// The longest packed sequence (Megatron's max_seqlen): the largest difference of consecutive entries; 0 when
// cu_seqlens has fewer than two entries.
int32_t max_seqlen(std::span<const int32_t> cu_seqlens);

// Per-iteration packed-sequence statistics, as Megatron's training.py (update_seqlen_stats_from_cu_seqlens): the
// number of real tokens sum_i L_i over the documents of the batch and sum_i L_i^2, which scales the causal attention
// FLOPs of document-masked attention. Every token of a moecore sample belongs to a document (samples are never
// padded), so tokens == B * S; squared_sum falls from B * S^2 as documents get shorter.
struct SeqlenStats {
  int64_t tokens = 0;
  int64_t squared_sum = 0;
  SeqlenStats& operator+=(const SeqlenStats& other) {
    tokens += other.tokens;
    squared_sum += other.squared_sum;
    return *this;
  }
};
// The statistics of a [B, S] micro-batch from its document ids (cut as packed_cu_seqlens).
SeqlenStats seqlen_stats(std::span<const int32_t> document_ids_BS, int64_t B, int64_t S);

}  // namespace moecore
