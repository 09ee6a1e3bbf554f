#pragma once

#include <boost/beast/http/message.hpp>
#include <boost/beast/http/string_body.hpp>

#include <string_view>

namespace kvrelay::proxy {

namespace http = boost::beast::http;

using HttpRequest = http::request<http::string_body>;
using HttpResponse = http::response<http::string_body>;

// Headers that describe one connection, not the message (RFC 9110 7.6.1): a proxy never forwards them.
[[nodiscard]] bool is_hop_by_hop(http::field field) noexcept;

// An OpenAI-style JSON error body: {"error": {"message": ..., "type": ..., "code": status}}.
[[nodiscard]] HttpResponse make_json_error(http::status status, std::string_view type, std::string_view message,
                                           unsigned version = 11, bool keep_alive = false);

[[nodiscard]] HttpResponse make_json_response(http::status status, std::string body, const HttpRequest& request);
[[nodiscard]] HttpResponse make_text_response(http::status status, std::string body, std::string_view content_type,
                                              const HttpRequest& request);

}  // namespace kvrelay::proxy
