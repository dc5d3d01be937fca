// The trace recorder: nothing is recorded outside start()/stop(), scopes become complete events with their names
// (escaped for JSON), and write() produces the Trace Event Format document.
#include <gtest/gtest.h>

#include <filesystem>
#include <fstream>
#include <sstream>
#include <string>

#include "moecore/util/trace.h"

namespace moecore {
namespace {

TEST(Trace, RecordsOnlyWhileStarted) {
  trace::start(3);
  trace::stop();
  { const trace::Scope ignored("before", "test"); }
  EXPECT_EQ(trace::event_count(), 0u);
  trace::start(3);
  {
    const trace::Scope outer("outer \"quoted\"", "test");
    const trace::Scope inner(std::string("inner"), "test");
  }
  trace::stop();
  { const trace::Scope ignored("after", "test"); }
  EXPECT_EQ(trace::event_count(), 2u);

  const std::string path = (std::filesystem::temp_directory_path() / "moecore_trace_test.json").string();
  trace::write(path);
  std::ifstream in(path);
  std::stringstream text;
  text << in.rdbuf();
  const std::string json = text.str();
  std::filesystem::remove(path);
  EXPECT_EQ(json.rfind("{\"displayTimeUnit\": \"ms\", \"traceEvents\": [", 0), 0u) << json;
  EXPECT_NE(json.find("\"name\": \"process_name\", \"ph\": \"M\", \"pid\": 3"), std::string::npos) << json;
  EXPECT_NE(json.find("\"name\": \"outer \\\"quoted\\\"\", \"cat\": \"test\", \"ph\": \"X\""), std::string::npos)
      << json;
  EXPECT_NE(json.find("\"name\": \"inner\""), std::string::npos) << json;
  EXPECT_EQ(json.find("before"), std::string::npos);
  EXPECT_EQ(json.find("after"), std::string::npos);
  EXPECT_EQ(json.substr(json.size() - 3), "]}\n");
}

}  // namespace
}  // namespace moecore
