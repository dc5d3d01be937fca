// GPT-2's pre-tokenisation, written by hand over UTF-8 code points. It splits text exactly like
//   's|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+
// in Python's `regex` module (\s = Unicode White_Space). Ill-formed UTF-8 never fails: each ill-formed
// subpart counts as one character outside \s, \p{L} and \p{N}, so the pieces still cover every byte.
#pragma once

#include <string_view>
#include <vector>

namespace moecore {

// Appends to `pieces` the consecutive pieces of `text` (views into it); they concatenate to `text`.
void gpt2_pretokenize(std::string_view text, std::vector<std::string_view>& pieces);

}  // namespace moecore
