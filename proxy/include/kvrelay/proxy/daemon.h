#pragma once

#include <string>

namespace kvrelay::proxy {

struct DaemonOptions {
  std::string config_path;
  // When set, the daemon writes {"pid", "http", "admin"} here (atomically, once listening) so
  // supervisors and tests can find ports chosen by the kernel (port 0 in the policy).
  std::string ready_file;
  unsigned io_threads = 2;
  // Where the container's memory limit is read (memory_limit.h); tests and diagnostics point
  // them at a fake cgroup tree (`serve --cgroup-root`, `--self-cgroup`, hidden flags).
  std::string cgroup_root = "/sys/fs/cgroup";
  std::string self_cgroup = "/proc/self/cgroup";
};

// Runs until SIGTERM/SIGINT; returns the process exit code.
[[nodiscard]] int run_daemon(const DaemonOptions& options);

}  // namespace kvrelay::proxy
