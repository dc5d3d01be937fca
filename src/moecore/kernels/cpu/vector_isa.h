// Run-time choice of the vector ISA for the kernels' hot loops. The default (portable) build targets baseline
// x86-64, so one binary runs on every host of a multi-host job; functions marked MOECORE_VECTOR_CLONES are also
// compiled for x86-64-v4 (AVX-512) and x86-64-v3 (AVX2 + FMA), and the dynamic loader binds each to the best
// version the CPU supports (GCC's target_clones: one ifunc resolution per function, no per-call test). Mark the
// function that holds a loop, called from inside any OpenMP region: the outlined body of a parallel region is not
// cloned with its enclosing function. A -DMOECORE_NATIVE=ON build compiles everything for the build host only
// (-march=native), so the marker is empty there.
#pragma once

#if defined(MOECORE_NATIVE_BUILD) || !defined(__x86_64__) || !defined(__GNUC__) || defined(__clang__)
#define MOECORE_VECTOR_CLONES
#else
#define MOECORE_VECTOR_CLONES __attribute__((target_clones("arch=x86-64-v4", "arch=x86-64-v3", "default")))
#endif
