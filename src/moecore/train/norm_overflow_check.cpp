#include "moecore/train/norm_overflow_check.h"

#include <array>
#include <cstdint>
#include <span>
#include <sstream>
#include <string>
#include <vector>

#include "moecore/parallel/agreement.h"
#include "moecore/parallel/comm_stats.h"

namespace moecore {
namespace {

// "module layernorm dtype largest name" (names hold no spaces) or "".
std::string encode(const std::optional<NormOverflow>& overflow) {
  if (!overflow) return {};
  std::ostringstream out;
  out.precision(17);
  out << overflow->module << ' ' << (overflow->layernorm ? 1 : 0) << ' ' << static_cast<int>(overflow->dtype) << ' '
      << overflow->largest_input << ' ' << overflow->name;
  return out.str();
}

std::optional<NormOverflow> decode(const std::string& text) {
  if (text.empty()) return std::nullopt;
  std::istringstream in(text);
  NormOverflow overflow;
  int layernorm = 0, dtype = 0;
  in >> overflow.module >> layernorm >> dtype >> overflow.largest_input >> overflow.name;
  overflow.layernorm = layernorm != 0;
  overflow.dtype = static_cast<DType>(dtype);
  return overflow;
}

}  // namespace

std::optional<NormOverflow> agree_on_norm_overflow(GPTModel& model, const parallel::ProcessGroup& group) {
  const std::optional<NormOverflow> local = model.take_norm_overflow();
  if (group.size() == 1) return local;
  const parallel::CommTimer timer(parallel::CommKind::kOther);
  std::array<int32_t, 1> any = {local ? 1 : 0};
  group.all_reduce(std::span<int32_t>(any), parallel::ReduceOp::kMax);
  if (any[0] == 0) return std::nullopt;
  std::optional<NormOverflow> first;
  for (const std::string& text : parallel::all_gather_text(group, encode(local))) {
    std::optional<NormOverflow> overflow = decode(text);
    if (overflow && (!first || overflow->module < first->module)) first = std::move(overflow);
  }
  return first;
}

}  // namespace moecore
