#include <cstdio>
#include <memory>
#include <string>
#include <vector>

#include "kvrelay/core/policy.h"

#include "commands.h"

namespace kvrelay::cli {

void add_check_config_command(CLI::App& app, int& exit_code) {
  auto files = std::make_shared<std::vector<std::string>>();
  auto skip_secrets = std::make_shared<bool>(false);
  auto* command =
      app.add_subcommand("check-config", "Validate policy files; print every problem with its JSON pointer");
  command->add_option("files", *files, "Policy files (JSON)")->required();
  command->add_flag("--skip-secrets", *skip_secrets,
                    "Do not read the admin token files and variables the policies name (CI, before the "
                    "deployment's secrets exist); by default they are read as `serve` reads them");
  command->callback([files, skip_secrets, &exit_code] {
    int failures = 0;
    for (const auto& file : *files) {
      auto policy = load_policy_file(file, *skip_secrets ? PolicySecrets::kSkip : PolicySecrets::kRead);
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
