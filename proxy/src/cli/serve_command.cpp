#include <memory>

#include "kvrelay/proxy/daemon.h"

#include "commands.h"

namespace kvrelay::cli {

void add_serve_command(CLI::App& app, int& exit_code) {
  auto options = std::make_shared<proxy::DaemonOptions>();
  auto* command = app.add_subcommand("serve", "Run the sidecar daemon with a JSON policy");
  command->add_option("-c,--config", options->config_path, "Policy file (JSON)")->required()->check(CLI::ExistingFile);
  command->add_option("--ready-file", options->ready_file,
                      "Write {pid, http, admin} ports here once listening (for supervisors and tests)");
  command->add_option("--io-threads", options->io_threads, "Threads running the network event loop")
      ->check(CLI::Range(1U, 256U));
  // Test and diagnostic switches, left out of --help: read the memory limit from a fake cgroup
  // tree instead of this container's (docs/operations.md, "Memory limit").
  command->add_option("--cgroup-root", options->cgroup_root, "cgroup file system root (default /sys/fs/cgroup)")
      ->group("");
  command
      ->add_option("--self-cgroup", options->self_cgroup,
                   "file in /proc/self/cgroup's format naming this process's cgroups (default /proc/self/cgroup)")
      ->group("");
  command->callback([options, &exit_code] { exit_code = proxy::run_daemon(*options); });
}

}  // namespace kvrelay::cli
