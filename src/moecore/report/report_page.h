// The report page: a RunReport as one self-contained HTML file (no network, no external script, style or font):
// report_page.html with the report's data as JSON in a <script type="application/json"> element, drawn by the page's
// own script (SVG line charts, canvas heatmaps of the load ratio, the summary table and the alarms).
#pragma once

#include <string>

#include "moecore/report/run_report.h"

namespace moecore::report {

// The report's data in the page's JSON form (schema: report_page.html's header comment).
std::string report_json(const RunReport& report, const std::string& title);
// The whole page.
std::string report_html(const RunReport& report, const std::string& title);

}  // namespace moecore::report
