#include "kvrelay/core/metrics.h"

#include <catch2/catch.hpp>

#include <regex>
#include <sstream>
#include <thread>

using namespace kvrelay::metrics;

TEST_CASE("registry renders counters, gauges and histograms in Prometheus text format", "[core][metrics]") {
  Registry registry;
  auto& requests = registry.counter("kvrelay_requests_total", "Requests by route", {"route", "status"});
  auto& depth = registry.gauge("kvrelay_queue_depth", "Queued transfers");
  auto& latency = registry.histogram("kvrelay_latency_seconds", "Latency", {"route"}, {0.1, 1.0});
  requests.with({"a", "200"}).inc();
  requests.with({"a", "200"}).inc(2);
  requests.with({"b\"x", "500"}).inc();
  depth.get().set(7);
  latency.with({"a"}).observe(0.05);
  latency.with({"a"}).observe(0.5);
  latency.with({"a"}).observe(5);

  const auto text = registry.render();
  CHECK_THAT(text, Catch::Contains("# TYPE kvrelay_requests_total counter\n"));
  CHECK_THAT(text, Catch::Contains("kvrelay_requests_total{route=\"a\",status=\"200\"} 3\n"));
  CHECK_THAT(text, Catch::Contains("kvrelay_requests_total{route=\"b\\\"x\",status=\"500\"} 1\n"));
  CHECK_THAT(text, Catch::Contains("kvrelay_queue_depth 7\n"));
  CHECK_THAT(text, Catch::Contains("kvrelay_latency_seconds_bucket{route=\"a\",le=\"0.1\"} 1\n"));
  CHECK_THAT(text, Catch::Contains("kvrelay_latency_seconds_bucket{route=\"a\",le=\"1\"} 2\n"));
  CHECK_THAT(text, Catch::Contains("kvrelay_latency_seconds_bucket{route=\"a\",le=\"+Inf\"} 3\n"));
  CHECK_THAT(text, Catch::Contains("kvrelay_latency_seconds_count{route=\"a\"} 3\n"));
  CHECK_THAT(text, Catch::Contains("kvrelay_latency_seconds_sum{route=\"a\"} 5.55\n"));

  // Every sample line has the text format's shape: name{labels} value.
  const std::regex sample(
      R"(^[a-zA-Z_:][a-zA-Z0-9_:]*(\{([a-zA-Z_][a-zA-Z0-9_]*="([^"\\]|\\.)*",?)*\})? [-+0-9.eEInfNa]+$)");
  std::istringstream lines(text);
  std::string line;
  int samples = 0;
  while (std::getline(lines, line)) {
    if (line.rfind("# ", 0) == 0) continue;
    INFO(line);
    CHECK(std::regex_match(line, sample));
    ++samples;
  }
  CHECK(samples == 2 + 1 + 5);  // two counter children, one gauge, 3 buckets + sum + count
}

TEST_CASE("metrics are declared once and label arity is enforced", "[core][metrics]") {
  Registry registry;
  auto& family = registry.counter("x_total", "x", {"a"});
  CHECK_THROWS(registry.gauge("x_total", "again"));
  CHECK_THROWS(family.with({"1", "2"}));
  CHECK(&family.with({"1"}) == &family.with({"1"}));  // children are stable
}

TEST_CASE("counters are exact under concurrent increments", "[core][metrics]") {
  Registry registry;
  auto& counter = registry.counter("c_total", "c").get();
  std::vector<std::thread> threads;
  for (int t = 0; t < 4; ++t) {
    threads.emplace_back([&] {
      for (int i = 0; i < 10000; ++i)
        counter.inc();
    });
  }
  for (auto& thread : threads)
    thread.join();
  CHECK(counter.value() == 40000.0);
}
