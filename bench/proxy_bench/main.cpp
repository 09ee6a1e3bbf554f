// Front proxy overhead: requests/s and latency straight to a fast local upstream, through kvrelay,
// and through nginx as a plain reverse proxy to the same upstream, in one run, for small JSON
// requests and for streamed (SSE) ones: with a Content-Length body ("streaming") and, as vLLM and
// the reference worker send them, one chunk per event ("streaming_chunked"). Prints one JSON object.
#include <boost/asio/io_context.hpp>
#include <boost/asio/write.hpp>
#include <nlohmann/json.hpp>

#include <algorithm>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <map>
#include <memory>
#include <optional>
#include <thread>
#include <tuple>
#include <vector>

#include "kvrelay/proxy/http_server.h"

#include "load_generator.h"
#include "support/child_process.h"
#include "support/http_client.h"
#include "support/test_paths.h"

namespace {

using namespace kvrelay;
using nlohmann::json;

constexpr std::chrono::milliseconds kRunTime{2000};  // per endpoint and scenario, under load
constexpr unsigned kRounds = 4;
constexpr unsigned kConnections = 16;

constexpr int kStreamEvents = 32;
// Asks the bench upstream for an event stream in chunked transfer encoding.
constexpr const char* kChunkedHeader = "X-Bench-Chunked";

std::vector<std::string> stream_events() {
  std::vector<std::string> events;
  for (int index = 0; index < kStreamEvents; ++index) {
    events.push_back(R"(data: {"choices":[{"index":0,"text":"t","token_ids":[)" + std::to_string(index) + "]}]}\n\n");
  }
  events.emplace_back("data: [DONE]\n\n");
  return events;
}

// The chunked event stream, framed by hand (one chunk per event) and written in one go; an
// HTTP/1.0 client (nginx proxies with 1.0 by default) gets the events delimited by the close.
class ChunkedEventStream final : public proxy::StreamingResponder {
 public:
  explicit ChunkedEventStream(bool http11) : http11_(http11) {}

  void start(boost::beast::tcp_stream& client, std::function<void(bool)> done) override {
    static const std::string chunked = [] {
      std::string wire =
          "HTTP/1.1 200 OK\r\nServer: bench\r\nContent-Type: text/event-stream\r\nTransfer-Encoding: chunked\r\n\r\n";
      for (const auto& event : stream_events()) {
        char size_line[32];
        std::snprintf(size_line, sizeof size_line, "%zx\r\n", event.size());
        wire += size_line + event + "\r\n";
      }
      return wire + "0\r\n\r\n";
    }();
    static const std::string close_delimited = [] {
      std::string wire = "HTTP/1.0 200 OK\r\nServer: bench\r\nContent-Type: text/event-stream\r\n\r\n";
      for (const auto& event : stream_events())
        wire += event;
      return wire;
    }();
    boost::asio::async_write(
        client.socket(), boost::asio::buffer(http11_ ? chunked : close_delimited),
        [done = std::move(done), http11 = http11_](boost::system::error_code ec, std::size_t) { done(!ec && http11); });
  }

 private:
  bool http11_;
};

// The upstream: answers from memory on one thread, so the proxies are what is measured.
proxy::Reply upstream_answer(const proxy::HttpRequest& request) {
  static const std::string completion =
      R"({"id":"cmpl-1","object":"text_completion","choices":[{"index":0,"text":"hello","token_ids":[1,2,3]}],)"
      R"("usage":{"prompt_tokens":8,"completion_tokens":3,"total_tokens":11}})";
  static const std::string stream = [] {
    std::string events;
    for (const auto& event : stream_events())
      events += event;
    return events;
  }();
  const bool streaming = request.body().find("\"stream\":true") != std::string::npos;
  if (streaming && request.count(kChunkedHeader) > 0) {
    return std::make_shared<ChunkedEventStream>(request.version() >= 11 && request.keep_alive());
  }
  return proxy::make_text_response(proxy::http::status::ok, streaming ? stream : completion,
                                   streaming ? "text/event-stream" : "application/json", request);
}

std::optional<std::filesystem::path> find_nginx() {
  for (const char* candidate : {"/usr/sbin/nginx", "/usr/bin/nginx", "/usr/local/sbin/nginx"}) {
    if (std::filesystem::exists(candidate)) return std::filesystem::path(candidate);
  }
  return std::nullopt;
}

std::string load_average() {
  std::ifstream loadavg("/proc/loadavg");
  std::string one, five, fifteen;
  loadavg >> one >> five >> fifteen;
  return one + " " + five + " " + fifteen;
}

std::uint16_t free_port() {
  boost::asio::io_context io;
  boost::asio::ip::tcp::acceptor acceptor(io, {boost::asio::ip::make_address("127.0.0.1"), 0});
  return acceptor.local_endpoint().port();
}

struct Endpoint {
  std::string name;
  std::uint16_t port;
  std::string target;
};

// The machine is shared: rather than one long run per endpoint (a burst of someone else's work
// would land on one of them), each is measured in kRounds short slices taken in turn, so every
// endpoint sees the same background load. Low load (one connection) gives the added latency;
// kConnections connections give throughput.
json measure_in_turn(const std::vector<Endpoint>& endpoints, const std::string& body,
                     const std::map<std::string, std::string>& headers) {
  std::vector<std::vector<bench::LoadResult>> single(endpoints.size());
  std::vector<std::vector<bench::LoadResult>> loaded(endpoints.size());
  for (unsigned round = 0; round < kRounds; ++round) {
    for (std::size_t index = 0; index < endpoints.size(); ++index) {
      const auto& endpoint = endpoints[index];
      single[index].push_back(
          bench::run_load(endpoint.port, endpoint.target, body, headers, 1, kRunTime / 2 / kRounds));
      loaded[index].push_back(
          bench::run_load(endpoint.port, endpoint.target, body, headers, kConnections, kRunTime / kRounds));
    }
  }
  json section;
  for (std::size_t index = 0; index < endpoints.size(); ++index) {
    const auto low = bench::merge_runs(single[index]);
    const auto high = bench::merge_runs(loaded[index]);
    section[endpoints[index].name] = {{"rps", high.requests_per_second}, {"p50_us", high.p50_us},
                                      {"p99_us", high.p99_us},           {"low_load_p50_us", low.p50_us},
                                      {"low_load_p99_us", low.p99_us},   {"errors", high.errors + low.errors},
                                      {"requests", high.requests}};
  }
  return section;
}

}  // namespace

// Usage: proxy_bench [scenario...] (small, streaming, streaming_chunked; all by default). The
// kvrelay pid goes to stderr, for profiling the daemon under one scenario's load.
int main(int argc, char** argv) {
  const std::vector<std::string> only(argv + 1, argv + argc);
  const auto selected = [&](const std::string& scenario) {
    return only.empty() || std::find(only.begin(), only.end(), scenario) != only.end();
  };
  test::TempDir dir;
  boost::asio::io_context upstream_io;
  proxy::HttpServer upstream(upstream_io, {}, [](proxy::HttpRequest&& request) { return upstream_answer(request); });
  if (!upstream.listen({"127.0.0.1", 0})) return 1;
  const auto upstream_port = upstream.local_endpoint().port();
  std::thread upstream_thread([&] { upstream_io.run(); });

  const json policy = {{"schema_version", 1},
                       {"node", {{"id", "bench"}}},
                       {"listen", {{"http", "127.0.0.1:0"}}},
                       {"agents",
                        {{{"id", "a"},
                          {"upstream", "http://127.0.0.1:" + std::to_string(upstream_port)},
                          {"model",
                           {{"architecture", "llama"},
                            {"layers", 1},
                            {"kv_heads", 1},
                            {"head_dim", 1},
                            {"dtype", "fp32"},
                            {"weights", "none"}}}}}},
                       {"logging", {{"level", "warn"}}}};
  test::write_file(dir / "policy.json", policy.dump());
  test::ChildProcess kvrelay({test::kvrelay_binary().string(), "serve", "--config", (dir / "policy.json").string(),
                              "--ready-file", (dir / "ready.json").string(), "--io-threads", "1"},
                             dir.path());
  test::wait_until([&] { return std::filesystem::exists(dir / "ready.json"); }, std::chrono::seconds(10));
  const auto kvrelay_port = json::parse(test::read_file(dir / "ready.json"))["http"].get<std::uint16_t>();
  std::fprintf(stderr, "kvrelay pid %d\n", static_cast<int>(kvrelay.pid()));

  std::unique_ptr<test::ChildProcess> nginx;
  std::uint16_t nginx_port = 0;
  if (const auto nginx_binary = find_nginx()) {
    nginx_port = free_port();
    const std::string conf =
        "worker_processes 1;\npid " + (dir / "nginx.pid").string() + ";\nerror_log " + (dir / "nginx.err").string() +
        " warn;\nevents { worker_connections 1024; }\nhttp {\n  access_log off;\n"
        "  keepalive_requests 1000000;\n  client_body_temp_path " +
        dir.path().string() + ";\n  proxy_temp_path " + dir.path().string() +
        ";\n  server {\n    listen 127.0.0.1:" + std::to_string(nginx_port) +
        ";\n    location /agents/a/ {\n      proxy_pass http://127.0.0.1:" + std::to_string(upstream_port) +
        "/;\n      proxy_buffering off;\n    }\n  }\n}\n";
    test::write_file(dir / "nginx.conf", conf);
    nginx = std::make_unique<test::ChildProcess>(
        std::vector<std::string>{nginx_binary->string(), "-c", (dir / "nginx.conf").string(), "-g", "daemon off;"},
        dir.path());
    test::wait_until([&] { return test::http_request(nginx_port, "GET", "/agents/a/v1/models").status == 200; },
                     std::chrono::seconds(5));
  }

  const std::string small_body = R"({"prompt":[1,2,3,4,5,6,7,8],"max_tokens":3})";
  const std::string stream_body = R"({"prompt":[1,2,3,4,5,6,7,8],"max_tokens":32,"stream":true})";
  const std::map<std::string, std::string> chunked = {{kChunkedHeader, "1"}};
  const std::string load_before = load_average();
  json report;
  for (const auto& [name, body, headers] : {std::tuple{"small", small_body, std::map<std::string, std::string>{}},
                                            std::tuple{"streaming", stream_body, std::map<std::string, std::string>{}},
                                            std::tuple{"streaming_chunked", stream_body, chunked}}) {
    if (!selected(name)) continue;
    std::vector<Endpoint> endpoints = {{"direct", upstream_port, "/v1/completions"},
                                       {"kvrelay", kvrelay_port, "/agents/a/v1/completions"}};
    if (nginx) endpoints.push_back({"nginx", nginx_port, "/agents/a/v1/completions"});
    json section = measure_in_turn(endpoints, body, headers);
    if (nginx) {
      section["kvrelay_over_nginx_rps"] =
          section["kvrelay"]["rps"].get<double>() / section["nginx"]["rps"].get<double>();
    }
    report[name] = section;
  }
  if (report.contains("small")) {
    const auto& small = report["small"];
    report["rps_direct"] = small["direct"]["rps"];
    report["rps_kvrelay"] = small["kvrelay"]["rps"];
    report["rps_nginx"] = nginx ? small["nginx"]["rps"] : json();
    report["added_p50_us"] =
        small["kvrelay"]["low_load_p50_us"].get<double>() - small["direct"]["low_load_p50_us"].get<double>();
    report["added_p50_us_nginx"] =
        nginx ? json(small["nginx"]["low_load_p50_us"].get<double>() - small["direct"]["low_load_p50_us"].get<double>())
              : json();
    report["kvrelay_over_nginx_rps"] =
        nginx ? json(small["kvrelay"]["rps"].get<double>() / small["nginx"]["rps"].get<double>()) : json();
  }
  report["config"] = {{"connections", kConnections},
                      {"run_ms", kRunTime.count()},
                      {"rounds", kRounds},
                      {"kvrelay_io_threads", 1},
                      {"nginx_workers", 1},
                      {"upstream", "in-process Beast server, one thread"},
                      {"stream_events", kStreamEvents + 1}};
  // The machine is shared: the load average around the run says how quiet it was.
  report["load_average_before"] = load_before;
  report["load_average_after"] = load_average();
  std::printf("%s\n", report.dump(2).c_str());

  kvrelay.send_signal(SIGTERM);
  (void)kvrelay.wait_for_exit(std::chrono::seconds(5));
  if (nginx) nginx->send_signal(SIGQUIT);
  upstream.stop_accepting();
  upstream_io.stop();
  upstream_thread.join();
  return 0;
}
