#include "kvrelay/proxy/http_types.h"

#include <nlohmann/json.hpp>

namespace kvrelay::proxy {

bool is_hop_by_hop(http::field field) noexcept {
  switch (field) {
    case http::field::connection:
    case http::field::keep_alive:
    case http::field::proxy_authenticate:
    case http::field::proxy_authorization:
    case http::field::proxy_connection:
    case http::field::te:
    case http::field::trailer:
    case http::field::transfer_encoding:
    case http::field::upgrade:
      return true;
    default:
      return false;
  }
}

HttpResponse make_json_error(http::status status, std::string_view type, std::string_view message, unsigned version,
                             bool keep_alive) {
  nlohmann::json body;
  body["error"] = {{"message", message}, {"type", type}, {"code", static_cast<unsigned>(status)}};
  HttpResponse response{status, version};
  response.set(http::field::content_type, "application/json");
  response.set(http::field::server, "kvrelay");
  response.keep_alive(keep_alive);
  // Messages quote request bytes (paths, route ids) that need not be UTF-8: replace those
  // instead of letting dump() throw (fuzz_http_request found a path with 0xFF in it).
  response.body() = body.dump(-1, ' ', false, nlohmann::json::error_handler_t::replace);
  response.body() += '\n';
  response.prepare_payload();
  return response;
}

HttpResponse make_json_response(http::status status, std::string body, const HttpRequest& request) {
  return make_text_response(status, std::move(body), "application/json", request);
}

HttpResponse make_text_response(http::status status, std::string body, std::string_view content_type,
                                const HttpRequest& request) {
  HttpResponse response{status, request.version()};
  response.set(http::field::content_type, content_type);
  response.set(http::field::server, "kvrelay");
  response.keep_alive(request.keep_alive());
  response.body() = std::move(body);
  response.prepare_payload();
  return response;
}

}  // namespace kvrelay::proxy
