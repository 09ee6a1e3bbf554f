#include <CLI/CLI.hpp>
#include <spdlog/sinks/stdout_color_sinks.h>
#include <spdlog/spdlog.h>

#include "kvrelay/proxy/version.h"

#include "commands.h"

int main(int argc, char** argv) {
  CLI::App app{"kvrelay: moves agent context between LLM workers as tokens or KV, whichever is cheaper"};
  app.set_version_flag("-V,--version", std::string("kvrelay ") + kvrelay::proxy::kVersion);
  app.require_subcommand(1);
  int exit_code = 0;
  // Commands print their results (JSON) on stdout; what they log, such as a codec plugin loaded
  // or refused, goes to stderr. `serve` installs its own logger from the policy.
  spdlog::set_default_logger(spdlog::stderr_color_st("kvrelay-cli"));
  kvrelay::cli::add_serve_command(app, exit_code);
  kvrelay::cli::add_check_config_command(app, exit_code);
  kvrelay::cli::add_decision_command(app, exit_code);
  kvrelay::cli::add_peer_command(app, exit_code);
  kvrelay::cli::add_codec_command(app, exit_code);
  kvrelay::cli::add_audit_command(app, exit_code);
  kvrelay::cli::add_admin_command(app, exit_code);
  try {
    app.parse(argc, argv);
  } catch (const CLI::ParseError& error) {
    return app.exit(error);
  }
  return exit_code;
}
