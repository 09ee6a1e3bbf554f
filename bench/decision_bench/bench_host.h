#pragma once

// What the JSON records about the host, so timings can be read against it.

#include <fstream>
#include <string>

namespace kvrelay::bench {

[[nodiscard]] inline std::string host_cpu_model() {
  std::ifstream cpuinfo("/proc/cpuinfo");
  std::string line;
  while (std::getline(cpuinfo, line)) {
    if (line.rfind("model name", 0) == 0) return line.substr(line.find(':') + 2);
  }
  return "unknown";
}

// Other work on the host inflates timings.
[[nodiscard]] inline double host_load_average() {
  std::ifstream loadavg("/proc/loadavg");
  double one_minute = 0.0;
  loadavg >> one_minute;
  return one_minute;
}

}  // namespace kvrelay::bench
