// Fuzz harness: `moecore report`'s readers of a run's files, then the page from what they read.
//
// Input: a selector byte, then the file. Selector % 3 == 0: a TensorBoard event file (read_tensorboard_events, then
// read_tensorboard_dir over a folder holding it); 1: a training log (read_training_log); 2: a routing trace
// (router_trace_rank0.jsonl, read_routing_trace_dir). Whatever was read, report_json must be JSON that parses and
// report_html must hold it in place of the template's placeholder.
#include <cstddef>
#include <cstdint>
#include <exception>
#include <nlohmann/json.hpp>
#include <sstream>
#include <string>

#include "fuzz_util.h"
#include "moecore/report/log_reader.h"
#include "moecore/report/report_page.h"
#include "moecore/report/routing_trace_reader.h"
#include "moecore/report/tensorboard_source.h"
#include "moecore/util/tensorboard_reader.h"

namespace {

void render(const moecore::report::RunReport& report) {
  const std::string json = moecore::report::report_json(report, "fuzz");
  if (!nlohmann::json::accept(json)) moecore::fuzz::property_failed("report_json wrote text that is not JSON");
  const std::string page = moecore::report::report_html(report, "fuzz");
  if (page.find("__MOECORE_REPORT_DATA__") != std::string::npos || page.size() < json.size()) {
    moecore::fuzz::property_failed("the page does not hold the report's data");
  }
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  static const moecore::fuzz::ScratchDir dir("run_report");
  if (size == 0) return 0;
  const std::string_view bytes(reinterpret_cast<const char*>(data) + 1, size - 1);
  moecore::report::RunReport report;
  try {
    switch (data[0] % 3) {
      case 0: {
        const std::string path = dir.file("events.out.tfevents.0.fuzz");
        moecore::fuzz::write_bytes(path, bytes);
        (void)moecore::read_tensorboard_events(path);
        moecore::report::read_tensorboard_dir(dir.path().string(), report);
        break;
      }
      case 1: {
        std::istringstream log{std::string(bytes)};
        moecore::report::read_training_log(log, "fuzz.log", report);
        break;
      }
      default: {
        const std::string trace = dir.file("trace");
        std::filesystem::create_directories(trace);
        moecore::fuzz::write_bytes(trace + "/router_trace_rank0.jsonl", bytes);
        moecore::report::read_routing_trace_dir(trace, report);
      }
    }
  } catch (const std::exception& error) {
    moecore::fuzz::expected_named_error(error);
    return 0;
  }
  render(report);
  return 0;
}
