#include <catch2/catch.hpp>
#include <nlohmann/json.hpp>

#include <filesystem>
#include <map>
#include <string>

#include "policy_fixture.h"
#include "support/child_process.h"
#include "support/test_paths.h"

using kvrelay::test::kvrelay_binary;
using kvrelay::test::run_command;
using kvrelay::test::TempDir;

TEST_CASE("kvrelay decision explain prints the full breakdown and follows the link figures given") {
  TempDir dir;
  kvrelay::test::write_file(dir / "policy.json", kvrelay::decision::testing::two_node_policy());
  const auto explain = [&](const std::string& gbps) {
    return run_command({kvrelay_binary().string(), "decision", "explain", "--policy", (dir / "policy.json").string(),
                        "--route", "plan-review", "--tokens", "16384", "--link-gbps", gbps, "--rtt-us", "200"},
                       dir.path());
  };
  const auto slow = explain("0.1");
  REQUIRE(slow.exit_status == 0);
  const auto slow_json = nlohmann::json::parse(slow.out);
  CHECK(slow_json.at("route") == "plan-review");
  CHECK(slow_json.at("chosen") == "tokens");
  CHECK(slow_json.at("estimates").at("link_bytes_per_s").get<double>() == Approx(0.1e9 / 8));
  CHECK(slow_json.at("estimates").at("rtt_s").get<double>() == Approx(200e-6));
  CHECK(slow_json.at("candidates").size() == 8);  // the built-in media, summary included (listed, not allowed)

  const auto fast = explain("400");
  REQUIRE(fast.exit_status == 0);
  CHECK(nlohmann::json::parse(fast.out).at("chosen") != "tokens");
}

TEST_CASE("kvrelay decision explain reports an unknown route") {
  TempDir dir;
  kvrelay::test::write_file(dir / "policy.json", kvrelay::decision::testing::two_node_policy());
  const auto result = run_command({kvrelay_binary().string(), "decision", "explain", "--policy",
                                   (dir / "policy.json").string(), "--route", "nope", "--tokens", "10"},
                                  dir.path());
  CHECK(result.exit_status == 1);
  CHECK(result.err.find("not_found") != std::string::npos);
}

// The daemon's engine prices the policy's plugin codecs as media; so does the explanation. Before
// it loaded codecs.plugin_dirs, every plugin medium was listed as codec_unavailable.
TEST_CASE("kvrelay decision explain loads the policy's codec plugins as the daemon does") {
  const auto plugins = kvrelay::test::binary_dir() / "tests" / "codec_plugins" / "plugins" / "good";
  REQUIRE(std::filesystem::exists(plugins / "xor_plugin.so"));
  TempDir dir;
  auto policy = nlohmann::json::parse(kvrelay::decision::testing::two_node_policy());
  policy["codecs"]["plugin_dirs"] = {plugins.string(), (dir / "no-such-dir").string()};
  for (auto& route : policy["routes"]) {
    if (route["id"] == "plan-review") route["allowed_media"] = {"tokens", "kv_raw", "codec:xor", "codec:absent"};
  }
  kvrelay::test::write_file(dir / "policy.json", policy.dump());
  const auto result = run_command({kvrelay_binary().string(), "decision", "explain", "--policy",
                                   (dir / "policy.json").string(), "--route", "plan-review", "--tokens", "4096"},
                                  dir.path());
  REQUIRE(result.exit_status == 0);
  // The missing directory is named on stderr and does not stop the explanation.
  CHECK(result.err.find("no-such-dir") != std::string::npos);
  const auto explained = nlohmann::json::parse(result.out);
  std::map<std::string, nlohmann::json> candidates;
  for (const auto& candidate : explained.at("candidates")) {
    candidates[candidate.at("medium").get<std::string>()] = candidate;
  }
  REQUIRE(candidates.count("codec:xor") == 1);
  CHECK(candidates["codec:xor"].at("eligible") == true);
  REQUIRE(candidates.count("codec:absent") == 1);
  CHECK(candidates["codec:absent"].at("eligible") == false);
  CHECK(candidates["codec:absent"].at("lost_because") == "codec_unavailable");
}
