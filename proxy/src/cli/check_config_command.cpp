#include <cstdio>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "kvrelay/core/policy.h"
#include "kvrelay/proxy/memory_limit.h"

#include "commands.h"

namespace kvrelay::cli {

namespace {

struct CheckConfigOptions {
  std::vector<std::string> files;
  bool skip_secrets = false;
  std::string memory_limit;  // "": not checked; "auto": this container's; else a size
  std::string cgroup_root = proxy::kDefaultCgroupRoot;
  std::string self_cgroup = proxy::kDefaultSelfCgroup;
};

// The limit the policies are held to, as `serve` would hold them ("auto") or as the target
// container's is written; nullopt inside means no limit applies.
Result<std::optional<proxy::MemoryLimit>> memory_limit_to_check(const CheckConfigOptions& options) {
  if (options.memory_limit == "auto") return proxy::container_memory_limit(options.cgroup_root, options.self_cgroup);
  KVRELAY_TRY(auto bytes, proxy::parse_memory_quantity(options.memory_limit));
  return std::optional<proxy::MemoryLimit>(proxy::MemoryLimit{bytes, "--memory-limit " + options.memory_limit});
}

}  // namespace

void add_check_config_command(CLI::App& app, int& exit_code) {
  auto options = std::make_shared<CheckConfigOptions>();
  auto* command =
      app.add_subcommand("check-config", "Validate policy files; print every problem with its JSON pointer");
  command->add_option("files", options->files, "Policy files (JSON)")->required();
  command->add_flag("--skip-secrets", options->skip_secrets,
                    "Do not read the admin token files and variables the policies name (CI, before the "
                    "deployment's secrets exist); by default they are read as `serve` reads them");
  command->add_option("--memory-limit", options->memory_limit,
                      "Also check that the shared memory each policy commits fits a container memory limit: "
                      "`auto` reads this container's cgroup as `serve` does (run it in the pod), a size "
                      "(bytes, 512Mi, 4Gi, 2G) is the target container's resources.limits.memory");
  // Test and diagnostic switches for `--memory-limit auto`, as on `serve`.
  command->add_option("--cgroup-root", options->cgroup_root, "cgroup file system root")->group("");
  command->add_option("--self-cgroup", options->self_cgroup, "file in /proc/self/cgroup's format")->group("");
  command->callback([options, &exit_code] {
    std::optional<std::optional<proxy::MemoryLimit>> limit;  // outer nullopt: not checked
    if (!options->memory_limit.empty()) {
      auto found = memory_limit_to_check(*options);
      if (!found) {
        std::fprintf(stderr, "--memory-limit: %s\n", found.error().message.c_str());
        exit_code = 1;
        return;
      }
      limit = std::move(found).value();
    }
    int failures = 0;
    for (const auto& file : options->files) {
      auto policy = load_policy_file(file, options->skip_secrets ? PolicySecrets::kSkip : PolicySecrets::kRead);
      if (!policy) {
        std::fprintf(stderr, "%s\n", policy.error().message.c_str());
        ++failures;
        continue;
      }
      std::string memory;
      if (limit) {
        if (auto fits = proxy::check_memory_budget(policy.value(), *limit); !fits) {
          std::fprintf(stderr, "%s\n", fits.error().message.c_str());
          ++failures;
          continue;
        }
        const auto committed = proxy::memory_size_text(proxy::memory_budget(policy.value()).total);
        memory = *limit ? ", commits " + committed + " of the memory limit " + proxy::memory_size_text((*limit)->bytes)
                        : ", commits " + committed + ", no memory limit found";
      }
      std::printf("%s: ok (node %s, %zu agents, %zu routes, %zu peers%s)\n", file.c_str(),
                  policy.value().node_id.c_str(), policy.value().agents.size(), policy.value().routes.size(),
                  policy.value().peers.size(), memory.c_str());
    }
    exit_code = failures == 0 ? 0 : 1;
  });
}

}  // namespace kvrelay::cli
