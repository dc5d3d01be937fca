// What the MPI test drivers share: this process's rank, a check that counts failures and names them, and the hashes
// their synthetic parameters and gradients are drawn from.
#pragma once

#include <cstdint>
#include <cstdio>
#include <string>

namespace moecore::test {

inline int g_rank = 0;      // this process's rank in the world, for the messages
inline int g_failures = 0;  // failed checks so far (a driver resets it for each case it reports)

// A failed check counts, and the first 20 are printed with the rank.
inline void check(const bool ok, const std::string& what) {
  if (ok) return;
  if (++g_failures <= 20) std::fprintf(stderr, "[rank %d] check failed: %s\n", g_rank, what.c_str());
}

// SplitMix64's output function.
inline uint64_t mix(uint64_t z) {
  z += 0x9E3779B97F4A7C15ULL;
  z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ULL;
  z = (z ^ (z >> 27)) * 0x94D049BB133111EBULL;
  return z ^ (z >> 31);
}

// FNV-1a 64 of a parameter's name.
inline uint64_t name_hash(const std::string& name) {
  uint64_t h = 0xcbf29ce484222325ULL;
  for (const char c : name) h = (h ^ static_cast<unsigned char>(c)) * 0x100000001b3ULL;
  return h;
}

}  // namespace moecore::test
