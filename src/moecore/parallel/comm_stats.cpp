#include "moecore/parallel/comm_stats.h"

namespace moecore::parallel {

const char* comm_kind_name(const CommKind kind) {
  switch (kind) {
    case CommKind::kAllToAll: return "all-to-all";
    case CommKind::kTensorParallel: return "tensor-parallel";
    case CommKind::kGradReduce: return "grad-reduce";
    case CommKind::kParamGather: return "param-gather";
    case CommKind::kContextParallel: return "context-parallel";
    case CommKind::kPipelineP2P: return "pipeline-p2p";
    case CommKind::kPipelineWait: return "pipeline-wait";
    case CommKind::kOther: return "other";
    case CommKind::kCount: break;
  }
  return "unknown";
}

CommStats& CommStats::instance() {
  static CommStats stats;
  return stats;
}

}  // namespace moecore::parallel
