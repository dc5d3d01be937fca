#include "moecore/data/packed_sequences.h"

#include <algorithm>
#include <limits>
#include <string>

#include "moecore/data/indexed_dataset.h"

namespace moecore {

void ltor_masks_and_position_ids(std::span<const int32_t> tokens_S, const SampleMaskOptions& options,
                                 std::span<int64_t> position_ids_S, std::span<int32_t> document_ids_S,
                                 std::span<float> loss_mask_S) {
  const size_t S = tokens_S.size();
  if (position_ids_S.size() != S || document_ids_S.size() != S || loss_mask_S.size() != S) {
    throw DataError("ltor_masks_and_position_ids: outputs must hold " + std::to_string(S) + " tokens");
  }
  int64_t document_start = 0;  // index of the current document's first token (after the last EOD)
  int32_t document = 0;
  for (size_t t = 0; t < S; ++t) {
    const auto index = static_cast<int64_t>(t);
    position_ids_S[t] = options.reset_position_ids ? index - document_start : index;
    document_ids_S[t] = options.reset_attention_mask ? document : 0;
    const bool is_eod = tokens_S[t] == options.eod_id;
    loss_mask_S[t] = options.eod_mask_loss && is_eod ? 0.0f : 1.0f;
    if (is_eod) {  // the EOD stays in its document; the next token starts a new one
      document_start = index + 1;
      ++document;
    }
  }
}

std::vector<int32_t> cu_seqlens_from_document_ids(std::span<const int32_t> document_ids_S) {
  if (document_ids_S.size() > static_cast<size_t>(std::numeric_limits<int32_t>::max())) {
    throw DataError("cu_seqlens: a sample of " + std::to_string(document_ids_S.size()) + " tokens does not fit int32");
  }
  std::vector<int32_t> cu_seqlens{0};
  int32_t previous = 0;
  for (size_t t = 0; t < document_ids_S.size(); ++t) {
    const int32_t id = document_ids_S[t];
    if (t == 0 ? id != 0 : (id != previous && id != previous + 1)) {
      throw DataError("cu_seqlens: document id " + std::to_string(id) + " at token " + std::to_string(t) +
                      (t == 0 ? " (the first must be 0)" : " follows " + std::to_string(previous)) +
                      "; ids must count documents from 0 in order");
    }
    if (id != previous) cu_seqlens.push_back(static_cast<int32_t>(t));
    previous = id;
  }
  if (!document_ids_S.empty()) cu_seqlens.push_back(static_cast<int32_t>(document_ids_S.size()));
  return cu_seqlens;
}

std::vector<int32_t> packed_cu_seqlens(std::span<const int32_t> document_ids_BS, const int64_t B, const int64_t S) {
  if (B < 0 || S < 0 || static_cast<int64_t>(document_ids_BS.size()) != B * S) {
    throw DataError("packed_cu_seqlens: " + std::to_string(document_ids_BS.size()) + " document ids for a [" +
                    std::to_string(B) + ", " + std::to_string(S) + "] batch");
  }
  if (B * S > std::numeric_limits<int32_t>::max()) {
    throw DataError("packed_cu_seqlens: " + std::to_string(B * S) + " tokens do not fit int32 cu_seqlens");
  }
  std::vector<int32_t> cu_seqlens{0};
  for (int64_t b = 0; b < B; ++b) {
    const std::vector<int32_t> sample =
        cu_seqlens_from_document_ids(document_ids_BS.subspan(static_cast<size_t>(b * S), static_cast<size_t>(S)));
    const auto offset = static_cast<int32_t>(b * S);
    for (size_t i = 1; i < sample.size(); ++i) cu_seqlens.push_back(offset + sample[i]);
  }
  return cu_seqlens;
}

int32_t max_seqlen(std::span<const int32_t> cu_seqlens) {
  int32_t longest = 0;
  for (size_t i = 1; i < cu_seqlens.size(); ++i) longest = std::max(longest, cu_seqlens[i] - cu_seqlens[i - 1]);
  return longest;
}

SeqlenStats seqlen_stats(std::span<const int32_t> document_ids_BS, const int64_t B, const int64_t S) {
  const std::vector<int32_t> cu_seqlens = packed_cu_seqlens(document_ids_BS, B, S);
  SeqlenStats stats;
  for (size_t i = 1; i < cu_seqlens.size(); ++i) {
    const int64_t length = cu_seqlens[i] - cu_seqlens[i - 1];
    stats.tokens += length;
    stats.squared_sum += length * length;
  }
  return stats;
}

}  // namespace moecore
