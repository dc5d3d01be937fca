// Vocabulary-parallel embedding and cross-entropy pieces, rows spread over OpenMP threads.
#include "moecore/kernels/cpu/vocab_parallel_impl.h"

namespace moecore::kernels::cpu {
MOECORE_VOCAB_PARALLEL_DEFINE(true)
MOECORE_VOCAB_PARALLEL_INSTANTIATE(float)
MOECORE_VOCAB_PARALLEL_INSTANTIATE(double)
}  // namespace moecore::kernels::cpu
