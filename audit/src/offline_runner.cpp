#include "kvrelay/audit/offline_runner.h"

#include <boost/asio/connect.hpp>
#include <boost/asio/ip/tcp.hpp>
#include <boost/beast/core/flat_buffer.hpp>
#include <boost/beast/core/tcp_stream.hpp>
#include <boost/beast/http/buffer_body.hpp>
#include <boost/beast/http/parser.hpp>
#include <boost/beast/http/read.hpp>
#include <boost/beast/http/string_body.hpp>
#include <boost/beast/http/write.hpp>
#include <fmt/format.h>
#include <nlohmann/json.hpp>

#include <algorithm>
#include <array>
#include <chrono>
#include <fstream>
#include <random>
#include <sstream>

#include "kvrelay/core/policy.h"

namespace kvrelay::audit {

namespace {

namespace asio = boost::asio;
namespace beast = boost::beast;
namespace http = beast::http;
using nlohmann::json;
using RunnerClock = std::chrono::steady_clock;

struct AuditContext {
  std::vector<std::int64_t> prompt;
  std::vector<std::int64_t> a_followup;
  std::vector<std::int64_t> b_followup;
};

Result<std::vector<std::int64_t>> token_array(const json& object, const char* field, std::size_t line, bool required) {
  const auto found = object.find(field);
  if (found == object.end() || found->is_null()) {
    if (required)
      return fail(ErrorCode::kInvalidArgument, fmt::format("contexts line {}: field '{}' is missing", line, field));
    return std::vector<std::int64_t>{};
  }
  if (!found->is_array()) {
    return fail(ErrorCode::kInvalidArgument,
                fmt::format("contexts line {}: field '{}': expected an array of token ids", line, field));
  }
  std::vector<std::int64_t> tokens;
  for (const auto& token : *found) {
    if (!token.is_number_integer() || token.get<std::int64_t>() < 0) {
      return fail(ErrorCode::kInvalidArgument,
                  fmt::format("contexts line {}: field '{}': expected token ids (integers >= 0), got {}", line, field,
                              token.dump()));
    }
    tokens.push_back(token.get<std::int64_t>());
  }
  if (required && tokens.empty()) {
    return fail(ErrorCode::kInvalidArgument, fmt::format("contexts line {}: field '{}' is empty", line, field));
  }
  return tokens;
}

Result<std::vector<AuditContext>> read_contexts(const std::string& path) {
  std::ifstream file(path);
  if (!file) return fail(ErrorCode::kNotFound, fmt::format("{}: cannot open contexts file", path));
  std::vector<AuditContext> contexts;
  std::string line;
  std::size_t number = 0;
  while (std::getline(file, line)) {
    ++number;
    if (line.find_first_not_of(" \t\r") == std::string::npos) continue;
    const auto object = json::parse(line, nullptr, /*allow_exceptions=*/false);
    if (!object.is_object()) {
      return fail(ErrorCode::kInvalidArgument, fmt::format("contexts line {}: not a JSON object", number));
    }
    AuditContext context;
    KVRELAY_TRY(context.prompt, token_array(object, "prompt", number, true));
    KVRELAY_TRY(context.a_followup, token_array(object, "a_followup", number, false));
    KVRELAY_TRY(context.b_followup, token_array(object, "b_followup", number, false));
    contexts.push_back(std::move(context));
  }
  if (contexts.empty()) return fail(ErrorCode::kInvalidArgument, fmt::format("{}: no contexts", path));
  return contexts;
}

struct TimedResponse {
  unsigned status = 0;
  std::string body;
  double first_body_byte_ms = 0.0;
  double total_ms = 0.0;
};

// One POST on a fresh connection; the body is read as it streams so the first byte is timed.
Result<TimedResponse> post(const HttpUrl& base, const std::string& path, const std::string& body,
                           const std::string& request_id, std::chrono::milliseconds timeout) {
  try {
    asio::io_context io;
    beast::tcp_stream stream(io);
    stream.expires_after(timeout);
    asio::ip::tcp::resolver resolver(io);
    stream.connect(resolver.resolve(base.host, std::to_string(base.port)));
    http::request<http::string_body> request{http::verb::post, base.base_path + path, 11};
    request.set(http::field::host, fmt::format("{}:{}", base.host, base.port));
    request.set(http::field::content_type, "application/json");
    request.set("X-Request-Id", request_id);
    request.body() = body;
    request.prepare_payload();
    const auto started = RunnerClock::now();
    http::write(stream, request);
    beast::flat_buffer buffer;
    http::response_parser<http::buffer_body> parser;
    parser.body_limit(boost::none);
    http::read_header(stream, buffer, parser);
    TimedResponse response;
    response.status = parser.get().result_int();
    std::array<char, 16 * 1024> chunk{};
    while (!parser.is_done()) {
      parser.get().body().data = chunk.data();
      parser.get().body().size = chunk.size();
      beast::error_code ec;
      http::read_some(stream, buffer, parser, ec);
      if (ec == http::error::need_buffer) ec = {};
      if (ec) throw beast::system_error(ec);
      const std::size_t received = chunk.size() - parser.get().body().size;
      if (received > 0 && response.body.empty()) {
        response.first_body_byte_ms = std::chrono::duration<double, std::milli>(RunnerClock::now() - started).count();
      }
      response.body.append(chunk.data(), received);
    }
    response.total_ms = std::chrono::duration<double, std::milli>(RunnerClock::now() - started).count();
    beast::error_code ignored;
    stream.socket().shutdown(asio::ip::tcp::socket::shutdown_both, ignored);
    return response;
  } catch (const std::exception& error) {
    return fail(ErrorCode::kIo, fmt::format("POST {}{}: {}", base.to_string(), path, error.what()));
  }
}

// `prompt_tokens` (A's prompt length) lets the sidecar serve only A's prompt span for span "prompt".
json offline_treatment_json(const Treatment& treatment, std::size_t prompt_tokens) {
  return {{"name", treatment.name},
          {"medium", treatment.medium},
          {"span", span_name(treatment.span)},
          {"prompt_tokens", prompt_tokens}};
}

// The last SSE event that carries the worker's kvrelay stats.
json stream_stats(const std::string& body) {
  json stats;
  std::istringstream lines(body);
  std::string line;
  while (std::getline(lines, line)) {
    if (line.rfind("data: {", 0) != 0) continue;
    const auto event = json::parse(line.substr(6), nullptr, false);
    if (event.is_object() && event.contains("kvrelay")) stats = event["kvrelay"];
  }
  return stats;
}

Result<std::vector<Treatment>> resolve_treatments(const OfflineRunOptions& options) {
  const auto standard = standard_treatments(options.kv_medium);
  std::vector<Treatment> chosen;
  for (const auto& name : options.treatments) {
    const auto found = std::find_if(standard.begin(), standard.end(), [&](const auto& t) { return t.name == name; });
    if (found == standard.end()) {
      return fail(ErrorCode::kInvalidArgument, fmt::format("unknown treatment '{}' (T0, T1, T2, T3)", name));
    }
    chosen.push_back(*found);
  }
  if (std::none_of(chosen.begin(), chosen.end(), [](const auto& t) { return t.name == "T0"; })) {
    return fail(ErrorCode::kInvalidArgument, "the treatments must include the baseline T0");
  }
  return chosen;
}

}  // namespace

Result<TrialSet> run_offline_audit(const OfflineRunOptions& options) {
  const auto report_error = [](std::string message) -> Result<TrialSet> {
    return fail(ErrorCode::kInvalidArgument, std::move(message));
  };
  if (!is_known_medium(options.kv_medium) || options.kv_medium == "tokens" || options.kv_medium == kSummaryMedium) {
    return report_error(fmt::format("--kv-medium '{}' is not a KV medium", options.kv_medium));
  }
  auto treatments = resolve_treatments(options);
  if (!treatments) return treatments.error();
  auto contexts = read_contexts(options.contexts_file);
  if (!contexts) return contexts.error();
  if (options.sidecars.empty()) return report_error("no sidecar URL");
  std::vector<HttpUrl> sidecars;
  for (const auto& text : options.sidecars) {
    auto url = parse_http_url(text);
    if (!url) return report_error(fmt::format("--sidecar '{}': {}", text, url.error().message));
    sidecars.push_back(std::move(url).value());
  }
  const HttpUrl& sidecar_a = sidecars.front();
  const HttpUrl& sidecar_b = sidecars.back();
  const std::string route = options.route.empty() ? options.agent_a + "-to-" + options.agent_b : options.route;
  const auto timeout = std::chrono::milliseconds(static_cast<std::int64_t>(options.timeout_s * 1000.0));
  std::ofstream out(options.out, std::ios::trunc);
  if (!out) return report_error(fmt::format("{}: cannot write the trials file", options.out));

  std::mt19937_64 generator(options.seed);
  TrialSet trials;
  for (std::size_t index = 0; index < contexts.value().size(); ++index) {
    const auto& context = contexts.value()[index];
    for (std::size_t repeat = 0; repeat < options.repeats; ++repeat) {
      auto order = treatments.value();
      std::shuffle(order.begin(), order.end(), generator);
      const auto pair_id = fmt::format("c{}-r{}", index, repeat);
      for (const auto& treatment : order) {
        const auto request_base = fmt::format("audit-{}-{}-{}", options.seed, pair_id, treatment.name);
        std::vector<std::int64_t> a_prompt = context.prompt;
        a_prompt.insert(a_prompt.end(), context.a_followup.begin(), context.a_followup.end());
        const json a_body{
            {"prompt", a_prompt},
            {"max_tokens", options.a_max_tokens},
            {"temperature", 0},
            {"ignore_eos", true},
            {"kv_transfer_params", {{"kvrelay", {{"treatment", offline_treatment_json(treatment, a_prompt.size())}}}}}};
        auto a = post(sidecar_a, fmt::format("/agents/{}/v1/completions", options.agent_a), a_body.dump(),
                      request_base + "-a", timeout);
        if (!a) return a.error();
        if (a.value().status != 200) {
          return report_error(
              fmt::format("agent {} answered {}: {}", options.agent_a, a.value().status, a.value().body));
        }
        const auto a_response = json::parse(a.value().body, nullptr, false);
        const json* generated = nullptr;
        if (a_response.is_object() && a_response.contains("choices") && a_response["choices"].is_array() &&
            !a_response["choices"].empty() && a_response["choices"][0].contains("token_ids")) {
          generated = &a_response["choices"][0]["token_ids"];
        }
        if (generated == nullptr || !generated->is_array()) {
          return report_error(fmt::format("agent {}'s answer has no choices[0].token_ids (the runner needs token ids)",
                                          options.agent_a));
        }
        std::vector<std::int64_t> b_prompt = a_prompt;
        for (const auto& token : *generated) {
          if (token.is_number_integer()) b_prompt.push_back(token.get<std::int64_t>());
        }
        b_prompt.insert(b_prompt.end(), context.b_followup.begin(), context.b_followup.end());
        const json b_body{
            {"prompt", b_prompt},
            {"max_tokens", options.b_max_tokens},
            {"temperature", 0},
            {"ignore_eos", true},
            {"stream", true},
            {"kv_transfer_params", {{"kvrelay", {{"treatment", offline_treatment_json(treatment, a_prompt.size())}}}}}};
        auto b = post(sidecar_b, fmt::format("/agents/{}/v1/completions", options.agent_b), b_body.dump(),
                      request_base + "-b", timeout);
        if (!b) return b.error();
        if (b.value().status != 200) {
          return report_error(
              fmt::format("agent {} answered {}: {}", options.agent_b, b.value().status, b.value().body));
        }
        Trial trial;
        trial.route = route;
        trial.treatment = treatment.name;
        trial.medium = treatment.medium;
        trial.span = std::string(span_name(treatment.span));
        trial.context_tokens = b_prompt.size();
        trial.ttft_ms = b.value().first_body_byte_ms;
        trial.e2e_ms = b.value().total_ms;
        trial.pair_id = pair_id;
        trial.repeat = repeat;
        trial.request_id = request_base + "-b";
        trial.receiver_agent = options.agent_b;
        trial.sender_model = options.sender_model;
        trial.receiver_model = options.receiver_model;
        const auto stats = stream_stats(b.value().body);
        if (stats.is_object()) {
          if (stats.contains("cached_tokens") && stats["cached_tokens"].is_number_unsigned()) {
            trial.cached_tokens = stats["cached_tokens"].get<std::uint64_t>();
          }
        }
        out << trial_line(trial) << '\n';
        out.flush();
        trials.trials.push_back(std::move(trial));
      }
    }
  }
  return trials;
}

}  // namespace kvrelay::audit
