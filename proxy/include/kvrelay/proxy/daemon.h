#pragma once

#include <string>

namespace kvrelay::proxy {

struct DaemonOptions {
  std::string config_path;
  // When set, the daemon writes {"pid", "http", "admin"} here (atomically, once listening) so
  // supervisors and tests can find ports chosen by the kernel (port 0 in the policy).
  std::string ready_file;
  unsigned io_threads = 2;
};

// Runs until SIGTERM/SIGINT; returns the process exit code.
[[nodiscard]] int run_daemon(const DaemonOptions& options);

}  // namespace kvrelay::proxy
