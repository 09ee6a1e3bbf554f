#include <cstdio>
#include <memory>
#include <string>
#include <vector>

#include "kvrelay/core/policy.h"

#include "commands.h"

namespace kvrelay::cli {

void add_check_config_command(CLI::App& app, int& exit_code) {
  auto files = std::make_shared<std::vector<std::string>>();
  auto* command =
      app.add_subcommand("check-config", "Validate policy files; print every problem with its JSON pointer");
  command->add_option("files", *files, "Policy files (JSON)")->required();
  command->callback([files, &exit_code] {
    int failures = 0;
    for (const auto& file : *files) {
      auto policy = load_policy_file(file);
      if (policy) {
        std::printf("%s: ok (node %s, %zu agents, %zu routes, %zu peers)\n", file.c_str(),
                    policy.value().node_id.c_str(), policy.value().agents.size(), policy.value().routes.size(),
                    policy.value().peers.size());
      } else {
        std::fprintf(stderr, "%s\n", policy.error().message.c_str());
        ++failures;
      }
    }
    exit_code = failures == 0 ? 0 : 1;
  });
}

}  // namespace kvrelay::cli
