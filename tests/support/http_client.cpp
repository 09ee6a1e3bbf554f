#include "support/http_client.h"

#include <boost/asio/connect.hpp>
#include <boost/asio/io_context.hpp>
#include <boost/asio/ip/tcp.hpp>
#include <boost/asio/read.hpp>
#include <boost/asio/write.hpp>
#include <boost/beast/core/flat_buffer.hpp>
#include <boost/beast/core/tcp_stream.hpp>
#include <boost/beast/http.hpp>

#include <algorithm>
#include <cctype>

namespace kvrelay::test {

namespace asio = boost::asio;
namespace beast = boost::beast;
namespace http = beast::http;
using tcp = asio::ip::tcp;

HttpResult http_request(std::uint16_t port, const std::string& method, const std::string& target,
                        const std::string& body, const std::map<std::string, std::string>& headers,
                        std::chrono::milliseconds timeout) {
  HttpResult result;
  asio::io_context io;
  beast::tcp_stream stream(io);
  stream.expires_after(timeout);
  beast::error_code ec;
  stream.connect(tcp::endpoint(asio::ip::make_address("127.0.0.1"), port), ec);
  if (ec) {
    result.error = "connect: " + ec.message();
    return result;
  }
  http::request<http::string_body> request{http::string_to_verb(method), target, 11};
  request.set(http::field::host, "127.0.0.1");
  for (const auto& [name, value] : headers)
    request.set(name, value);
  request.body() = body;
  if (!body.empty() && headers.find("content-type") == headers.end()) {
    request.set(http::field::content_type, "application/json");
  }
  request.prepare_payload();
  request.keep_alive(false);

  bool done = false;
  http::async_write(stream, request, [&](beast::error_code write_ec, std::size_t) {
    if (write_ec) {
      result.error = "write: " + write_ec.message();
      done = true;
    }
  });
  beast::flat_buffer buffer;
  http::response_parser<http::string_body> parser;
  parser.body_limit(1ULL << 32);
  http::async_read(stream, buffer, parser, [&](beast::error_code read_ec, std::size_t) {
    if (read_ec) {
      if (result.error.empty()) result.error = "read: " + read_ec.message();
    } else {
      const auto& response = parser.get();
      result.status = static_cast<int>(response.result_int());
      result.body = response.body();
      for (const auto& field : response) {
        std::string name(field.name_string());
        std::transform(name.begin(), name.end(), name.begin(), [](unsigned char c) { return std::tolower(c); });
        result.headers[name] = std::string(field.value());
      }
    }
    done = true;
  });
  io.run();
  (void)done;
  return result;
}

std::string raw_exchange(std::uint16_t port, const std::string& bytes, std::chrono::milliseconds timeout) {
  asio::io_context io;
  beast::tcp_stream stream(io);
  stream.expires_after(timeout);
  beast::error_code ec;
  stream.connect(tcp::endpoint(asio::ip::make_address("127.0.0.1"), port), ec);
  if (ec) return {};
  std::string received;
  asio::async_write(stream, asio::buffer(bytes), [](beast::error_code, std::size_t) {});
  std::array<char, 4096> chunk{};
  std::function<void()> read_more = [&] {
    stream.async_read_some(asio::buffer(chunk), [&](beast::error_code read_ec, std::size_t n) {
      received.append(chunk.data(), n);
      if (!read_ec) read_more();
    });
  };
  read_more();
  io.run();
  return received;
}

}  // namespace kvrelay::test
