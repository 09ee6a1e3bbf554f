#pragma once

// Each subcommand registers itself on the root CLI::App and stores its exit code in
// `exit_code` when it runs; main() only parses and returns that code.

#include <CLI/App.hpp>

namespace kvrelay::cli {

void add_serve_command(CLI::App& app, int& exit_code);
void add_check_config_command(CLI::App& app, int& exit_code);
void add_decision_command(CLI::App& app, int& exit_code);
void add_peer_command(CLI::App& app, int& exit_code);
void add_codec_command(CLI::App& app, int& exit_code);
void add_audit_command(CLI::App& app, int& exit_code);
void add_admin_command(CLI::App& app, int& exit_code);

}  // namespace kvrelay::cli
