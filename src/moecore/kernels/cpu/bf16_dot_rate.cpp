#include "moecore/kernels/cpu/bf16_dot_rate.h"

#include <cpuid.h>

#include <cstring>

namespace moecore::kernels::cpu {
namespace {

bool is_amd_family(const unsigned wanted) {
  unsigned eax = 0, ebx = 0, ecx = 0, edx = 0;
  if (__get_cpuid(0, &eax, &ebx, &ecx, &edx) == 0) return false;
  char vendor[12];
  std::memcpy(vendor, &ebx, 4);
  std::memcpy(vendor + 4, &edx, 4);
  std::memcpy(vendor + 8, &ecx, 4);
  if (std::memcmp(vendor, "AuthenticAMD", 12) != 0 || __get_cpuid(1, &eax, &ebx, &ecx, &edx) == 0) return false;
  const unsigned base_family = (eax >> 8) & 0xF;  // AMD's family: base, plus the extended family where base is 0Fh
  return (base_family == 0xF ? base_family + ((eax >> 20) & 0xFF) : base_family) == wanted;
}

}  // namespace

bool avx512_bf16_outpaces_fp32() {
  static const bool outpaces = [] {
    __builtin_cpu_init();
    if (!__builtin_cpu_supports("avx512bf16") || !__builtin_cpu_supports("avx512bw")) return false;
    return is_amd_family(0x1A);
  }();
  return outpaces;
}

}  // namespace moecore::kernels::cpu
