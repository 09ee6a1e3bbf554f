#pragma once

#include <CLI/App.hpp>

namespace kvrelay::cli {

// `kvrelay audit run`: the offline, paired audit (replays contexts through sidecars).
void add_audit_run_command(CLI::App& audit_command, int& exit_code);

}  // namespace kvrelay::cli
