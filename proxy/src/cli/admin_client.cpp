#include "admin_client.h"

#include <boost/asio/connect.hpp>
#include <boost/asio/io_context.hpp>
#include <boost/asio/ip/tcp.hpp>
#include <boost/beast/core.hpp>
#include <boost/beast/http.hpp>
#include <fmt/format.h>

#include <cerrno>
#include <cstring>
#include <fstream>
#include <sstream>

#include "kvrelay/proxy/version.h"

namespace kvrelay::cli {

namespace {

namespace beast = boost::beast;
namespace beast_http = boost::beast::http;
using tcp = boost::asio::ip::tcp;

// Large enough for GET /admin/decisions?limit=1024 with every cost breakdown and for the audit
// report's SVG; a reply past it is cut off and reported, never half-printed.
constexpr std::uint64_t kMaxAdminReplyBytes = std::uint64_t{256} << 20;

bool is_unreserved(char c) {
  return (c >= 'A' && c <= 'Z') || (c >= 'a' && c <= 'z') || (c >= '0' && c <= '9') || c == '-' || c == '.' ||
         c == '_' || c == '~';
}

std::string_view trim_whitespace(std::string_view text) {
  constexpr std::string_view kWhitespace = " \t\r\n";
  const auto first = text.find_first_not_of(kWhitespace);
  if (first == std::string_view::npos) return {};
  const auto last = text.find_last_not_of(kWhitespace);
  return text.substr(first, last - first + 1);
}

}  // namespace

Result<AdminAddress> parse_admin_address(std::string_view url) {
  const std::string quoted = fmt::format("'{}'", url);
  std::string_view rest = url;
  if (const auto scheme = rest.find("://"); scheme != std::string_view::npos) {
    const auto name = rest.substr(0, scheme);
    if (name == "https") {
      return fail(ErrorCode::kUnsupported,
                  fmt::format("--admin {}: the admin listener speaks plain HTTP (bind it to loopback or a management "
                              "network); use http://",
                              quoted));
    }
    if (name != "http") {
      return fail(ErrorCode::kInvalidArgument, fmt::format("--admin {}: expected http://HOST:PORT", quoted));
    }
    rest.remove_prefix(scheme + 3);
  }
  AdminAddress address;
  const auto slash = rest.find('/');
  const auto authority = rest.substr(0, slash);
  if (slash != std::string_view::npos) {
    auto path = rest.substr(slash);
    if (path.find_first_of("?#") != std::string_view::npos) {
      return fail(ErrorCode::kInvalidArgument,
                  fmt::format("--admin {}: expected http://HOST:PORT[/PREFIX] without a query", quoted));
    }
    while (!path.empty() && path.back() == '/')
      path.remove_suffix(1);
    address.base_path = std::string(path);
  }
  std::string_view port = "80";
  if (authority.starts_with('[')) {  // [IPv6]:port
    const auto close = authority.find(']');
    if (close == std::string_view::npos) {
      return fail(ErrorCode::kInvalidArgument, fmt::format("--admin {}: unclosed '[' in the host", quoted));
    }
    address.host = std::string(authority.substr(1, close - 1));
    const auto after = authority.substr(close + 1);
    if (!after.empty()) {
      if (!after.starts_with(':')) {
        return fail(ErrorCode::kInvalidArgument, fmt::format("--admin {}: expected ':' after ']'", quoted));
      }
      port = after.substr(1);
    }
  } else {
    const auto colon = authority.rfind(':');
    address.host = std::string(authority.substr(0, colon));
    if (colon != std::string_view::npos) port = authority.substr(colon + 1);
  }
  if (address.host.empty()) return fail(ErrorCode::kInvalidArgument, fmt::format("--admin {}: no host", quoted));
  unsigned port_number = 0;
  for (const char c : port) {
    if (c < '0' || c > '9' || port_number > 65535) {
      port_number = 0;
      break;
    }
    port_number = port_number * 10 + static_cast<unsigned>(c - '0');
  }
  if (port_number == 0 || port_number > 65535) {
    return fail(ErrorCode::kInvalidArgument,
                fmt::format("--admin {}: port: expected 1..65535, got '{}'", quoted, port));
  }
  address.port = std::to_string(port_number);
  return address;
}

Result<std::string> read_admin_token(const std::filesystem::path& path) {
  std::ifstream file(path, std::ios::binary);
  if (!file) {
    return fail(ErrorCode::kIo, fmt::format("cannot read the token file {}: {}", path.string(), std::strerror(errno)));
  }
  std::string line;
  std::getline(file, line);
  const auto token = trim_whitespace(line);
  if (token.empty()) {
    return fail(ErrorCode::kInvalidArgument, fmt::format("the token file {} is empty", path.string()));
  }
  return std::string(token);
}

std::string percent_encode(std::string_view text) {
  std::string out;
  out.reserve(text.size());
  for (const char c : text) {
    if (is_unreserved(c)) {
      out.push_back(c);
    } else {
      out += fmt::format("%{:02X}", static_cast<unsigned>(static_cast<unsigned char>(c)));
    }
  }
  return out;
}

Result<AdminReply> send_admin_request(const AdminConnection& connection, std::string_view method,
                                      std::string_view target, std::string body) {
  const auto verb = beast_http::string_to_verb(method);
  if (verb == beast_http::verb::unknown) {
    return fail(ErrorCode::kInvalidArgument, fmt::format("unknown HTTP method '{}'", method));
  }
  const AdminAddress& address = connection.address;
  beast_http::request<beast_http::string_body> request{verb, address.base_path + std::string(target), 11};
  request.set(beast_http::field::host, address.host + ":" + address.port);
  request.set(beast_http::field::user_agent, std::string("kvrelay-admin/") + proxy::kVersion);
  request.set(beast_http::field::accept, "application/json, text/markdown, image/svg+xml");
  if (!connection.token.empty()) request.set(beast_http::field::authorization, "Bearer " + connection.token);
  if (!body.empty()) request.set(beast_http::field::content_type, "application/json");
  request.body() = std::move(body);
  request.keep_alive(false);
  request.prepare_payload();

  // The exchange runs as one chain of asynchronous steps on a private io_context, so that one
  // deadline bounds all of it (a blocking socket read would wait forever on a silent daemon).
  boost::asio::io_context io;
  tcp::resolver resolver(io);
  beast::tcp_stream stream(io);
  beast::flat_buffer buffer;
  beast_http::response_parser<beast_http::string_body> parser;
  parser.body_limit(kMaxAdminReplyBytes);
  boost::system::error_code failure;
  std::string_view failed_step;
  bool finished = false;
  const auto finish = [&](const boost::system::error_code& error, std::string_view step) {
    failure = error;
    failed_step = error ? step : std::string_view();
    finished = true;
  };
  resolver.async_resolve(
      address.host, address.port,
      [&](const boost::system::error_code& resolve_error, const tcp::resolver::results_type& endpoints) {
        if (resolve_error) return finish(resolve_error, "resolve");
        stream.async_connect(endpoints, [&](const boost::system::error_code& connect_error, const tcp::endpoint&) {
          if (connect_error) return finish(connect_error, "connect to");
          beast_http::async_write(stream, request, [&](const boost::system::error_code& write_error, std::size_t) {
            if (write_error) return finish(write_error, "send the request to");
            beast_http::async_read(stream, buffer, parser,
                                   [&](const boost::system::error_code& read_error, std::size_t) {
                                     finish(read_error, "read the answer from");
                                   });
          });
        });
      });
  io.run_for(connection.timeout);
  if (!finished) {
    resolver.cancel();
    boost::system::error_code ignored;
    stream.socket().close(ignored);
    io.restart();
    io.run();  // the cancelled steps' handlers, which refer to this frame
    return fail(ErrorCode::kTimeout,
                fmt::format("no answer from the admin API at {} within {:.3g} s", address.to_string(),
                            std::chrono::duration<double>(connection.timeout).count()));
  }
  if (failure) {
    return fail(failure == beast_http::error::body_limit ? ErrorCode::kResourceExhausted : ErrorCode::kIo,
                fmt::format("cannot {} the admin API at {}: {}", failed_step, address.to_string(), failure.message()));
  }
  boost::system::error_code ignored;
  stream.socket().shutdown(tcp::socket::shutdown_both, ignored);
  auto response = parser.release();
  AdminReply reply;
  reply.status = response.result_int();
  reply.content_type = std::string(response[beast_http::field::content_type]);
  reply.body = std::move(response.body());
  return reply;
}

}  // namespace kvrelay::cli
