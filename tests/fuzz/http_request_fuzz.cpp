// Fuzzes the HTTP request path as the daemon configures it: Beast's parser with our header and
// body limits, then the admin router. Any input must parse, be rejected, or need more bytes —
// never crash — and every parsed request must get a response with a valid status.
#include <boost/asio/buffer.hpp>
#include <boost/beast/core/error.hpp>
#include <boost/beast/http/parser.hpp>
#include <boost/beast/http/string_body.hpp>

#include <cstddef>
#include <cstdint>
#include <cstdlib>

#include "kvrelay/proxy/admin_router.h"

namespace {

// With an admin token, so that the Authorization header's parsing is fuzzed too.
std::shared_ptr<const kvrelay::Policy> fuzz_policy() {
  auto policy = std::make_shared<kvrelay::Policy>();
  policy->admin.token_file = "fuzz.token";
  policy->admin.token = "fuzz-admin-token-0123456789";
  return policy;
}

const kvrelay::proxy::AdminRouter& router() {
  using namespace kvrelay::proxy;
  static const AdminRouter instance(
      {
          {http::verb::get, Access::kPublic, "/healthz", "liveness",
           [](const HttpRequest& r) { return make_json_response(http::status::ok, "{}", r); }},
          {http::verb::put, Access::kMutate, "/admin/routes/*", "route",
           [](const HttpRequest& r) { return make_json_response(http::status::ok, r.body(), r); }},
      },
      [policy = fuzz_policy()] { return policy; });
  return instance;
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
  namespace http = boost::beast::http;
  http::request_parser<http::string_body> parser;
  parser.header_limit(2048);
  parser.body_limit(4096);
  parser.eager(true);
  boost::beast::error_code ec;
  std::size_t offset = 0;
  while (offset < size && !parser.is_done()) {
    const auto used = parser.put(boost::asio::buffer(data + offset, size - offset), ec);
    if (ec == http::error::need_more) break;
    if (ec) return 0;  // rejected: what the server turns into 400/413/431
    if (used == 0) break;
    offset += used;
  }
  if (!parser.is_done()) return 0;
  const auto response = router().handle(parser.get());
  const auto status = response.result_int();
  if (status < 100 || status > 599) std::abort();
  return 0;
}
