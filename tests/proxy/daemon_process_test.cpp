#include <boost/asio/connect.hpp>
#include <boost/asio/io_context.hpp>
#include <boost/asio/ip/tcp.hpp>
#include <boost/asio/write.hpp>
#include <nlohmann/json.hpp>

#include <array>
#include <string_view>

#include "support/daemon_fixture.h"

using namespace kvrelay::test;
using nlohmann::json;

TEST_CASE("daemon answers /healthz and /readyz and exits 0 on SIGTERM", "[proxy][process]") {
  DaemonUnderTest daemon(basic_daemon_policy());
  const auto health = http_request(daemon.http_port(), "GET", "/healthz");
  REQUIRE(health.status == 200);
  CHECK(json::parse(health.body)["status"] == "ok");
  CHECK(http_request(daemon.http_port(), "GET", "/readyz").status == 200);
  const auto version = json::parse(http_request(daemon.admin_port(), "GET", "/version").body);
  CHECK(version["node"] == "test-node");

  daemon.process().send_signal(SIGTERM);
  const auto status = daemon.process().wait_for_exit(std::chrono::seconds(10));
  REQUIRE(status.has_value());
  CHECK(*status == 0);
}

TEST_CASE("daemon serves admin on a separate listener when configured", "[proxy][process]") {
  auto policy = basic_daemon_policy();
  policy["listen"]["admin"] = "127.0.0.1:0";
  DaemonUnderTest daemon(policy);
  CHECK(daemon.admin_port() != daemon.http_port());
  CHECK(http_request(daemon.admin_port(), "GET", "/healthz").status == 200);
}

TEST_CASE("daemon rejects oversized headers with 431 and oversized bodies with 413", "[proxy][process]") {
  DaemonUnderTest daemon(basic_daemon_policy());
  const auto big_header =
      http_request(daemon.http_port(), "GET", "/healthz", "", {{"x-padding", std::string(4096, 'a')}});
  CHECK(big_header.status == 431);
  CHECK_THAT(big_header.body, Catch::Contains("header exceeds 2048 bytes"));

  // The 413 comes from Content-Length alone, before any body byte is read.
  const auto reply =
      raw_exchange(daemon.http_port(), "POST /healthz HTTP/1.1\r\nHost: x\r\nContent-Length: 1000000\r\n\r\n");
  CHECK_THAT(reply, Catch::StartsWith("HTTP/1.1 413"));
  CHECK_THAT(reply, Catch::Contains("body exceeds 4096 bytes"));
  CHECK(http_request(daemon.http_port(), "GET", "/healthz").status == 200);  // still serving
}

TEST_CASE("daemon answers malformed HTTP with 400 and a JSON error", "[proxy][process]") {
  DaemonUnderTest daemon(basic_daemon_policy());
  const auto reply = raw_exchange(daemon.http_port(), "GARBAGE\x01\x02 / HTTP/9\r\n\r\n");
  CHECK_THAT(reply, Catch::StartsWith("HTTP/1.1 400"));
  CHECK_THAT(reply, Catch::Contains("malformed HTTP request"));
  CHECK(http_request(daemon.http_port(), "GET", "/nope").status == 404);
  CHECK(http_request(daemon.http_port(), "GET", "/healthz").status == 200);
}

TEST_CASE("daemon cuts a slow client at its read deadline", "[proxy][process]") {
  DaemonUnderTest daemon(basic_daemon_policy());  // read_timeout_ms 500
  const auto started = std::chrono::steady_clock::now();
  // Half a request line, then silence: the daemon must close the connection, not wait forever.
  const auto reply = raw_exchange(daemon.http_port(), "GET /heal", std::chrono::seconds(5));
  const auto waited = std::chrono::steady_clock::now() - started;
  CHECK(reply.empty());
  CHECK(waited < std::chrono::seconds(4));
  CHECK(http_request(daemon.http_port(), "GET", "/healthz").status == 200);
}

TEST_CASE("daemon refuses to start on an invalid policy and names the pointer", "[proxy][process]") {
  TempDir dir;
  auto policy = basic_daemon_policy();
  policy["limits"]["read_timeout_ms"] = "soon";
  write_file(dir / "bad.json", policy.dump());
  const auto result =
      run_command({kvrelay_binary().string(), "serve", "--config", (dir / "bad.json").string()}, dir.path());
  CHECK(result.exit_status == 2);
  CHECK_THAT(result.err, Catch::Contains("/limits/read_timeout_ms: expected integer milliseconds"));
}

TEST_CASE("SIGTERM closes idle keep-alive connections instead of waiting for them", "[proxy][process]") {
  DaemonUnderTest daemon(basic_daemon_policy());
  // A client that sent one request and keeps the connection open without sending another.
  boost::asio::io_context io;
  boost::asio::ip::tcp::socket idle(io);
  idle.connect({boost::asio::ip::make_address("127.0.0.1"), daemon.http_port()});
  const std::string request = "GET /healthz HTTP/1.1\r\nHost: x\r\n\r\n";
  boost::asio::write(idle, boost::asio::buffer(request));
  std::array<char, 512> reply{};
  const auto received = idle.read_some(boost::asio::buffer(reply));
  REQUIRE(std::string_view(reply.data(), received).substr(0, 12) == "HTTP/1.1 200");

  daemon.process().send_signal(SIGTERM);
  const auto status = daemon.process().wait_for_exit(std::chrono::seconds(5));
  REQUIRE(status.has_value());  // well before the 20 s drain deadline
  CHECK(*status == 0);
  boost::system::error_code ec;
  (void)idle.read_some(boost::asio::buffer(reply), ec);
  CHECK(ec == boost::asio::error::eof);
}
