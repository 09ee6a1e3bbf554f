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
  command->callback([options, &exit_code] { exit_code = proxy::run_daemon(*options); });
}

}  // namespace kvrelay::cli
