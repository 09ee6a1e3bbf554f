#include <fmt/format.h>
#include <nlohmann/json.hpp>

#include <chrono>

#include "kvrelay/refworker/completion_server.h"

namespace kvrelay::refworker {

namespace {

HttpResponse respond(http::status status, std::string body, std::string_view content_type,
                     const HttpRequest& request) {
  HttpResponse response{status, request.version()};
  response.set(http::field::content_type, content_type);
  response.set(http::field::server, "kvrelay-refworker");
  response.keep_alive(request.keep_alive());
  response.body() = std::move(body);
  response.prepare_payload();
  return response;
}

HttpResponse models_response(const ServerContext& context, const HttpRequest& request) {
  const auto& fingerprint = context.model->fingerprint();
  const nlohmann::json body = {
      {"object", "list"},
      {"data", nlohmann::json::array({{{"id", context.model_name},
                                       {"object", "model"},
                                       {"created", 0},
                                       {"owned_by", "kvrelay-refworker"},
                                       {"max_model_len", context.model->config().seq_len},
                                       {"kvrelay",
                                        {{"architecture", fingerprint.architecture},
                                         {"layers", fingerprint.layers},
                                         {"kv_heads", fingerprint.kv_heads},
                                         {"head_dim", fingerprint.head_dim},
                                         {"dtype", std::string(dtype_name(fingerprint.dtype))},
                                         {"weights_identity", fingerprint.weights_identity},
                                         {"fingerprint_id", fmt::format("{:016x}", fingerprint.id())},
                                         {"shape", context.model->config().shape_string()}}}}})}};
  return respond(http::status::ok, body.dump() + "\n", "application/json", request);
}

}  // namespace

HttpResponse json_error(http::status status, std::string_view type, std::string_view message,
                        const HttpRequest& request) {
  const nlohmann::json body = {
      {"error", {{"message", message}, {"type", type}, {"code", static_cast<unsigned>(status)}}}};
  return respond(status, dump_json(body) + "\n", "application/json", request);
}

http::status status_for(const Error& error) {
  switch (error.code) {
    case ErrorCode::kResourceExhausted:
    case ErrorCode::kCancelled:
      return http::status::service_unavailable;
    case ErrorCode::kInvalidArgument:
    case ErrorCode::kOutOfRange:
      return http::status::bad_request;
    default:
      return http::status::internal_server_error;
  }
}

RouteResult route_request(ServerContext& context, const HttpRequest& request) {
  std::string_view target = request.target();
  target = target.substr(0, target.find('?'));
  const auto method = request.method();
  auto only = [&](http::verb allowed) -> std::optional<HttpResponse> {
    if (method == allowed) return std::nullopt;
    auto response = json_error(http::status::method_not_allowed, "method_not_allowed",
                               fmt::format("{} does not accept {}", target, std::string_view(request.method_string())),
                               request);
    response.set(http::field::allow, http::to_string(allowed));
    return response;
  };
  if (target == "/healthz" || target == "/health") {
    if (auto rejected = only(http::verb::get)) return *rejected;
    return respond(http::status::ok, "{\"status\":\"ok\"}\n", "application/json", request);
  }
  if (target == "/v1/models") {
    if (auto rejected = only(http::verb::get)) return *rejected;
    return models_response(context, request);
  }
  if (target == "/metrics") {
    if (auto rejected = only(http::verb::get)) return *rejected;
    return respond(http::status::ok, context.metrics->render(context.model_name), "text/plain; version=0.0.4",
                   request);
  }
  if (target == "/v1/completions") {
    if (auto rejected = only(http::verb::post)) return *rejected;
    auto parsed = parse_completion_request(request.body(), context.limits);
    if (!parsed) return json_error(status_for(parsed.error()), "invalid_request_error", parsed.error().message, request);
    if (!parsed.value().model.empty() && parsed.value().model != context.model_name) {
      return json_error(http::status::not_found, "model_not_found",
                        fmt::format("model '{}' is not served here (this worker serves '{}')", parsed.value().model,
                                    context.model_name),
                        request);
    }
    PendingCompletion pending;
    pending.request = std::move(parsed.value());
    pending.identity.id = fmt::format("cmpl-{}", context.next_request.fetch_add(1));
    pending.identity.created = std::chrono::duration_cast<std::chrono::seconds>(
                                   std::chrono::system_clock::now().time_since_epoch())
                                   .count();
    pending.identity.model = context.model_name;
    return pending;
  }
  return json_error(http::status::not_found, "not_found", fmt::format("no route for {}", target), request);
}

}  // namespace kvrelay::refworker
