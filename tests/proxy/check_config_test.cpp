#include <nlohmann/json.hpp>

#include "support/daemon_fixture.h"

using namespace kvrelay::test;

TEST_CASE("check-config accepts every example in config/ and docker/", "[proxy][cli]") {
  TempDir dir;
  // The examples name admin token files of the hosts they are for, which this one has not.
  std::vector<std::string> argv{kvrelay_binary().string(), "check-config", "--skip-secrets"};
  // The example policies and the ones the docker/ deployments ship.
  for (const char* folder : {"config", "docker"}) {
    for (const auto& entry : std::filesystem::directory_iterator(source_dir() / folder)) {
      if (entry.path().extension() == ".json" && entry.path().filename().string().find("schema") == std::string::npos) {
        argv.push_back(entry.path().string());
      }
    }
  }
  REQUIRE(argv.size() >= 6);
  const auto result = run_command(argv, dir.path());
  INFO(result.err);
  CHECK(result.exit_status == 0);
  CHECK_THAT(result.out, Catch::Contains("single-node.json: ok"));
}

TEST_CASE("check-config fails on a bad policy with the pointer message", "[proxy][cli]") {
  TempDir dir;
  auto policy = nlohmann::json::parse(read_file(source_dir() / "config" / "single-node.json"));
  policy["routes"][0]["priority"] = "high";
  write_file(dir / "x.json", policy.dump(2));
  const auto result = run_command({kvrelay_binary().string(), "check-config", (dir / "x.json").string()}, dir.path());
  CHECK(result.exit_status == 1);
  CHECK_THAT(result.err,
             Catch::Contains((dir / "x.json").string() + R"(: /routes/0/priority: expected integer 0..7, got "high")"));
}

TEST_CASE("kvrelay --version prints the version", "[proxy][cli]") {
  TempDir dir;
  const auto result = run_command({kvrelay_binary().string(), "--version"}, dir.path());
  CHECK(result.exit_status == 0);
  CHECK_THAT(result.out, Catch::StartsWith("kvrelay 0."));
}
