// The daemon scrapes a real engine's metrics page (the reference worker exports vLLM's names),
// shows the load at /admin/upstreams and /metrics, and survives an engine that is not there.
#include <nlohmann/json.hpp>

#include "support/daemon_fixture.h"
#include "support/refworker_process.h"
#include "support/skip.h"

using namespace kvrelay::test;
using nlohmann::json;

namespace {

json probing_policy(std::uint16_t worker_port, std::uint16_t dead_port) {
  auto policy = basic_daemon_policy();
  policy["limits"]["read_timeout_ms"] = 10000;
  policy["limits"]["probe_interval_ms"] = 100;
  const auto worker = "http://127.0.0.1:" + std::to_string(worker_port);
  const auto dead = "http://127.0.0.1:" + std::to_string(dead_port);
  const json model = {{"architecture", "llama"}, {"layers", 5},     {"kv_heads", 4},
                      {"head_dim", 8},           {"dtype", "fp32"}, {"weights", "stories260K"}};
  policy["agents"] = {
      {{"id", "live"}, {"upstream", worker}, {"model", model}, {"metrics_url", worker + "/metrics"}},
      {{"id", "gone"}, {"upstream", dead}, {"model", model}, {"metrics_url", dead + "/metrics"}},
  };
  return policy;
}

// Port 1 (tcpmux) is privileged and nothing listens there in a test environment: connects are refused.
constexpr std::uint16_t kNothingListens = 1;

}  // namespace

TEST_CASE("daemon probes upstream engines' metrics pages for load", "[proxy][probe][process]") {
  const auto model = stories_model_path();
  if (!model) KVRELAY_SKIP("stories260K.bin not found");
  RefworkerUnderTest worker({"--model", model->string()});
  DaemonUnderTest daemon(probing_policy(worker.port(), kNothingListens));

  const auto reply = http_request(daemon.http_port(), "POST", "/agents/live/v1/completions",
                                  R"({"prompt": [1, 2, 3], "max_tokens": 4, "temperature": 0})");
  REQUIRE(reply.status == 200);

  json upstreams;
  const bool probed = wait_until(
      [&] {
        upstreams = json::parse(http_request(daemon.admin_port(), "GET", "/admin/upstreams").body)["agents"];
        return upstreams.contains("live") && upstreams["live"]["up"] == true &&
               !upstreams["live"]["time_to_first_token_s"].is_null() && !upstreams["live"]["compute_load"].is_null() &&
               !upstreams["live"]["time_per_output_token_s"].is_null() && upstreams.contains("gone") &&
               upstreams["gone"]["failures"].get<int>() >= 2;
      },
      std::chrono::seconds(10));
  INFO(upstreams.dump(2));
  REQUIRE(probed);
  CHECK(upstreams["live"]["requests_waiting"] == 0.0);
  CHECK(upstreams["live"]["time_to_first_token_s"].get<double>() > 0.0);
  // Four answer tokens: three gaps between them, whose mean prices a lossy medium's extra decode.
  CHECK(upstreams["live"]["time_per_output_token_s"].get<double>() > 0.0);
  // The refworker's KV usage: the request is over, so within 0..1 (its value while a request
  // holds KV is checked in tests/refworker).
  REQUIRE(upstreams["live"]["kv_cache_usage"].is_number());
  CHECK(upstreams["live"]["kv_cache_usage"].get<double>() >= 0.0);
  CHECK(upstreams["live"]["kv_cache_usage"].get<double>() <= 1.0);
  // Two scrapes of process_cpu_seconds_total bracket an interval: the rate over this host's cores.
  CHECK(upstreams["live"]["compute_load"].get<double>() >= 0.0);
  CHECK(upstreams["live"]["compute_load"].get<double>() < 1.5);
  CHECK(upstreams["gone"]["compute_load"].is_null());
  CHECK(upstreams["gone"]["up"] == false);
  CHECK_THAT(upstreams["gone"]["last_error"].get<std::string>(), Catch::StartsWith("connect"));

  const auto metrics = http_request(daemon.admin_port(), "GET", "/metrics").body;
  CHECK_THAT(metrics, Catch::Contains("kvrelay_upstream_probe_up{agent=\"live\"} 1"));
  CHECK_THAT(metrics, Catch::Contains("kvrelay_upstream_probe_up{agent=\"gone\"} 0"));
  CHECK_THAT(metrics, Catch::Contains("kvrelay_upstream_requests_waiting{agent=\"live\"} 0"));
  CHECK_THAT(metrics, Catch::Contains("kvrelay_upstream_probe_failures_total{agent=\"gone\",reason=\"connect\"}"));
  CHECK_THAT(metrics, Catch::Contains("kvrelay_upstream_compute_load_ratio{agent=\"live\"} "));
  CHECK_THAT(metrics, Catch::Contains("kvrelay_upstream_kv_cache_usage_ratio{agent=\"live\"} "));

  // S(t)'s agent part carries the same figures.
  const auto state_reply = http_request(daemon.admin_port(), "GET", "/admin/state");
  REQUIRE(state_reply.status == 200);
  const auto live = json::parse(state_reply.body)["agents"]["live"];
  INFO(live.dump(2));
  CHECK(live["kv_cache_usage"].is_number());
  CHECK(live["compute_load"].is_number());
  CHECK(live["requests_waiting"].is_number());
  CHECK(live["requests_running"].is_number());
  // The dead engine cost no request anything: the daemon still answers.
  CHECK(http_request(daemon.http_port(), "GET", "/healthz").status == 200);
}

TEST_CASE("/metrics passes promtool check metrics", "[proxy][metrics][process]") {
  if (run_command({"/bin/sh", "-c", "command -v promtool"}, TempDir().path()).exit_status != 0)
    KVRELAY_SKIP("promtool not installed (Debian package prometheus; scripts/install-deps.sh installs it)");
  const auto model = stories_model_path();
  if (!model) KVRELAY_SKIP("stories260K.bin not found");
  RefworkerUnderTest worker({"--model", model->string()});
  DaemonUnderTest daemon(probing_policy(worker.port(), kNothingListens));
  // Traffic first, so histograms and labelled series exist in the page.
  REQUIRE(http_request(daemon.http_port(), "POST", "/agents/live/v1/completions",
                       R"({"prompt": [1, 2], "max_tokens": 2, "temperature": 0})")
              .status == 200);
  REQUIRE(http_request(daemon.http_port(), "POST", "/agents/nobody/v1/completions", "{}").status == 404);
  REQUIRE(wait_until(
      [&] {
        return http_request(daemon.admin_port(), "GET", "/metrics").body.find("kvrelay_upstream_probe_up") !=
               std::string::npos;
      },
      std::chrono::seconds(10)));

  TempDir dir;
  const auto page = dir / "metrics.txt";
  write_file(page, http_request(daemon.admin_port(), "GET", "/metrics").body);
  const auto checked = run_command({"/bin/sh", "-c", "promtool check metrics < " + page.string()}, dir.path());
  INFO(checked.out << checked.err);
  CHECK(checked.exit_status == 0);
}
