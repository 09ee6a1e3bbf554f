#include "kv_admin.h"

#include <fmt/format.h>
#include <nlohmann/json.hpp>

#include <charconv>
#include <chrono>
#include <optional>
#include <string>

namespace kvrelay::proxy {

namespace {

// limit=N from the query string; N in 1..capacity.
Result<std::size_t> parse_limit(std::string_view target, std::size_t capacity,
                                std::size_t default_limit = kDefaultDecisionLimit) {
  const auto query_start = target.find('?');
  if (query_start == std::string_view::npos) return std::min(default_limit, capacity);
  std::string_view query = target.substr(query_start + 1);
  while (!query.empty()) {
    const auto amp = query.find('&');
    const auto pair = query.substr(0, amp);
    query = amp == std::string_view::npos ? std::string_view() : query.substr(amp + 1);
    if (!pair.starts_with("limit=")) {
      return fail(ErrorCode::kInvalidArgument, fmt::format("unknown query parameter '{}' (allowed: limit)", pair));
    }
    const auto text = pair.substr(6);
    std::size_t limit = 0;
    const auto [end, ec] = std::from_chars(text.data(), text.data() + text.size(), limit);
    if (ec != std::errc() || end != text.data() + text.size() || limit == 0 || limit > capacity) {
      return fail(ErrorCode::kInvalidArgument,
                  fmt::format("limit: expected an integer 1..{}, got '{}'", capacity, text));
    }
    return limit;
  }
  return std::min(default_limit, capacity);
}

// A query value with its %XX escapes and '+' (a space) decoded, as a browser or `kvrelay admin`
// encodes it; nullopt for a malformed escape.
std::optional<std::string> decode_query_value(std::string_view text) {
  std::string out;
  out.reserve(text.size());
  const auto hex_digit = [](char c) -> int {
    if (c >= '0' && c <= '9') return c - '0';
    if (c >= 'a' && c <= 'f') return c - 'a' + 10;
    if (c >= 'A' && c <= 'F') return c - 'A' + 10;
    return -1;
  };
  for (std::size_t index = 0; index < text.size(); ++index) {
    const char c = text[index];
    if (c == '+') {
      out.push_back(' ');
    } else if (c != '%') {
      out.push_back(c);
    } else {
      if (index + 2 >= text.size()) return std::nullopt;
      const int high = hex_digit(text[index + 1]);
      const int low = hex_digit(text[index + 2]);
      if (high < 0 || low < 0) return std::nullopt;
      out.push_back(static_cast<char>(high * 16 + low));
      index += 2;
    }
  }
  return out;
}

// GET /admin/decisions' query: limit=N (1..capacity; default 50, with since= every decision
// after it), since=SEQ, route=ID.
Result<broker::DecisionLog::Query> parse_decision_query(std::string_view target, std::size_t capacity) {
  broker::DecisionLog::Query parsed;
  std::optional<std::size_t> limit;
  const auto query_start = target.find('?');
  std::string_view query = query_start == std::string_view::npos ? std::string_view() : target.substr(query_start + 1);
  while (!query.empty()) {
    const auto amp = query.find('&');
    const auto pair = query.substr(0, amp);
    query = amp == std::string_view::npos ? std::string_view() : query.substr(amp + 1);
    if (pair.empty()) continue;
    const auto equals = pair.find('=');
    const auto name = pair.substr(0, equals);
    const auto text = equals == std::string_view::npos ? std::string_view() : pair.substr(equals + 1);
    if (name == "limit" || name == "since") {
      std::uint64_t value = 0;
      const auto [end, ec] = std::from_chars(text.data(), text.data() + text.size(), value);
      const bool parsed_whole = !text.empty() && ec == std::errc() && end == text.data() + text.size();
      if (name == "limit") {
        if (!parsed_whole || value == 0 || value > capacity) {
          return fail(ErrorCode::kInvalidArgument,
                      fmt::format("limit: expected an integer 1..{}, got '{}'", capacity, text));
        }
        limit = static_cast<std::size_t>(value);
      } else {
        if (!parsed_whole) {
          return fail(
              ErrorCode::kInvalidArgument,
              fmt::format("since: expected a sequence number (the cursor of an earlier answer), got '{}'", text));
        }
        parsed.since = value;
      }
    } else if (name == "route") {
      auto route = decode_query_value(text);
      if (!route || route->empty()) {
        return fail(ErrorCode::kInvalidArgument, fmt::format("route: expected a route id, got '{}'", text));
      }
      parsed.route = std::move(*route);
    } else {
      return fail(ErrorCode::kInvalidArgument,
                  fmt::format("unknown query parameter '{}' (allowed: limit, since, route)", pair));
    }
  }
  parsed.limit = limit.value_or(parsed.since ? capacity : std::min(kDefaultDecisionLimit, capacity));
  return parsed;
}

// A 64-bit id as GET /admin/kv prints it: 1 to 16 hex digits.
std::optional<std::uint64_t> parse_hex64(std::string_view text) {
  std::uint64_t value = 0;
  const auto [end, ec] = std::from_chars(text.data(), text.data() + text.size(), value, 16);
  if (text.empty() || text.size() > 16 || ec != std::errc() || end != text.data() + text.size()) return std::nullopt;
  return value;
}

// GET /admin/kv/sample's query: key=HEX (the context hash) and model=HEX, both optional.
struct SampleQuery {
  std::optional<std::uint64_t> key;
  std::optional<std::uint64_t> model;
};

Result<SampleQuery> parse_sample_query(std::string_view target) {
  SampleQuery parsed;
  const auto query_start = target.find('?');
  if (query_start == std::string_view::npos) return parsed;
  std::string_view query = target.substr(query_start + 1);
  while (!query.empty()) {
    const auto amp = query.find('&');
    const auto pair = query.substr(0, amp);
    query = amp == std::string_view::npos ? std::string_view() : query.substr(amp + 1);
    const auto equals = pair.find('=');
    const auto name = pair.substr(0, equals);
    const auto text = equals == std::string_view::npos ? std::string_view() : pair.substr(equals + 1);
    if (name != "key" && name != "model") {
      return fail(ErrorCode::kInvalidArgument, fmt::format("unknown query parameter '{}' (allowed: key, model)", pair));
    }
    auto& slot = name == "key" ? parsed.key : parsed.model;
    slot = parse_hex64(text);
    if (!slot) {
      return fail(ErrorCode::kInvalidArgument,
                  fmt::format("{}: expected 1 to 16 hex digits as GET /admin/kv lists them, got '{}'", name, text));
    }
  }
  if (parsed.model && !parsed.key) return fail(ErrorCode::kInvalidArgument, "model= needs key=");
  return parsed;
}

bool holds_exact_kv(const kv_store::StoredEntry& entry) {
  return entry.info.layout.layers != 0 && entry.fidelity.is_exact();
}

// GET /admin/kv/sample: one entry's KV bytes as `kvrelay codec eval` reads them.
HttpResponse kv_sample(kv_store::EntryStore& store, const HttpRequest& request) {
  const auto error = [&request](http::status status, std::string_view type, const std::string& message) {
    return make_json_error(status, type, message, request.version(), request.keep_alive());
  };
  const auto query = parse_sample_query(request.target());
  if (!query) return error(http::status::bad_request, "invalid_argument", query.error().message);
  std::optional<kv_store::EntryKey> key;
  if (!query.value().key) {
    const auto recent = store.recent_keys(1, holds_exact_kv);
    if (recent.empty()) {
      return error(http::status::not_found, "not_found",
                   "no KV entry to sample: this sidecar holds no entry of exact KV (publish one first)");
    }
    key = recent.front();
  } else if (query.value().model) {
    key = kv_store::EntryKey{*query.value().model, *query.value().key};
  } else {
    // key= alone: the entry of any model filed under that context hash.
    std::vector<kv_store::EntryKey> matches;
    for (const auto& held : store.recent_keys(store.stats().entries, {}))
      if (held.context_hash == *query.value().key) matches.push_back(held);
    if (matches.size() > 1) {
      std::string models;
      for (const auto& match : matches)
        models += fmt::format("{}{:016x}", models.empty() ? "" : ", ", match.model_id);
      return error(http::status::bad_request, "invalid_argument",
                   fmt::format("key {:016x} is filed under models {}: add model=", *query.value().key, models));
    }
    if (!matches.empty()) key = matches.front();
  }
  // A read of the entry like any other: it counts as a use (hits, recency).
  const auto entry = key ? store.get(*key) : nullptr;
  if (!entry) {
    const std::uint64_t asked = key ? key->context_hash : query.value().key.value_or(0);
    return error(http::status::not_found, "not_found",
                 fmt::format("no entry under key {:016x}{} (GET /admin/kv lists the keys)", asked,
                             key ? fmt::format(" of model {:016x}", key->model_id) : ""));
  }
  const KvLayout& layout = entry->info.layout;
  if (layout.layers == 0) {
    return error(http::status::conflict, "not_kv",
                 fmt::format("entry {:016x} is an opaque blob without a KV layout", key->context_hash));
  }
  if (entry->info.bytes > kMaxKvSampleBytes) {
    return error(http::status::payload_too_large, "too_large",
                 fmt::format("entry {:016x} holds {} bytes, above the sample limit of {}", key->context_hash,
                             entry->info.bytes, kMaxKvSampleBytes));
  }
  const auto view = kv_store::view_entry(*entry);
  if (!view) return error(http::status::internal_server_error, "internal", view.error().message);
  const auto bytes = view.value().bytes();
  auto response =
      make_text_response(http::status::ok, std::string(reinterpret_cast<const char*>(bytes.data()), bytes.size()),
                         "application/octet-stream", request);
  response.set("X-Kvrelay-Layout",
               fmt::format("{},{},{},{}", layout.layers, layout.kv_heads, layout.head_dim, dtype_name(layout.dtype)));
  response.set("X-Kvrelay-Tokens", std::to_string(layout.tokens));
  response.set("X-Kvrelay-Model", fmt::format("{:016x}", key->model_id));
  response.set("X-Kvrelay-Key", fmt::format("{:016x}", key->context_hash));
  response.set("X-Kvrelay-Fidelity",
               entry->fidelity.is_exact() ? std::string("exact") : "lossy:" + entry->fidelity.lossy_codec);
  return response;
}

nlohmann::json listing_fidelity(const Fidelity& fidelity) {
  if (fidelity.is_exact()) return "exact";
  return {
      {"lossy_codec", fidelity.lossy_codec}, {"exact_tokens", fidelity.exact_tokens}, {"product", fidelity.product}};
}

}  // namespace

nlohmann::json kv_store_json(kv_store::EntryStore& store, std::size_t limit) {
  const auto stats = store.stats();
  nlohmann::json top = nlohmann::json::array();
  for (const auto& entry : store.top(limit)) {
    top.push_back({{"model_id", fmt::format("{:016x}", entry.key.model_id)},
                   {"key", fmt::format("{:016x}", entry.key.context_hash)},
                   {"bytes", entry.bytes},
                   {"tokens", entry.tokens},
                   {"hits", entry.hits},
                   {"utility", entry.utility ? nlohmann::json(*entry.utility) : nlohmann::json()},
                   {"fidelity", listing_fidelity(entry.fidelity)},
                   {"origin", std::string(kv_store::entry_origin_name(entry.origin))}});
  }
  nlohmann::json stubs = nlohmann::json::array();
  for (const auto& stub : store.stubs(limit)) {
    stubs.push_back({{"model_id", fmt::format("{:016x}", stub.key.model_id)},
                     {"key", fmt::format("{:016x}", stub.key.context_hash)},
                     {"peer", stub.in_flight ? nlohmann::json() : nlohmann::json(stub.peer)},
                     {"in_flight", stub.in_flight},
                     {"codec", stub.codec},
                     {"bytes", stub.bytes},
                     {"tokens", stub.tokens},
                     {"fidelity", listing_fidelity(stub.fidelity)}});
  }
  return {
      {"eviction", std::string(stats.eviction_policy)},
      {"budget_bytes", stats.budget},
      {"used_bytes", stats.bytes},
      {"entries", stats.entries},
      {"evictions", {{"total", stats.evictions}, {"budget", stats.budget_evictions}, {"arena", stats.arena_evictions}}},
      {"refused_downgrades", stats.refused_downgrades},
      {"spill",
       {{"stubs", stats.stubs},
        {"spilling_bytes", stats.spilling_bytes},
        {"spills", stats.spills},
        {"failures", stats.spill_failures},
        {"spilled_in_bytes", stats.spilled_in_bytes},
        {"spilled_in_entries", stats.spilled_in_entries}}},
      {"top", std::move(top)},
      {"stubs", std::move(stubs)}};
}

std::vector<AdminEndpoint> kv_admin_endpoints(std::shared_ptr<broker::KvPath> path,
                                              std::shared_ptr<kv_store::EntryStore> store,
                                              std::shared_ptr<broker::LinkQueues> queues,
                                              std::function<nlohmann::json()> agents) {
  return {
      {http::verb::get, Access::kRead, "/admin/decisions",
       "Recent KV-path decisions, newest first (?limit=N&route=ID): seq, route, request, medium, source, cost "
       "breakdown, outcome; ?since=SEQ: only those after SEQ, oldest first; `cursor` is what to ask since= next",
       [path](const HttpRequest& request) {
         const auto& log = path->decisions();
         const auto query = parse_decision_query(request.target(), log.capacity());
         if (!query) {
           return make_json_error(http::status::bad_request, "invalid_argument", query.error().message,
                                  request.version(), request.keep_alive());
         }
         auto page = log.query(query.value());
         nlohmann::json body{{"decisions", std::move(page.decisions)}, {"cursor", page.cursor}};
         if (query.value().since) body["missed"] = page.missed;
         return make_json_response(http::status::ok,
                                   body.dump(-1, ' ', false, nlohmann::json::error_handler_t::replace), request);
       }},
      {http::verb::get, Access::kRead, "/admin/decisions/last",
       "Each route's newest decision that named a medium (seq, kind, medium, source, outcome, time), kept "
       "after the ring has dropped it",
       [path](const HttpRequest& request) {
         const auto& log = path->decisions();
         const nlohmann::json body{{"routes", log.last_by_route()}, {"cursor", log.last_seq()}};
         return make_json_response(http::status::ok,
                                   body.dump(-1, ' ', false, nlohmann::json::error_handler_t::replace), request);
       }},
      {http::verb::get, Access::kRead, "/admin/kv",
       "The KV store (?limit=N, default 20): budget, bytes used, entries, evictions, and the N entries it values "
       "most (key, bytes, utility, hits, fidelity, origin); spills and fetch-backs, the N newest stubs (key, "
       "peer); prefetches sent and hit",
       [store, path](const HttpRequest& request) {
         const auto limit = parse_limit(request.target(), kMaxKvListLimit, kDefaultKvListLimit);
         if (!limit) {
           return make_json_error(http::status::bad_request, "invalid_argument", limit.error().message,
                                  request.version(), request.keep_alive());
         }
         auto body = kv_store_json(*store, limit.value());
         const auto traffic = path->store_traffic();
         body["spill"]["fetch_backs"] = traffic.fetch_backs;
         body["prefetch"] = {{"sent", traffic.prefetches_sent},
                             {"hits", traffic.prefetch_hits},
                             {"next_agents_ignored", traffic.next_agents_ignored}};
         return make_json_response(http::status::ok, body.dump(), request);
       }},
      // Raw KV is prompt-derived content of any tenant: the admin token even where reads need none.
      {http::verb::get, Access::kMutate, "/admin/kv/sample",
       "One entry's raw KV (application/octet-stream: K then V, layer by layer, as `kvrelay codec eval` reads "
       "it) with X-Kvrelay-Layout (L,H,D,DTYPE) and X-Kvrelay-Tokens: ?key=HEX[&model=HEX] as GET /admin/kv "
       "lists them, default the most recently used entry of exact KV",
       [store](const HttpRequest& request) { return kv_sample(*store, request); }},
      {http::verb::delete_, Access::kMutate, "/admin/kv",
       "Drop every KV entry this sidecar holds (benchmarks, incident response); returns what was dropped",
       [path](const HttpRequest& request) {
         const auto dropped = path->clear_store();
         const nlohmann::json body{{"dropped_entries", dropped.entries}, {"dropped_bytes", dropped.bytes}};
         return make_json_response(http::status::ok, body.dump(), request);
       }},
      {http::verb::get, Access::kRead, "/admin/state",
       "The node's state S(t) as one document (?limit=N: the last N link events, default 64): agents' load, the "
       "store's memory, "
       "each link's scheduler (queue depth, waits, preemptions, resumes, reserved share, bytes by class), peers",
       [path, store, queues, agents](const HttpRequest& request) {
         const auto limit = parse_limit(request.target(), kMaxStateEvents, kDefaultStateEvents);
         if (!limit) {
           return make_json_error(http::status::bad_request, "invalid_argument", limit.error().message,
                                  request.version(), request.keep_alive());
         }
         nlohmann::json memory = kv_store_json(*store, 0);
         memory.erase("top");
         nlohmann::json links = queues ? queues->state_json(limit.value()) : nlohmann::json::object();
         nlohmann::json body{
             {"time", std::chrono::duration<double>(std::chrono::system_clock::now().time_since_epoch()).count()},
             {"agents", agents ? agents().value("agents", nlohmann::json::object()) : nlohmann::json::object()},
             {"memory", std::move(memory)},
             {"scheduler", queues ? std::move(links["scheduler"]) : nlohmann::json{{"mode", "off"}}},
             {"links", queues ? std::move(links["links"]) : nlohmann::json::object()},
             {"link_events", queues ? std::move(links["events"]) : nlohmann::json::array()},
             {"link_events_dropped", queues ? std::move(links["events_dropped"]) : nlohmann::json(0)},
             {"peers", path->peers().describe()}};
         return make_json_response(http::status::ok,
                                   body.dump(-1, ' ', false, nlohmann::json::error_handler_t::replace), request);
       }},
      {http::verb::get, Access::kRead, "/admin/peers",
       "Peers: connection state, link RTT and throughput estimates, summaries",
       [path](const HttpRequest& request) {
         return make_json_response(http::status::ok, path->peers().describe().dump(), request);
       }},
  };
}

}  // namespace kvrelay::proxy
