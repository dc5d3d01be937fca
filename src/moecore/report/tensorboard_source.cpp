#include "moecore/report/tensorboard_source.h"

#include <map>
#include <stdexcept>
#include <utility>

#include "moecore/util/tensorboard_reader.h"

namespace moecore::report {

namespace {

struct Placement {
  std::string chart, series;
  double scale = 1.0;
};

Placement place(const std::string& tag) {
  if (tag == "lm loss" || tag == "lm loss validation" || (tag.starts_with("mtp_") && tag.ends_with(" loss"))) {
    return {"loss", tag};
  }
  if (tag == "learning-rate") return {"learning-rate", "learning rate"};
  if (tag == "grad-norm") return {"grad-norm", "grad norm"};
  if (tag == "params-norm") return {"params-norm", "params norm"};
  if (tag == "num-zeros") return {"num-zeros", "num zeros"};
  if (tag == "loss-scale") return {"loss-scale", "loss scale"};
  if (tag == "iteration-time") return {"iteration-time", "iteration time", 1000.0};  // seconds, drawn in ms
  if (tag == "throughput") return {"throughput", "TFLOP/s per device"};
  if (tag.starts_with("mem-") && tag.ends_with("-bytes")) {
    return {"memory", tag.substr(4, tag.size() - 10), 1.0 / (1024.0 * 1024.0)};
  }
  for (const char* prefix : {"moe/min_load_ratio_layer_", "moe/max_load_ratio_layer_"}) {
    const std::string p(prefix);
    if (tag.starts_with(p)) {
      return {"expert-load", "layer " + tag.substr(p.size()) + (p.find("min") != std::string::npos ? " min" : " max")};
    }
  }
  if (tag.find("loss") != std::string::npos) return {"load-balancing", tag};
  return {tag, tag};
}

}  // namespace

void read_tensorboard_dir(const std::string& dir, RunReport& out) {
  const std::vector<std::string> files = tensorboard_event_files(dir);
  if (files.empty()) throw std::runtime_error(dir + " holds no TensorBoard event file (events.out.tfevents.*)");
  read_tensorboard_files(files, out);
}

void read_tensorboard_files(const std::vector<std::string>& files, RunReport& out) {
  // tag -> step -> value, later files overwriting earlier ones; tags in the order first seen.
  std::vector<std::string> tags;
  std::map<std::string, std::map<int64_t, double>> values;
  for (const std::string& file : files) {
    out.add_source(file);
    for (const TensorBoardScalar& scalar : read_tensorboard_events(file).scalars) {
      if (scalar.tag.ends_with(" vs samples")) continue;
      auto [at, inserted] = values.try_emplace(scalar.tag);
      if (inserted) tags.push_back(scalar.tag);
      at->second[scalar.step] = scalar.value;
    }
  }
  for (const std::string& tag : tags) {
    Placement where = place(tag);
    // A curve a log gave already (the same run's log and TensorBoard files): the two side by side.
    if (out.has_series(where.chart, where.series)) where.series += " (TensorBoard)";
    for (const auto& [step, value] : values[tag]) {
      out.add_point(where.chart, where.series, static_cast<double>(step), value * where.scale);
    }
  }
}

}  // namespace moecore::report
