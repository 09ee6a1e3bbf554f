// `kvrelay admin ...` (issue #30): the admin API from the command line.

#include "commands.h"

namespace kvrelay::cli {

void add_admin_command(CLI::App& /*app*/, int& /*exit_code*/) {}

}  // namespace kvrelay::cli
