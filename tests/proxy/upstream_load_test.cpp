// The load figures read from engines' metrics pages. vLLM's names are also exported by the
// reference worker (see upstream_probe_test.cpp for the live probe); TGI cannot run here, so its
// page is checked as text.
#include "kvrelay/proxy/upstream_load.h"

#include <catch2/catch.hpp>

#include <cmath>

using kvrelay::proxy::cpu_load_between;
using kvrelay::proxy::HistogramTotals;
using kvrelay::proxy::mean_between;
using kvrelay::proxy::parse_upstream_metrics;

TEST_CASE("vLLM load metrics are summed over models and histogram totals kept", "[proxy][probe]") {
  const auto page = R"(# HELP vllm:num_requests_waiting Requests waiting.
# TYPE vllm:num_requests_waiting gauge
vllm:num_requests_waiting{model_name="a"} 3.0
vllm:num_requests_waiting{model_name="b,\"odd\" name}"} 2
vllm:num_requests_running{model_name="a"} 1 1700000000000
vllm:kv_cache_usage_perc{model_name="a"} 0.25
vllm:kv_cache_usage_perc{model_name="b"} 0.75
vllm:time_to_first_token_seconds_bucket{model_name="a",le="+Inf"} 4
vllm:time_to_first_token_seconds_sum{model_name="a"} 0.5
vllm:time_to_first_token_seconds_count{model_name="a"} 4
vllm:unrelated_total NaN
)";
  const auto load = parse_upstream_metrics(page);
  REQUIRE(load);
  CHECK(load.value().requests_waiting == 5.0);
  CHECK(load.value().requests_running == 1.0);
  CHECK(load.value().kv_cache_usage == 0.75);  // the busiest cache
  REQUIRE(load.value().time_to_first_token);
  CHECK(load.value().time_to_first_token->sum == 0.5);
  CHECK(load.value().time_to_first_token->count == 4.0);
}

TEST_CASE("time per output token is read under vLLM's old and new names and TGI's", "[proxy][probe]") {
  const auto old_name = parse_upstream_metrics(
      "vllm:time_per_output_token_seconds_sum{model_name=\"a\"} 0.3\n"
      "vllm:time_per_output_token_seconds_count{model_name=\"a\"} 10\n");
  REQUIRE(old_name);
  REQUIRE(old_name.value().time_per_output_token);
  CHECK(old_name.value().time_per_output_token->sum == 0.3);
  CHECK(old_name.value().time_per_output_token->count == 10.0);
  CHECK(old_name.value().recognised_anything());

  const auto new_name =
      parse_upstream_metrics("vllm:inter_token_latency_seconds_sum 1.5\nvllm:inter_token_latency_seconds_count 50\n");
  REQUIRE(new_name);
  REQUIRE(new_name.value().time_per_output_token);
  CHECK(new_name.value().time_per_output_token->count == 50.0);

  const auto tgi = parse_upstream_metrics(
      "tgi_request_mean_time_per_token_duration_sum 0.2\ntgi_request_mean_time_per_token_duration_count 4\n");
  REQUIRE(tgi);
  REQUIRE(tgi.value().time_per_output_token);
  CHECK(mean_between({}, *tgi.value().time_per_output_token) == Approx(0.05));

  // A sum without its count is not a histogram: nothing is made up.
  const auto half = parse_upstream_metrics("vllm:time_per_output_token_seconds_sum 0.3\n");
  REQUIRE(half);
  CHECK_FALSE(half.value().time_per_output_token);
}

TEST_CASE("TGI's queue and batch sizes map onto waiting and running", "[proxy][probe]") {
  const auto load = parse_upstream_metrics("tgi_queue_size 7\r\ntgi_batch_current_size 2\r\n");
  REQUIRE(load);
  CHECK(load.value().requests_waiting == 7.0);
  CHECK(load.value().requests_running == 2.0);
  CHECK_FALSE(load.value().kv_cache_usage);
}

TEST_CASE("A page with nothing recognisable parses but says so", "[proxy][probe]") {
  const auto load = parse_upstream_metrics("# only comments\n\nprocess_cpu_seconds_total 12.5\n");
  REQUIRE(load);
  // The CPU counter is read, but any instrumented process has one: it does not make an engine.
  CHECK(load.value().cpu_seconds == 12.5);
  CHECK_FALSE(load.value().recognised_anything());
}

TEST_CASE("process_cpu_seconds_total is read beside vLLM's figures and summed over label sets", "[proxy][probe]") {
  const auto page = R"(# TYPE process_cpu_seconds_total counter
process_cpu_seconds_total 3.5
process_cpu_seconds_total{pid="2"} 1.25
process_cpu_seconds_totally 100
vllm:num_requests_waiting{model_name="a"} 0
)";
  const auto load = parse_upstream_metrics(page);
  REQUIRE(load);
  CHECK(load.value().cpu_seconds == 4.75);
  CHECK_FALSE(load.value().compute_load);  // a rate needs a second scrape; the prober fills it
  CHECK_FALSE(parse_upstream_metrics("vllm:num_requests_waiting 0\n").value().cpu_seconds);
}

TEST_CASE("Compute load is the CPU rate between two scrapes over the cores", "[proxy][probe]") {
  // 3 CPU seconds in 2 wall seconds on 4 cores: 1.5 cores busy of 4.
  CHECK(cpu_load_between(10.0, 13.0, 2.0, 4).value() == Approx(0.375));
  CHECK(cpu_load_between(10.0, 10.0, 2.0, 4).value() == 0.0);  // idle is a figure, not a gap
  CHECK(cpu_load_between(0.0, 16.0, 2.0, 4).value() ==
        Approx(2.0));                                 // the engine's host has more cores: shown, not hidden
  CHECK_FALSE(cpu_load_between(13.0, 1.0, 2.0, 4));   // engine restarted
  CHECK_FALSE(cpu_load_between(10.0, 13.0, 0.0, 4));  // no interval
  CHECK_FALSE(cpu_load_between(10.0, 13.0, 2.0, 0));  // cores unknown
  CHECK_FALSE(cpu_load_between(10.0, std::nan(""), 2.0, 4));
}

TEST_CASE("Malformed exposition lines are errors naming the line", "[proxy][probe]") {
  const auto no_value = parse_upstream_metrics("vllm:num_requests_waiting 1\nvllm:num_requests_running\n");
  REQUIRE_FALSE(no_value);
  CHECK_THAT(no_value.error().message, Catch::Contains("line 2") && Catch::Contains("no value"));

  const auto open_labels = parse_upstream_metrics("vllm:num_requests_waiting{model_name=\"a 1\n");
  REQUIRE_FALSE(open_labels);
  CHECK_THAT(open_labels.error().message, Catch::Contains("line 1") && Catch::Contains("unterminated"));

  const auto not_number = parse_upstream_metrics("tgi_queue_size many\n");
  REQUIRE_FALSE(not_number);
  CHECK_THAT(not_number.error().message, Catch::Contains("not a number"));

  const auto no_name = parse_upstream_metrics("{le=\"1\"} 3\n");
  REQUIRE_FALSE(no_name);
  CHECK_THAT(no_name.error().message, Catch::Contains("no metric name"));
}

TEST_CASE("Recent TTFT is the mean between two scrapes", "[proxy][probe]") {
  CHECK(mean_between(HistogramTotals{1.0, 10.0}, HistogramTotals{1.6, 13.0}) == Approx(0.2));
  CHECK_FALSE(mean_between(HistogramTotals{1.0, 10.0}, HistogramTotals{1.0, 10.0}));  // nothing new
  CHECK_FALSE(mean_between(HistogramTotals{5.0, 10.0}, HistogramTotals{0.1, 1.0}));   // engine restarted
}
