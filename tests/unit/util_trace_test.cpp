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

// What trace::write puts in a temporary file of that name.
std::string written_trace(const std::string& name) {
  const std::string path = (std::filesystem::temp_directory_path() / name).string();
  trace::write(path);
  std::ifstream in(path);
  std::stringstream text;
  text << in.rdbuf();
  std::filesystem::remove(path);
  return text.str();
}

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

  const std::string json = written_trace("moecore_trace_test.json");
  EXPECT_EQ(json.rfind("{\"displayTimeUnit\": \"ms\", \"traceEvents\": [", 0), 0u) << json;
  EXPECT_NE(json.find("\"name\": \"process_name\", \"ph\": \"M\", \"pid\": 3"), std::string::npos) << json;
  EXPECT_NE(json.find("\"name\": \"outer \\\"quoted\\\"\", \"cat\": \"test\", \"ph\": \"X\""), std::string::npos)
      << json;
  EXPECT_NE(json.find("\"name\": \"inner\""), std::string::npos) << json;
  EXPECT_EQ(json.find("before"), std::string::npos);
  EXPECT_EQ(json.find("after"), std::string::npos);
  EXPECT_EQ(json.substr(json.size() - 3), "]}\n");
}

// Events on a named track land on a track of that name, not on the recording thread's; events that overlap there
// (two collectives in flight at once) go to extra lanes "<name> (2)", ..., so every track's events nest.
TEST(Trace, NamedTracksInLanes) {
  using std::chrono::milliseconds;
  trace::start(0);
  const auto t0 = trace::Clock::now();
  { const trace::Scope own("on the thread", "test"); }
  trace::record_on_track("comm in flight", "a", "comm", t0, t0 + milliseconds(10));
  trace::record_on_track("comm in flight", "b", "comm", t0 + milliseconds(5), t0 + milliseconds(20));
  trace::record_on_track("comm in flight", "c", "comm", t0 + milliseconds(12), t0 + milliseconds(15));
  trace::stop();
  EXPECT_EQ(trace::event_count(), 4u);
  const std::string json = written_trace("moecore_trace_tracks.json");
  const auto track_of = [&](const std::string& event) {
    const size_t at = json.find("\"name\": \"" + event + "\", \"cat\"");
    EXPECT_NE(at, std::string::npos) << json;
    const size_t tid = json.find("\"tid\": ", at);
    return json.substr(tid, json.find('}', tid) - tid);
  };
  const auto track_named = [&](const std::string& name) {
    const size_t at = json.find("\"args\": {\"name\": \"" + name + "\"}");
    EXPECT_NE(at, std::string::npos) << name << " in " << json;
    const size_t tid = json.rfind("\"tid\": ", at);
    return json.substr(tid, json.find(',', tid) - tid);
  };
  EXPECT_EQ(track_of("a"), track_named("comm in flight"));
  EXPECT_EQ(track_of("c"), track_named("comm in flight")) << "a has ended when c starts";
  EXPECT_EQ(track_of("b"), track_named("comm in flight (2)")) << "b overlaps a";
  EXPECT_EQ(track_of("on the thread"), track_named("training"));
  EXPECT_EQ(json.find("comm in flight (3)"), std::string::npos);
}

}  // namespace
}  // namespace moecore
