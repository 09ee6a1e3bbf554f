#pragma once

#include <CLI/CLI.hpp>

namespace kvrelay::refworker::cli {

void add_generate_command(CLI::App& app, int& exit_code);
void add_dump_kv_command(CLI::App& app, int& exit_code);
void add_serve_command(CLI::App& app, int& exit_code);

}  // namespace kvrelay::refworker::cli
