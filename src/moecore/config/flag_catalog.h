// Megatron-LM command-line flags that moecore knows by name but does not implement yet.
//
// Passing one of them is an error that says so ("--moe-permute-fusion is a Megatron flag that moecore does not
// implement yet"), instead of "unknown flag": the user typed a real Megatron flag. The names were checked against
// megatron/training/arguments.py (and, for MoE flags generated from TransformerConfig fields, against
// megatron/core/transformer/transformer_config.py). When a feature lands, move its flags from this catalog into the
// flag table of arguments.cpp (a test checks that no name is in both).
#pragma once

#include <span>
#include <string>
#include <string_view>

namespace moecore {

// Every catalogued flag, spelled with its leading "--".
std::span<const std::string_view> unimplemented_megatron_flags();

// True when `flag` (with "--") is in the catalog.
bool is_unimplemented_megatron_flag(std::string_view flag);

// Megatron's offloading flags, refused for a reason of their own: offloading moves GPU memory to the host, where
// moecore's tensors already are. offloading_refusal gives the one-line error for one of them, else "".
std::span<const std::string_view> offloading_megatron_flags();
std::string offloading_refusal(std::string_view flag);

}  // namespace moecore
