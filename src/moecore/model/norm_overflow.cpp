#include "moecore/model/norm_overflow.h"

#include <sstream>
#include <utility>

namespace moecore {
namespace {

std::string short_dtype_name(const DType dtype) {
  switch (dtype) {
    case DType::kF64: return "fp64";
    case DType::kBF16: return "bf16";
    case DType::kF16: return "fp16";
    default: return "fp32";
  }
}

}  // namespace

std::string describe_norm_overflow(const NormOverflow& overflow) {
  std::ostringstream largest;
  largest.precision(2);
  largest << overflow.largest_input;
  return overflow.name + (overflow.layernorm ? "'s variance" : "'s sum of squares") + " overflowed " +
         short_dtype_name(overflow.dtype) + " (input rows with |x| up to " + largest.str() + ")";
}

void NormOverflowLog::record(NormOverflow overflow) {
  if (first_ && first_->module <= overflow.module) return;
  first_ = std::move(overflow);
}

std::optional<NormOverflow> NormOverflowLog::take() { return std::exchange(first_, std::nullopt); }

}  // namespace moecore
