#include "moecore/report/report_page.h"

#include <nlohmann/json.hpp>
#include <stdexcept>
#include <string_view>

namespace moecore::report {

extern const std::string_view kReportPageTemplate;  // report_page.html, compiled in (cmake/embed_text.cmake)

namespace {

constexpr std::string_view kPlaceholder = "__MOECORE_REPORT_DATA__";

nlohmann::json points_json(const Series& series) {
  nlohmann::json points = nlohmann::json::array();
  for (const auto& [x, y] : series.points) points.push_back({x, y});  // NaN becomes null
  return points;
}

}  // namespace

std::string report_json(const RunReport& report, const std::string& title) {
  nlohmann::json data;
  data["title"] = title;
  data["sources"] = report.sources();
  data["summary"] = nlohmann::json::array();
  for (const auto& [label, value] : report.summary()) data["summary"].push_back({label, value});
  data["alarms"] = nlohmann::json::array();
  for (const Alarm& alarm : report.alarms())
    data["alarms"].push_back({{"iteration", alarm.iteration}, {"text", alarm.text}});
  data["charts"] = nlohmann::json::array();
  for (const Chart& chart : report.charts()) {
    nlohmann::json series = nlohmann::json::array();
    for (const Series& s : chart.series) series.push_back({{"name", s.name}, {"points", points_json(s)}});
    data["charts"].push_back({{"id", chart.id},
                              {"title", chart.title},
                              {"x_label", "iteration"},
                              {"y_label", chart.y_label},
                              {"log_y", chart.log_y},
                              {"series", series}});
  }
  data["heatmaps"] = nlohmann::json::array();
  for (const ExpertLoad& load : report.expert_loads()) {
    size_t experts = 0;
    for (const auto& column : load.tokens) experts = std::max(experts, column.size());
    nlohmann::json under = nlohmann::json::array();
    for (const Series& s : load.under) {
      nlohmann::json values = nlohmann::json::array();
      for (const auto& point : s.points) values.push_back(point.second);
      under.push_back({{"name", s.name}, {"values", values}});
    }
    nlohmann::json alarms = nlohmann::json::array();
    for (const auto& [iteration, expert] : load.alarms)
      alarms.push_back({{"iteration", iteration}, {"expert", expert}});
    data["heatmaps"].push_back({{"id", load.id},
                                {"title", load.title},
                                {"x_label", "iteration"},
                                {"y_label", "expert"},
                                {"x", load.iterations},
                                {"experts", experts},
                                {"values", load.tokens},
                                {"under", under},
                                {"alarms", alarms}});
  }
  return data.dump(-1, ' ', false, nlohmann::json::error_handler_t::replace);
}

std::string report_html(const RunReport& report, const std::string& title) {
  const std::string json = report_json(report, title);
  // Inside <script>, "</" could close the element: JSON allows "<\/" for it.
  std::string escaped;
  escaped.reserve(json.size());
  for (size_t i = 0; i < json.size(); ++i) {
    escaped.push_back(json[i]);
    if (json[i] == '<' && i + 1 < json.size() && json[i + 1] == '/') escaped.push_back('\\');
  }
  const size_t at = kReportPageTemplate.find(kPlaceholder);
  if (at == std::string_view::npos) throw std::logic_error("the report page template has no data placeholder");
  std::string page(kReportPageTemplate.substr(0, at));
  page += escaped;
  page += kReportPageTemplate.substr(at + kPlaceholder.size());
  return page;
}

}  // namespace moecore::report
