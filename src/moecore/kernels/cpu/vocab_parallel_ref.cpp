// Naive references of vocab_parallel.h: the same per-row math, serial.
#include "moecore/kernels/cpu/vocab_parallel_impl.h"

namespace moecore::kernels::ref {
MOECORE_VOCAB_PARALLEL_DEFINE(false)
MOECORE_VOCAB_PARALLEL_INSTANTIATE(float)
MOECORE_VOCAB_PARALLEL_INSTANTIATE(double)
}  // namespace moecore::kernels::ref
