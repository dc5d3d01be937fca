// One micro-batch's sequence as attention sees it on this rank: which positions of the whole sequence the rank holds
// (context parallelism: chunks r and 2 CP - 1 - r of 2 CP, Megatron's load-balanced split), the rotary position of
// every local row, and the documents of packed sequences (Megatron's --reset-attention-mask: no attention across
// documents).
#pragma once

#include <cstdint>
#include <vector>

#include "moecore/parallel/process_group.h"

namespace moecore {

struct SequenceInfo {
  int64_t S = 0;  // the whole sequence
  int64_t B = 0;
  int cp_rank = 0, cp_size = 1;
  // Dynamic context parallelism (--hybrid-context-parallel): this micro-batch's context-parallel group, in place of the
  // layers' own (null: theirs).
  const parallel::ProcessGroup* cp_group = nullptr;
  std::vector<int64_t> positions_SB;  // the rotary position of every local row (s, b) [S / CP, B]
  std::vector<int32_t> documents_BS;  // the whole micro-batch's document ids [B, S]; empty: one document per sample

  int64_t local_length() const { return S / cp_size; }
  bool packed() const { return !documents_BS.empty(); }

  // The whole-sequence index of each local position of context-parallel rank `rank` [S / CP].
  std::vector<int64_t> index_of_rank(const int rank) const {
    std::vector<int64_t> index;
    const int64_t chunk = S / (2 * cp_size);
    if (cp_size == 1) {
      for (int64_t s = 0; s < S; ++s) index.push_back(s);
      return index;
    }
    for (const int64_t c : {static_cast<int64_t>(rank), static_cast<int64_t>(2 * cp_size - 1 - rank)}) {
      for (int64_t s = 0; s < chunk; ++s) index.push_back(c * chunk + s);
    }
    return index;
  }
  std::vector<int64_t> local_index() const { return index_of_rank(cp_rank); }

  // The documents [n, B] of the positions `index` (n of them); empty without packing.
  std::vector<int32_t> documents_of(const std::vector<int64_t>& index) const {
    std::vector<int32_t> out;
    if (!packed()) return out;
    out.reserve(index.size() * static_cast<size_t>(B));
    for (const int64_t s : index) {
      for (int64_t b = 0; b < B; ++b) out.push_back(documents_BS[static_cast<size_t>(b * S + s)]);
    }
    return out;
  }
};

}  // namespace moecore
