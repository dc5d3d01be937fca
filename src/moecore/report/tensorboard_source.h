// A TensorBoard log folder read into a RunReport: the scalars of every event file in it (util/tensorboard_reader.h),
// Megatron's tags on moecore's charts (lm loss, learning-rate, grad-norm, loss-scale, iteration-time, throughput,
// mem-*-bytes, the MoE tracker's losses, moecore's moe/min|max_load_ratio_layer_<i>), every other tag on a chart of
// its own. The "... vs samples" twins are left out. A step written again by a later file (a resumed run) takes the
// later value. A curve the report holds already (from the run's log) is drawn beside it as "<name> (TensorBoard)".
#pragma once

#include <string>
#include <vector>

#include "moecore/report/run_report.h"

namespace moecore::report {

// Throws std::runtime_error when the folder holds no event file or one is corrupt (naming it).
void read_tensorboard_dir(const std::string& dir, RunReport& out);
// The same for the event files given, in this order.
void read_tensorboard_files(const std::vector<std::string>& files, RunReport& out);

}  // namespace moecore::report
