#include <CLI/CLI.hpp>

#include "commands.h"

int main(int argc, char** argv) {
  CLI::App app{"kvrelay-refworker: CPU reference Llama worker for kvrelay (OpenAI completions with token ids)"};
  app.require_subcommand(1);
  int exit_code = 0;
  kvrelay::refworker::cli::add_generate_command(app, exit_code);
  kvrelay::refworker::cli::add_dump_kv_command(app, exit_code);
  kvrelay::refworker::cli::add_serve_command(app, exit_code);
  try {
    app.parse(argc, argv);
  } catch (const CLI::ParseError& error) {
    return app.exit(error);
  }
  return exit_code;
}
