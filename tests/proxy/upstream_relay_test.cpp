// The relay against upstreams that misbehave in ways a real worker can: stalling before or in the
// middle of a response, or ending a body by closing the connection.
#include <boost/asio/io_context.hpp>
#include <boost/asio/ip/tcp.hpp>
#include <boost/asio/read.hpp>
#include <boost/asio/read_until.hpp>
#include <boost/asio/write.hpp>
#include <nlohmann/json.hpp>

#include <memory>
#include <sstream>
#include <thread>

#include "support/daemon_fixture.h"

using namespace kvrelay::test;
using nlohmann::json;
namespace asio = boost::asio;
using tcp = asio::ip::tcp;

namespace {

// A one-connection upstream: reads one request, writes `reply` and then closes the connection
// or, with hold_open, keeps it open and silent until the test ends.
class ScriptedUpstream {
 public:
  ScriptedUpstream(std::string reply, bool hold_open) : reply_(std::move(reply)), hold_open_(hold_open) {
    acceptor_.async_accept([this](boost::system::error_code ec, tcp::socket socket) {
      if (ec) return;
      socket_ = std::make_unique<tcp::socket>(std::move(socket));
      asio::async_read_until(
          *socket_, asio::dynamic_buffer(request_), "\r\n\r\n", [this](boost::system::error_code read_ec, std::size_t) {
            if (read_ec) return;
            asio::async_write(*socket_, asio::buffer(reply_), [this](boost::system::error_code, std::size_t) {
              if (!hold_open_) socket_->close();
            });
          });
    });
    thread_ = std::thread([this] { io_.run(); });
  }
  ~ScriptedUpstream() {
    io_.stop();
    thread_.join();
  }
  ScriptedUpstream(const ScriptedUpstream&) = delete;
  ScriptedUpstream& operator=(const ScriptedUpstream&) = delete;

  [[nodiscard]] std::uint16_t port() const { return acceptor_.local_endpoint().port(); }

 private:
  std::string reply_;
  bool hold_open_;
  asio::io_context io_;
  tcp::acceptor acceptor_{io_, {asio::ip::make_address("127.0.0.1"), 0}};
  std::unique_ptr<tcp::socket> socket_;
  std::string request_;
  std::thread thread_;
};

json relay_policy(std::uint16_t upstream_port) {
  auto policy = basic_daemon_policy();
  policy["limits"]["upstream_timeout_ms"] = 300;
  policy["agents"] = {{{"id", "a"},
                       {"upstream", "http://127.0.0.1:" + std::to_string(upstream_port)},
                       {"model",
                        {{"architecture", "llama"},
                         {"layers", 1},
                         {"kv_heads", 1},
                         {"head_dim", 1},
                         {"dtype", "fp32"},
                         {"weights", "w"}}}}};
  return policy;
}

// One chunk of chunked transfer encoding.
std::string chunk(const std::string& data) {
  std::ostringstream framed;
  framed << std::hex << data.size() << "\r\n" << data << "\r\n";
  return framed.str();
}

std::string completion_request(std::string_view body) {
  return "POST /agents/a/v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nContent-Length: " +
         std::to_string(body.size()) + "\r\n\r\n" + std::string(body);
}

bool upstream_timeouts_counted(std::uint16_t port) {
  return wait_until(
      [&] {
        return http_request(port, "GET", "/metrics")
                   .body.find("kvrelay_proxy_upstream_errors_total{agent=\"a\",kind=\"timeout\"} 1") !=
               std::string::npos;
      },
      std::chrono::seconds(5));
}

}  // namespace

TEST_CASE("an upstream silent after the request gets the client a 504 at the upstream deadline",
          "[proxy][relay][process][fault]") {
  ScriptedUpstream upstream("", /*hold_open=*/true);
  DaemonUnderTest daemon(relay_policy(upstream.port()));
  const auto reply = http_request(daemon.http_port(), "POST", "/agents/a/v1/completions", R"({"prompt":[1]})");
  CHECK(reply.status == 504);
  CHECK(json::parse(reply.body)["error"]["type"] == "upstream_error");
  CHECK(upstream_timeouts_counted(daemon.admin_port()));
}

TEST_CASE("an upstream stalling mid-stream: the events sent so far arrive, then the connection closes",
          "[proxy][relay][process][fault]") {
  const std::string first_event = "data: {\"text\":\"first\"}\n\n";
  ScriptedUpstream upstream(
      "HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\nTransfer-Encoding: chunked\r\n\r\n" + chunk(first_event),
      /*hold_open=*/true);
  DaemonUnderTest daemon(relay_policy(upstream.port()));
  // raw_exchange reads until kvrelay closes the connection, which only the deadline makes it do.
  const auto received =
      raw_exchange(daemon.http_port(), completion_request(R"({"prompt":[1],"stream":true})"), std::chrono::seconds(10));
  CHECK(received.rfind("HTTP/1.1 200", 0) == 0);
  CHECK(received.find("Transfer-Encoding: chunked\r\n") != std::string::npos);
  CHECK(received.find("\r\n\r\n" + chunk(first_event)) != std::string::npos);
  CHECK(received.find("\r\n0\r\n\r\n") == std::string::npos);  // never claims the stream ended
  CHECK(upstream_timeouts_counted(daemon.admin_port()));
}

TEST_CASE("a body the upstream ends by closing is relayed whole, chunked", "[proxy][relay][process]") {
  std::string events;
  for (int index = 0; index < 50; ++index)
    events += "data: {\"token\":" + std::to_string(index) + "}\n\n";
  ScriptedUpstream upstream("HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\nConnection: close\r\n\r\n" + events,
                            /*hold_open=*/false);
  DaemonUnderTest daemon(relay_policy(upstream.port()));
  const auto reply = http_request(daemon.http_port(), "POST", "/agents/a/v1/completions", R"({"prompt":[1]})");
  CHECK(reply.status == 200);
  CHECK(reply.headers.at("transfer-encoding") == "chunked");
  CHECK(reply.body == events);
}
