#include "kvrelay/core/policy.h"

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <fmt/format.h>
#include <nlohmann/json.hpp>

#include <algorithm>
#include <cerrno>
#include <charconv>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <set>
#include <sstream>

#include "kvrelay/core/tensor_parallel.h"
#include "kvrelay/core/unique_fd.h"

#include "json_reader.h"

namespace kvrelay {

using detail::Diagnostics;
using detail::ObjectReader;
using detail::pointer_append;
using nlohmann::json;

std::string HostPort::to_string() const {
  if (host.find(':') != std::string::npos) return fmt::format("[{}]:{}", host, port);
  return fmt::format("{}:{}", host, port);
}

std::string HttpUrl::to_string() const {
  return fmt::format("http://{}:{}{}", host, port, base_path);
}

const MediumCostModel* CostModelPolicy::medium(std::string_view name) const noexcept {
  for (const auto& [medium_name, model] : media) {
    if (medium_name == name) return &model;
  }
  return nullptr;
}

std::vector<Treatment> default_audit_treatments() {
  return {{"T0", "tokens", KvSpan::kNone, std::nullopt},
          {"T1", "kv_raw", KvSpan::kPrompt, std::nullopt},
          {"T2", "kv_raw", KvSpan::kGenerated, std::nullopt},
          {"T3", "kv_raw", KvSpan::kAll, std::nullopt}};
}

bool is_known_medium(std::string_view medium) noexcept {
  if (std::find(std::begin(kBuiltinMedia), std::end(kBuiltinMedia), medium) != std::end(kBuiltinMedia)) {
    return true;
  }
  constexpr std::string_view kPluginPrefix = "codec:";
  return medium.size() > kPluginPrefix.size() && medium.substr(0, kPluginPrefix.size()) == kPluginPrefix;
}

bool route_allows_summary(const RoutePolicy& route) noexcept {
  return (route.forced_medium && *route.forced_medium == kSummaryMedium) ||
         std::find(route.allowed_media.begin(), route.allowed_media.end(), kSummaryMedium) != route.allowed_media.end();
}

Result<HostPort> parse_host_port(std::string_view text) {
  std::string_view host;
  std::string_view port_text;
  if (!text.empty() && text.front() == '[') {
    const auto close = text.find(']');
    if (close == std::string_view::npos || close + 1 >= text.size() || text[close + 1] != ':') {
      return fail(ErrorCode::kInvalidArgument, "expected [ipv6]:port");
    }
    host = text.substr(1, close - 1);
    port_text = text.substr(close + 2);
  } else {
    const auto colon = text.rfind(':');
    if (colon == std::string_view::npos) return fail(ErrorCode::kInvalidArgument, "expected host:port");
    host = text.substr(0, colon);
    port_text = text.substr(colon + 1);
  }
  if (host.empty()) return fail(ErrorCode::kInvalidArgument, "empty host");
  unsigned port = 0;
  const auto [end, error] = std::from_chars(port_text.data(), port_text.data() + port_text.size(), port);
  if (error != std::errc{} || end != port_text.data() + port_text.size() || port > 65535 || port_text.empty()) {
    return fail(ErrorCode::kInvalidArgument, fmt::format("port '{}' is not 0..65535", port_text));
  }
  return HostPort{std::string(host), static_cast<std::uint16_t>(port)};
}

Result<HttpUrl> parse_http_url(std::string_view text) {
  constexpr std::string_view kScheme = "http://";
  if (text.substr(0, kScheme.size()) != kScheme) {
    return fail(ErrorCode::kInvalidArgument, "expected an http:// URL");
  }
  std::string_view rest = text.substr(kScheme.size());
  const auto slash = rest.find('/');
  std::string_view authority = rest.substr(0, slash);
  std::string base_path = slash == std::string_view::npos ? std::string() : std::string(rest.substr(slash));
  while (!base_path.empty() && base_path.back() == '/')
    base_path.pop_back();
  HttpUrl url;
  url.base_path = std::move(base_path);
  if (authority.find(':') == std::string_view::npos || (authority.front() == '[' && authority.back() == ']')) {
    if (authority.empty()) return fail(ErrorCode::kInvalidArgument, "empty host");
    url.host = std::string(authority);
    url.port = 80;
    return url;
  }
  KVRELAY_TRY(auto host_port, parse_host_port(authority));
  if (host_port.port == 0) return fail(ErrorCode::kInvalidArgument, "port 0 in an upstream URL");
  url.host = std::move(host_port.host);
  url.port = host_port.port;
  return url;
}

const AgentPolicy* Policy::find_agent(std::string_view id) const noexcept {
  const auto found = std::find_if(agents.begin(), agents.end(), [&](const auto& a) { return a.id == id; });
  return found == agents.end() ? nullptr : &*found;
}

const RoutePolicy* Policy::find_route(std::string_view id) const noexcept {
  const auto found = std::find_if(routes.begin(), routes.end(), [&](const auto& r) { return r.id == id; });
  return found == routes.end() ? nullptr : &*found;
}

bool Policy::any_peer_accepts_spills() const noexcept {
  return std::any_of(peers.begin(), peers.end(), [](const PeerPolicy& peer) { return peer.accept_spill_bytes > 0; });
}

const PeerPolicy* Policy::find_peer(std::string_view id) const noexcept {
  const auto found = std::find_if(peers.begin(), peers.end(), [&](const auto& p) { return p.id == id; });
  return found == peers.end() ? nullptr : &*found;
}

const TenantPolicy* Policy::find_tenant(std::string_view id) const noexcept {
  const auto it = std::find_if(tenants.begin(), tenants.end(), [&](const TenantPolicy& t) { return t.id == id; });
  return it == tenants.end() ? nullptr : &*it;
}

const std::string& peer_identity(const PeerPolicy& peer) noexcept {
  return peer.identity.empty() ? peer.address.host : peer.identity;
}

std::string_view peer_transport_name(PeerTransport transport) noexcept {
  switch (transport) {
    case PeerTransport::kTcp:
      return "tcp";
    case PeerTransport::kUcx:
      return "ucx";
  }
  return "tcp";
}

bool is_loopback_host(std::string_view host) noexcept {
  return host == "localhost" || host == "::1" || host.substr(0, 4) == "127.";
}

namespace {

constexpr std::string_view kIdPattern = "identifier of letters, digits, '.', '_' or '-' (1..64 chars)";

bool is_identifier(std::string_view text) {
  if (text.empty() || text.size() > 64) return false;
  return std::all_of(text.begin(), text.end(), [](char c) {
    return (c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z') || (c >= '0' && c <= '9') || c == '.' || c == '_' ||
           c == '-';
  });
}

bool read_identifier(ObjectReader& reader, std::string_view key, std::string& out, Diagnostics& diag,
                     bool required = true) {
  const auto* value = reader.field(key, required);
  if (value == nullptr) return false;
  if (!value->is_string() || !is_identifier(value->get_ref<const std::string&>())) {
    diag.expected(reader.pointer_of(key), kIdPattern, value);
    return false;
  }
  out = value->get<std::string>();
  return true;
}

void read_host_port(ObjectReader& reader, std::string_view key, std::optional<HostPort>& out, Diagnostics& diag,
                    bool required) {
  const auto* value = reader.field(key, required);
  if (value == nullptr) return;
  if (value->is_string()) {
    auto parsed = parse_host_port(value->get_ref<const std::string&>());
    if (parsed) {
      out = std::move(parsed).value();
      return;
    }
  }
  diag.expected(reader.pointer_of(key), "\"host:port\" with port 0..65535", value);
}

void read_url(ObjectReader& reader, std::string_view key, std::optional<HttpUrl>& out, Diagnostics& diag,
              bool required) {
  const auto* value = reader.field(key, required);
  if (value == nullptr) return;
  if (value->is_string()) {
    auto parsed = parse_http_url(value->get_ref<const std::string&>());
    if (parsed) {
      out = std::move(parsed).value();
      return;
    }
  }
  diag.expected(reader.pointer_of(key), "http://host[:port][/path] URL", value);
}

void read_listen(const json& value, const std::string& pointer, ListenPolicy& out, Diagnostics& diag) {
  ObjectReader reader(value, pointer, diag);
  if (!reader.is_object()) return;
  std::optional<HostPort> http;
  read_host_port(reader, "http", http, diag, true);
  if (http) out.http = *http;
  read_host_port(reader, "admin", out.admin, diag, false);
  reader.read_bool("metrics_on_http", out.metrics_on_http);
  read_host_port(reader, "peer", out.peer, diag, false);
  reader.read_string("unix_socket", out.unix_socket, false);
  reader.read_string("unix_socket_group", out.unix_socket_group, false);
  if (const auto* uids = reader.field("allowed_uids", false)) {
    if (!uids->is_array()) {
      diag.expected(reader.pointer_of("allowed_uids"), "array of uids", uids);
    } else {
      for (std::size_t index = 0; index < uids->size(); ++index) {
        const auto& uid = (*uids)[index];
        if (!uid.is_number_unsigned() || uid.get<std::uint64_t>() > 0xFFFFFFFEULL) {
          diag.expected(pointer_append(reader.pointer_of("allowed_uids"), index), "uid 0..4294967294", &uid);
          continue;
        }
        out.allowed_uids.push_back(uid.get<std::uint32_t>());
      }
    }
  }
  reader.reject_unknown_keys();
}

void read_model(const json& value, const std::string& pointer, ModelFingerprint& out, Diagnostics& diag) {
  ObjectReader reader(value, pointer, diag);
  if (!reader.is_object()) return;
  reader.read_string("architecture", out.architecture, true);
  reader.read_u32("layers", out.layers, 1, KvLayout::kMaxLayers, true);
  reader.read_u32("kv_heads", out.kv_heads, 1, KvLayout::kMaxKvHeads, true);
  reader.read_u32("head_dim", out.head_dim, 1, KvLayout::kMaxHeadDim, true);
  if (const auto* dtype = reader.field("dtype", true)) {
    const auto parsed = dtype->is_string() ? parse_dtype(dtype->get_ref<const std::string&>()) : std::nullopt;
    if (parsed) {
      out.dtype = *parsed;
    } else {
      diag.expected(reader.pointer_of("dtype"), "one of \"fp32\", \"fp16\", \"bf16\", \"fp8_e4m3\", \"fp8_e5m2\"",
                    dtype);
    }
  }
  reader.read_string("weights", out.weights_identity, true);
  reader.reject_unknown_keys();
}

template <class Item, class ReadOne>
void read_array(ObjectReader& parent, std::string_view key, std::vector<Item>& out, Diagnostics& diag,
                ReadOne read_one) {
  const auto* value = parent.field(key, false);
  if (value == nullptr) return;
  if (!value->is_array()) {
    diag.expected(parent.pointer_of(key), "array", value);
    return;
  }
  for (std::size_t index = 0; index < value->size(); ++index) {
    Item item;
    read_one((*value)[index], pointer_append(parent.pointer_of(key), index), item);
    out.push_back(std::move(item));
  }
}

void read_peer(const json& value, const std::string& pointer, PeerPolicy& out, Diagnostics& diag) {
  ObjectReader reader(value, pointer, diag);
  if (!reader.is_object()) return;
  read_identifier(reader, "id", out.id, diag);
  std::optional<HostPort> address;
  read_host_port(reader, "address", address, diag, true);
  if (address) out.address = *address;
  reader.read_bool("same_host", out.same_host);
  std::uint32_t uid = 0;
  if (reader.read_u32("uid", uid, 0, 0xFFFFFFFEU)) out.uid = uid;
  if (out.uid && !out.same_host) diag.problem(reader.pointer_of("uid"), "only a same_host peer has a uid");
  reader.read_string("identity", out.identity, false);
  reader.read_u64("accept_spill_bytes", out.accept_spill_bytes, 0, 1ULL << 50);
  if (const auto* transport = reader.field("transport", false)) {
    if (transport->is_string() && *transport == peer_transport_name(PeerTransport::kTcp)) {
      out.transport = PeerTransport::kTcp;
    } else if (transport->is_string() && *transport == peer_transport_name(PeerTransport::kUcx)) {
      out.transport = PeerTransport::kUcx;
    } else {
      diag.expected(reader.pointer_of("transport"), "\"tcp\" or \"ucx\"", transport);
    }
  }
  reader.reject_unknown_keys();
}

void read_agent(const json& value, const std::string& pointer, AgentPolicy& out, Diagnostics& diag) {
  ObjectReader reader(value, pointer, diag);
  if (!reader.is_object()) return;
  read_identifier(reader, "id", out.id, diag);
  std::optional<HttpUrl> upstream;
  read_url(reader, "upstream", upstream, diag, true);
  if (upstream) out.upstream = *upstream;
  if (const auto* model = reader.field("model", true)) read_model(*model, reader.pointer_of("model"), out.model, diag);
  reader.read_int("role_priority", out.role_priority, 0, 7);
  reader.read_bool("kv_connector", out.kv_connector);
  read_identifier(reader, "node", out.node, diag, false);
  read_url(reader, "metrics_url", out.metrics_url, diag, false);
  reader.read_bool("accepts_sparse_kv", out.accepts_sparse_kv);
  reader.read_bool("accepts_kv_spans", out.accepts_kv_spans);
  read_identifier(reader, "tenant", out.tenant, diag, false);
  reader.read_u32("tensor_parallel_size", out.tensor_parallel_size, 1, 1024);
  if (out.model.kv_heads != 0 && shard_kv_heads(out.model.kv_heads, out.tensor_parallel_size) == 0) {
    diag.problem(reader.pointer_of("tensor_parallel_size"), "model.kv_heads is not a multiple of tensor_parallel_size");
  }
  reader.reject_unknown_keys();
}

void read_media_list(ObjectReader& reader, std::string_view key, std::vector<std::string>& out, Diagnostics& diag) {
  if (!reader.read_string_array(key, out)) return;
  for (std::size_t index = 0; index < out.size(); ++index) {
    if (!is_known_medium(out[index])) {
      const json got = out[index];
      diag.expected(pointer_append(reader.pointer_of(key), index),
                    "a medium (tokens, kv_raw, kv_lossless, kv_fp8, kv_int8, kv_int4, kv_sparse, summary or "
                    "codec:<name>)",
                    &got);
    }
  }
}

void read_audit_treatment(const json& value, const std::string& pointer, Treatment& out, Diagnostics& diag) {
  ObjectReader reader(value, pointer, diag);
  if (!reader.is_object()) return;
  read_identifier(reader, "name", out.name, diag);
  if (const auto* medium = reader.field("medium", true)) {
    if (medium->is_string() && is_known_medium(medium->get_ref<const std::string&>())) {
      out.medium = medium->get<std::string>();
    } else {
      diag.expected(reader.pointer_of("medium"), "a medium name", medium);
    }
  }
  if (const auto* span = reader.field("span", true)) {
    const auto parsed = span->is_string() ? parse_span(span->get_ref<const std::string&>()) : std::nullopt;
    if (parsed) {
      out.span = *parsed;
    } else {
      diag.expected(reader.pointer_of("span"), "one of none, prompt, generated, all", span);
    }
  }
  if (out.medium == kSummaryMedium) {
    if (out.span != KvSpan::kAll) {
      diag.problem(reader.pointer_of("span"),
                   fmt::format("span \"{}\" with medium summary: a summary replaces all of A's context (span all)",
                               span_name(out.span)));
    }
  } else if ((out.medium == "tokens") != (out.span == KvSpan::kNone) && !out.medium.empty()) {
    diag.problem(reader.pointer_of("span"),
                 fmt::format("span \"{}\" with medium \"{}\": tokens moves no KV (span none), every KV medium needs a "
                             "span",
                             span_name(out.span), out.medium));
  }
  reader.reject_unknown_keys();
}

void read_route_summary(const json& value, const std::string& pointer, RouteSummaryPolicy& out, Diagnostics& diag) {
  ObjectReader reader(value, pointer, diag);
  if (!reader.is_object()) return;
  read_url(reader, "summariser", out.summariser, diag, false);
  reader.read_u32("max_tokens", out.max_tokens, 1, 8192);
  if (reader.read_string("template", out.prompt_template, false) &&
      out.prompt_template.find("{summary}") == std::string::npos) {
    const json got = out.prompt_template;
    diag.expected(reader.pointer_of("template"), "text containing {summary}", &got);
  }
  reader.read_string("instruction", out.instruction, false, /*non_empty=*/false);
  reader.read_string("model", out.model, false);
  reader.read_millis("timeout_ms", out.timeout, 1, 600'000);
  reader.reject_unknown_keys();
}

void read_route_audit(const json& value, const std::string& pointer, RouteAuditPolicy& out, Diagnostics& diag) {
  ObjectReader reader(value, pointer, diag);
  if (!reader.is_object()) return;
  reader.read_double("fraction", out.fraction, 0.0, 1.0, true);
  if (const auto* treatments = reader.field("treatments", false)) {
    if (!treatments->is_array() || treatments->empty()) {
      diag.expected(reader.pointer_of("treatments"), "a non-empty array of treatments", treatments);
    } else {
      std::set<std::string, std::less<>> names;
      for (std::size_t index = 0; index < treatments->size(); ++index) {
        Treatment treatment;
        const auto item_pointer = pointer_append(reader.pointer_of("treatments"), index);
        read_audit_treatment((*treatments)[index], item_pointer, treatment, diag);
        if (!treatment.name.empty() && !names.insert(treatment.name).second) {
          diag.problem(pointer_append(item_pointer, "name"), fmt::format("duplicate treatment \"{}\"", treatment.name));
        }
        out.treatments.push_back(std::move(treatment));
      }
    }
  }
  reader.read_string("trials_file", out.trials_file, false);
  reader.read_bool("client_treatments", out.client_treatments);
  std::string calibrate = "off";
  if (reader.read_string("calibrate", calibrate, false)) {
    if (calibrate != "off" && calibrate != "live") {
      const json got = calibrate;
      diag.expected(reader.pointer_of("calibrate"), "one of off, live", &got);
    }
    out.calibrate_live = calibrate == "live";
  }
  reader.read_u32("calibrate_window", out.calibrate_window, 4, 100000);
  reader.read_double("calibrate_max_step_s", out.calibrate_max_step_s, 0.0, 60.0);
  reader.reject_unknown_keys();
}

void read_route(const json& value, const std::string& pointer, RoutePolicy& out, Diagnostics& diag) {
  ObjectReader reader(value, pointer, diag);
  if (!reader.is_object()) return;
  read_identifier(reader, "id", out.id, diag);
  read_identifier(reader, "from", out.from_agent, diag);
  read_identifier(reader, "to", out.to_agent, diag);
  reader.read_bool("enabled", out.enabled);
  read_media_list(reader, "allowed_media", out.allowed_media, diag);
  if (const auto* forced = reader.field("forced_medium", false); forced != nullptr && !forced->is_null()) {
    if (forced->is_string() && is_known_medium(forced->get_ref<const std::string&>())) {
      out.forced_medium = forced->get<std::string>();
    } else {
      diag.expected(reader.pointer_of("forced_medium"), "a medium name or null", forced);
    }
  }
  reader.read_int("priority", out.priority, 0, 7);
  std::chrono::milliseconds deadline{0};
  if (reader.read_millis("deadline_ms", deadline, 1, 3'600'000)) out.deadline = deadline;
  const bool has_audit_fraction = reader.read_double("audit_fraction", out.audit_fraction, 0.0, 1.0);
  if (const auto* audit = reader.field("audit", false)) {
    read_route_audit(*audit, reader.pointer_of("audit"), out.audit, diag);
    if (has_audit_fraction) {
      diag.problem(reader.pointer_of("audit_fraction"), "set either audit_fraction or audit.fraction, not both");
    }
    out.audit_fraction = out.audit.fraction;
  } else {
    out.audit.fraction = out.audit_fraction;
  }
  if (out.audit.treatments.empty()) {
    out.audit.standard_treatments = true;
    // The shorthand's T0..T3 keep only what the route allows (T0, tokens, is always allowed),
    // and (fit_standard_treatments) what its receiver can take.
    for (auto& treatment : default_audit_treatments()) {
      if (treatment.medium == "tokens" || out.allowed_media.empty() ||
          std::find(out.allowed_media.begin(), out.allowed_media.end(), treatment.medium) != out.allowed_media.end()) {
        out.audit.treatments.push_back(std::move(treatment));
      }
    }
  }
  reader.read_double("hysteresis", out.hysteresis_threshold, 0.0, 10.0);
  reader.read_double("quality_floor", out.quality_floor, 0.0, 1.0);
  reader.read_bool("push", out.push);
  reader.read_bool("critical", out.critical);
  reader.read_double("reserved_share", out.reserved_share, 0.0, 0.9);
  if (const auto* summary = reader.field("summary", false)) {
    read_route_summary(*summary, reader.pointer_of("summary"), out.summary, diag);
  }
  reader.reject_unknown_keys();
}

void read_limits(const json& value, const std::string& pointer, LimitsPolicy& out, Diagnostics& diag) {
  ObjectReader reader(value, pointer, diag);
  if (!reader.is_object()) return;
  reader.read_u32("max_header_bytes", out.max_header_bytes, 1024, 1U << 20);
  reader.read_u64("max_body_bytes", out.max_body_bytes, 1024, 1ULL << 34);
  reader.read_millis("read_timeout_ms", out.read_timeout, 1, 3'600'000);
  reader.read_millis("upstream_timeout_ms", out.upstream_timeout, 1, 86'400'000);
  reader.read_millis("idle_timeout_ms", out.idle_timeout, 1, 86'400'000);
  reader.read_u32("max_connections", out.max_connections, 1, 1U << 20);
  reader.read_u32("max_queued_responses", out.max_queued_responses, 1, 1U << 16);
  reader.read_u64("kv_store_bytes", out.kv_store_bytes, 0, 1ULL << 50);
  reader.read_u64("peer_buffer_bytes", out.peer_buffer_bytes, 0, 1ULL << 40);
  reader.read_bool("peer_staging", out.peer_staging);
  reader.read_u64("shm_arena_bytes", out.shm_arena_bytes, 0, 1ULL << 40);
  if (const auto* strategy = reader.field("memory_strategy", false)) {
    const auto parsed =
        strategy->is_string() ? parse_memory_strategy(strategy->get<std::string>()) : std::optional<MemoryStrategy>();
    if (parsed) {
      out.memory_strategy = *parsed;
    } else {
      diag.expected(reader.pointer_of("memory_strategy"), "\"portable\" or \"prefault\"", strategy);
    }
  }
  reader.read_millis("probe_interval_ms", out.probe_interval, 50, 3'600'000);
  reader.read_millis("kv_lookup_timeout_ms", out.kv_lookup_timeout, 1, 600'000);
  reader.read_millis("kv_reservation_ms", out.kv_reservation, 1, 3'600'000);
  reader.read_millis("peer_summary_interval_ms", out.peer_summary_interval, 0, 3'600'000);
  reader.read_millis("peer_bandwidth_probe_interval_ms", out.peer_bandwidth_probe_interval, 0, 86'400'000);
  reader.reject_unknown_keys();
}

void read_kv_store(const json& value, const std::string& pointer, StorePolicy& out, Diagnostics& diag) {
  ObjectReader reader(value, pointer, diag);
  if (!reader.is_object()) return;
  if (const auto* eviction = reader.field("eviction", false)) {
    if (eviction->is_string() && *eviction == "utility") {
      out.eviction = EvictionKind::kUtility;
    } else if (eviction->is_string() && *eviction == "lru") {
      out.eviction = EvictionKind::kLru;
    } else {
      diag.expected(reader.pointer_of("eviction"), "\"utility\" or \"lru\"", eviction);
    }
  }
  reader.read_double("recency_tau_s", out.recency_tau_s, 0.001, 1e9);
  reader.read_double("spill_min_utility", out.spill_min_utility, 0.0, 1e9);
  if (const auto* medium = reader.field("spill_medium", false)) {
    // A medium that carries KV through a codec: not tokens, and not sparse KV (it drops positions).
    const bool usable = medium->is_string() && is_known_medium(medium->get<std::string>()) && *medium != "tokens" &&
                        *medium != "kv_sparse" && *medium != kSummaryMedium;
    if (usable) {
      out.spill_medium = medium->get<std::string>();
    } else {
      diag.expected(reader.pointer_of("spill_medium"),
                    "a KV medium (kv_raw, kv_lossless, kv_fp8, kv_int8, kv_int4 or codec:<name>)", medium);
    }
  }
  reader.read_u64("spill_inflight_bytes", out.spill_inflight_bytes, 0, 1ULL << 40);
  reader.read_bool("prefetch", out.prefetch);
  reader.read_u64("prefetch_max_bytes", out.prefetch_max_bytes, 0, 1ULL << 40);
  reader.reject_unknown_keys();
}

void read_scheduler(const json& value, const std::string& pointer, SchedulerPolicy& out, Diagnostics& diag) {
  ObjectReader reader(value, pointer, diag);
  if (!reader.is_object()) return;
  if (const auto* mode = reader.field("mode", false)) {
    if (mode->is_string() && *mode == "wrr") {
      out.mode = SchedulerMode::kWrr;
    } else if (mode->is_string() && *mode == "fifo") {
      out.mode = SchedulerMode::kFifo;
    } else if (mode->is_string() && *mode == "off") {
      out.mode = SchedulerMode::kOff;
    } else {
      diag.expected(reader.pointer_of("mode"), "\"wrr\", \"fifo\" or \"off\"", mode);
    }
  }
  reader.read_millis("time_slice_ms", out.time_slice, 5, 20);
  reader.read_u32("chunk_bytes", out.chunk_bytes, 4096, 64U << 20);
  reader.read_u32("window_chunks", out.window_chunks, 2, 1024);
  reader.read_double("base", out.base, 0.0, 1e6);
  reader.read_double("alpha", out.alpha, 0.0, 1e6);
  reader.read_double("beta", out.beta, 0.0, 1e4);
  reader.read_double("preempt_factor", out.preempt_factor, 1.0, 1e6);
  reader.read_double("preempt_max_done", out.preempt_max_done, 0.0, 1.0);
  reader.read_double("max_reserved_share", out.max_reserved_share, 0.0, 0.9);
  reader.read_double("link_bytes_per_s", out.link_bytes_per_s, 0.0, 1e13);
  reader.read_millis("max_stall_ms", out.max_stall, 0, 3'600'000);
  reader.reject_unknown_keys();
}

// Reserved shares belong to critical routes, and together stay within the scheduler's cap.
void check_reservations(const Policy& policy, Diagnostics& diag) {
  double total = 0.0;
  for (std::size_t index = 0; index < policy.routes.size(); ++index) {
    const auto& route = policy.routes[index];
    const std::string at = pointer_append("/routes", index);
    if (route.critical && route.reserved_share <= 0.0) {
      diag.problem(pointer_append(at, "reserved_share"), "a critical route needs a reserved_share above 0");
    } else if (!route.critical && route.reserved_share > 0.0) {
      diag.problem(pointer_append(at, "reserved_share"), "only a critical route (critical: true) reserves a share");
    }
    if (!route.critical) continue;
    total += route.reserved_share;
    if (total > policy.scheduler.max_reserved_share + 1e-9) {
      diag.problem(
          pointer_append(at, "reserved_share"),
          fmt::format("critical routes reserve {:.3g} of a link in all, more than scheduler.max_reserved_share "
                      "{:.3g}",
                      total, policy.scheduler.max_reserved_share));
      return;
    }
  }
}

void read_codecs(const json& value, const std::string& pointer, CodecPolicy& out, Diagnostics& diag) {
  ObjectReader reader(value, pointer, diag);
  if (!reader.is_object()) return;
  reader.read_string_array("plugin_dirs", out.plugin_dirs);
  if (const auto* device = reader.field("device", false)) {
    if (device->is_string() && (*device == "cpu" || *device == "cuda" || *device == "auto")) {
      out.device = device->get<std::string>();
    } else {
      diag.expected(reader.pointer_of("device"), "\"cpu\", \"cuda\" or \"auto\"", device);
    }
  }
  reader.reject_unknown_keys();
}

void read_cost_model(const json& value, const std::string& pointer, CostModelPolicy& out, Diagnostics& diag) {
  ObjectReader reader(value, pointer, diag);
  if (!reader.is_object()) return;
  constexpr double kHuge = 1e6;
  if (const auto* agents = reader.field("agents", false)) {
    ObjectReader agents_reader(*agents, reader.pointer_of("agents"), diag);
    if (agents_reader.is_object()) {
      for (const auto& [agent_id, entry] : agents->items()) {
        ObjectReader agent_reader(entry, agents_reader.pointer_of(agent_id), diag);
        if (!agent_reader.is_object()) continue;
        AgentCostModel model;
        if (const auto* prefill = agent_reader.field("prefill_s", false)) {
          ObjectReader prefill_reader(*prefill, agent_reader.pointer_of("prefill_s"), diag);
          if (prefill_reader.is_object()) {
            double a = 0.0;
            double b = 0.0;
            double c = 0.0;
            if (prefill_reader.read_double("a", a, 0.0, kHuge)) model.prefill_a_s = a;
            if (prefill_reader.read_double("b", b, 0.0, kHuge)) model.prefill_b_s = b;
            if (prefill_reader.read_double("c", c, 0.0, kHuge)) model.prefill_c_s = c;
            prefill_reader.reject_unknown_keys();
          }
        }
        double decode = 0.0;
        if (agent_reader.read_double("decode_s_per_token", decode, 0.0, kHuge)) model.decode_s_per_token = decode;
        agent_reader.reject_unknown_keys();
        out.agents.emplace_back(agent_id, model);
      }
    }
  }
  if (const auto* media = reader.field("media", false)) {
    ObjectReader media_reader(*media, reader.pointer_of("media"), diag);
    if (media_reader.is_object()) {
      for (const auto& [medium, entry] : media->items()) {
        ObjectReader medium_reader(entry, media_reader.pointer_of(medium), diag);
        if (!is_known_medium(medium)) {
          const json got = medium;
          diag.expected(media_reader.pointer_of(medium), "a medium name as key", &got);
          continue;
        }
        if (!medium_reader.is_object()) continue;
        MediumCostModel model;
        double fidelity = 1.0;
        double extra = 0.0;
        if (medium_reader.read_double("fidelity", fidelity, 1e-6, 1.0)) model.fidelity = fidelity;
        if (medium_reader.read_double("extra_decode_fraction", extra, 0.0, 100.0)) model.extra_decode_fraction = extra;
        medium_reader.reject_unknown_keys();
        out.media.emplace_back(medium, model);
      }
    }
  }
  reader.reject_unknown_keys();
}

void read_logging(const json& value, const std::string& pointer, LoggingPolicy& out, Diagnostics& diag) {
  ObjectReader reader(value, pointer, diag);
  if (!reader.is_object()) return;
  static constexpr std::string_view kLevels[] = {"trace", "debug", "info", "warn", "error", "critical", "off"};
  if (const auto* level = reader.field("level", false)) {
    if (level->is_string() &&
        std::find(std::begin(kLevels), std::end(kLevels), level->get_ref<const std::string&>()) != std::end(kLevels)) {
      out.level = level->get<std::string>();
    } else {
      diag.expected(reader.pointer_of("level"), "one of trace, debug, info, warn, error, critical, off", level);
    }
  }
  if (const auto* format = reader.field("format", false)) {
    if (format->is_string() && (*format == "text" || *format == "json")) {
      out.format = format->get<std::string>();
    } else {
      diag.expected(reader.pointer_of("format"), "\"text\" or \"json\"", format);
    }
  }
  reader.read_string("file", out.file, false);
  reader.reject_unknown_keys();
}

template <class Item>
void check_unique_ids(const std::vector<Item>& items, const std::string& pointer, Diagnostics& diag) {
  std::set<std::string, std::less<>> seen;
  for (std::size_t index = 0; index < items.size(); ++index) {
    if (items[index].id.empty()) continue;
    if (!seen.insert(items[index].id).second) {
      diag.problem(pointer_append(pointer_append(pointer, index), "id"),
                   fmt::format("duplicate id \"{}\"", items[index].id));
    }
  }
}

// A receiver is offered only treatments it declared it can take (issue #28): the shorthand's T2
// leaves routes into a prefix-only receiver; an operator's list naming it is an error (below).
void fit_standard_treatments(Policy& policy) {
  for (auto& route : policy.routes) {
    const auto* to = policy.find_agent(route.to_agent);
    if (!route.audit.standard_treatments || to == nullptr || to->accepts_kv_spans) continue;
    std::erase_if(route.audit.treatments,
                  [](const Treatment& treatment) { return treatment.span == KvSpan::kGenerated; });
  }
}

// What a treatment needs of its receiver that the receiver did not declare; "" when nothing.
std::string untakeable_by(const Treatment& treatment, const AgentPolicy& to) {
  if (treatment.span == KvSpan::kGenerated && !to.accepts_kv_spans) {
    return fmt::format(
        "span generated needs agent {} to declare accepts_kv_spans (a receiver that imports leading "
        "prefixes only, such as vLLM, cannot take it)",
        to.id);
  }
  if (treatment.medium == "kv_sparse" && !to.accepts_sparse_kv) {
    return fmt::format("medium kv_sparse needs agent {} to declare accepts_sparse_kv", to.id);
  }
  return {};
}

void check_references(const Policy& policy, Diagnostics& diag) {
  check_unique_ids(policy.peers, "/peers", diag);
  check_unique_ids(policy.agents, "/agents", diag);
  check_unique_ids(policy.routes, "/routes", diag);
  for (std::size_t index = 0; index < policy.peers.size(); ++index) {
    if (!policy.node_id.empty() && policy.peers[index].id == policy.node_id) {
      diag.problem(pointer_append(pointer_append("/peers", index), "id"),
                   fmt::format("peer id \"{}\" is this node's own id", policy.node_id));
    }
  }
  for (std::size_t index = 0; index < policy.agents.size(); ++index) {
    const auto& agent = policy.agents[index];
    if (!agent.node.empty() && agent.node != policy.node_id && policy.find_peer(agent.node) == nullptr) {
      const json got = agent.node;
      diag.expected(pointer_append(pointer_append("/agents", index), "node"), "this node's id or a peer id from /peers",
                    &got);
    }
  }
  for (const auto& [agent_id, model] : policy.cost_model.agents) {
    if (policy.find_agent(agent_id) == nullptr) {
      const json got = agent_id;
      diag.expected(pointer_append("/cost_model/agents", agent_id), "an agent id from /agents as key", &got);
    }
  }
  for (std::size_t index = 0; index < policy.routes.size(); ++index) {
    const auto& route = policy.routes[index];
    const auto route_pointer = pointer_append("/routes", index);
    for (const auto& [key, agent_id] : {std::pair{"from", &route.from_agent}, std::pair{"to", &route.to_agent}}) {
      if (!agent_id->empty() && policy.find_agent(*agent_id) == nullptr) {
        const json got = *agent_id;
        diag.expected(pointer_append(route_pointer, key), "an agent id from /agents", &got);
      }
    }
    if (!route.from_agent.empty() && route.from_agent == route.to_agent) {
      diag.problem(pointer_append(route_pointer, "to"), "a route must connect two different agents");
    }
    for (std::size_t treatment = 0; treatment < route.audit.treatments.size(); ++treatment) {
      const auto& medium = route.audit.treatments[treatment].medium;
      const auto treatment_pointer =
          pointer_append(pointer_append(pointer_append(route_pointer, "audit"), "treatments"), treatment);
      if (const auto* to = policy.find_agent(route.to_agent)) {
        if (auto why = untakeable_by(route.audit.treatments[treatment], *to); !why.empty()) {
          diag.problem(treatment_pointer, why);
        }
      }
      if (!route.allowed_media.empty() && medium != "tokens" &&
          std::find(route.allowed_media.begin(), route.allowed_media.end(), medium) == route.allowed_media.end()) {
        const json got = medium;
        diag.expected(treatment_pointer + "/medium", "a medium listed in allowed_media", &got);
      }
    }
    if (route.forced_medium && !route.allowed_media.empty() &&
        std::find(route.allowed_media.begin(), route.allowed_media.end(), *route.forced_medium) ==
            route.allowed_media.end()) {
      const json got = *route.forced_medium;
      diag.expected(pointer_append(route_pointer, "forced_medium"), "a medium listed in allowed_media", &got);
    }
  }
}

// Tenants and signing (docs/security.md): the sections' readers and their checks.
void read_tenant(const json& value, const std::string& pointer, TenantPolicy& out, Diagnostics& diag) {
  ObjectReader reader(value, pointer, diag);
  if (!reader.is_object()) return;
  read_identifier(reader, "id", out.id, diag);
  reader.read_string("salt_file", out.salt_file, true);
  reader.reject_unknown_keys();
}

void read_signing(const json& value, const std::string& pointer, SigningPolicy& out, Diagnostics& diag) {
  ObjectReader reader(value, pointer, diag);
  if (!reader.is_object()) return;
  reader.read_string("node_key_file", out.node_key_file, true);
  reader.reject_unknown_keys();
}

std::string tenant_label(const std::string& tenant) {
  return tenant.empty() ? std::string("the default tenant") : fmt::format("tenant \"{}\"", tenant);
}

void check_tenancy(const Policy& policy, Diagnostics& diag) {
  check_unique_ids(policy.tenants, "/tenants", diag);
  if (!policy.tenants.empty() && !policy.signing.enabled()) {
    diag.problem("/signing/node_key_file",
                 "tenants need a node key: the front proxy signs the tenant it names, and unsigned kvrelay fields "
                 "would let any worker's client claim a tenant");
  }
  for (std::size_t index = 0; index < policy.agents.size(); ++index) {
    const auto& tenant = policy.agents[index].tenant;
    if (!tenant.empty() && policy.find_tenant(tenant) == nullptr) {
      const json got = tenant;
      diag.expected(pointer_append(pointer_append("/agents", index), "tenant"), "a tenant id from /tenants", &got);
    }
  }
  for (std::size_t index = 0; index < policy.routes.size(); ++index) {
    const auto& route = policy.routes[index];
    const auto* from = policy.find_agent(route.from_agent);
    const auto* to = policy.find_agent(route.to_agent);
    if (from != nullptr && to != nullptr && from->tenant != to->tenant) {
      diag.problem(pointer_append(pointer_append("/routes", index), "to"),
                   fmt::format("a route connects agents of one tenant (KV is never shared across tenants): \"{}\" "
                               "is in {}, \"{}\" in {}",
                               from->id, tenant_label(from->tenant), to->id, tenant_label(to->tenant)));
    }
  }
}

// The bytes of a secret file, or why not (the reason names the path, never the contents). Opened
// non-blocking and required to be a regular file, so a FIFO or device cannot hang a reload.
std::optional<std::string> read_secret_file(const std::string& path, std::string& contents,
                                            std::size_t min_bytes = kMinSecretBytes) {
  const int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC | O_NONBLOCK | O_NOCTTY);
  if (fd < 0) return fmt::format("cannot open {}: {}", path, std::strerror(errno));
  struct stat info {};
  std::optional<std::string> problem;
  if (::fstat(fd, &info) != 0) {
    problem = fmt::format("cannot stat {}: {}", path, std::strerror(errno));
  } else if (!S_ISREG(info.st_mode)) {
    problem = fmt::format("{} is not a regular file", path);
  } else if (info.st_size < static_cast<off_t>(min_bytes) || info.st_size > static_cast<off_t>(kMaxSecretBytes)) {
    problem =
        fmt::format("{} holds {} bytes; a secret is {}..{} bytes", path, info.st_size, min_bytes, kMaxSecretBytes);
  } else {
    contents.resize(static_cast<std::size_t>(info.st_size));
    std::size_t done = 0;
    while (done < contents.size()) {
      const auto got = ::read(fd, contents.data() + done, contents.size() - done);
      if (got < 0 && errno == EINTR) continue;
      if (got <= 0) {
        problem = fmt::format("cannot read {}: {}", path, got < 0 ? std::strerror(errno) : "file shrank");
        break;
      }
      done += static_cast<std::size_t>(got);
    }
  }
  ::close(fd);
  if (problem) contents.clear();
  return problem;
}

// Peer TLS (issue #25): the peer_tls section, and the rule that plaintext peers stay on loopback.
void read_peer_tls(const json& value, const std::string& pointer, PeerTlsPolicy& out, Diagnostics& diag) {
  ObjectReader reader(value, pointer, diag);
  if (!reader.is_object()) return;
  reader.read_string("certificate", out.certificate, false);
  reader.read_string("private_key", out.private_key, false);
  reader.read_string("ca_bundle", out.ca_bundle, false);
  reader.read_bool("trusted_network", out.trusted_network);
  const int files = int{!out.certificate.empty()} + int{!out.private_key.empty()} + int{!out.ca_bundle.empty()};
  if (files != 0 && files != 3) {
    diag.problem(pointer, "certificate, private_key and ca_bundle go together (TLS on) or not at all (plaintext)");
  }
  if (files == 0 && !out.trusted_network) {
    diag.problem(pointer, "needs certificate, private_key and ca_bundle, or \"trusted_network\": true");
  }
  reader.reject_unknown_keys();
}

void check_plaintext_peers(const Policy& policy, Diagnostics& diag) {
  if (policy.peer_tls.enabled() || policy.peer_tls.trusted_network) return;
  constexpr std::string_view kNeeds = "needs /peer_tls (certificates) or /peer_tls/trusted_network";
  if (policy.listen.peer && !is_loopback_host(policy.listen.peer->host)) {
    diag.problem("/listen/peer", fmt::format("plaintext peer listener on {}, off loopback: {}",
                                             policy.listen.peer->to_string(), kNeeds));
  }
  for (std::size_t index = 0; index < policy.peers.size(); ++index) {
    if (is_loopback_host(policy.peers[index].address.host)) continue;
    diag.problem(
        pointer_append(pointer_append("/peers", index), "address"),
        fmt::format("plaintext peer at {}, off loopback: {}", policy.peers[index].address.to_string(), kNeeds));
  }
}

// UCX peer transport (issue #29): the ucx section, and the rule that UCX, which carries KV in
// plaintext, stays on loopback unless the operator says the fabric is trusted.

// A non-empty list of comma-separated names, each non-empty and of characters `allowed` accepts.
template <class Allowed>
bool is_name_list(std::string_view text, Allowed allowed) {
  if (text.empty()) return false;
  std::size_t start = 0;
  while (true) {
    const auto comma = text.find(',', start);
    const auto name = text.substr(start, comma == std::string_view::npos ? std::string_view::npos : comma - start);
    if (name.empty() || !std::all_of(name.begin(), name.end(), allowed)) return false;
    if (comma == std::string_view::npos) return true;
    start = comma + 1;
  }
}

bool is_ucx_transport_char(char c) {
  return (c >= 'a' && c <= 'z') || (c >= '0' && c <= '9') || c == '_';
}

bool is_ucx_device_char(char c) {
  return (c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z') || (c >= '0' && c <= '9') || c == '_' || c == '.' ||
         c == ':' || c == '-';
}

void read_ucx(const json& value, const std::string& pointer, UcxPolicy& out, Diagnostics& diag) {
  ObjectReader reader(value, pointer, diag);
  if (!reader.is_object()) return;
  if (const auto* tls = reader.field("tls", false)) {
    if (tls->is_string() && is_name_list(tls->get_ref<const std::string&>(), is_ucx_transport_char)) {
      out.tls = tls->get<std::string>();
    } else {
      diag.expected(reader.pointer_of("tls"),
                    "comma-separated UCX transport names ([a-z0-9_]+ each), e.g. \"posix,tcp\"", tls);
    }
  }
  if (const auto* devices = reader.field("net_devices", false)) {
    if (devices->is_string() && is_name_list(devices->get_ref<const std::string&>(), is_ucx_device_char)) {
      out.net_devices = devices->get<std::string>();
    } else {
      diag.expected(reader.pointer_of("net_devices"),
                    "\"all\" or comma-separated device names ([A-Za-z0-9_.:-]+ each), e.g. \"mlx5_0:1\"", devices);
    }
  }
  reader.read_u64("rndv_thresh_bytes", out.rndv_thresh_bytes, 0, 1ULL << 30);
  reader.read_bool("trusted_network", out.trusted_network);
  reader.reject_unknown_keys();
}

void check_ucx_peers(const Policy& policy, Diagnostics& diag) {
  if (!policy.ucx.enabled || policy.ucx.trusted_network) return;
  if (policy.listen.peer && !is_loopback_host(policy.listen.peer->host)) {
    diag.problem("/listen/peer",
                 fmt::format("UCX is offered to peers only on loopback unless /ucx/trusted_network: peer listener on "
                             "{}, off loopback (UCX carries KV in plaintext)",
                             policy.listen.peer->to_string()));
  }
  for (std::size_t index = 0; index < policy.peers.size(); ++index) {
    const auto& peer = policy.peers[index];
    if (peer.transport != PeerTransport::kUcx || is_loopback_host(peer.address.host)) continue;
    diag.problem(pointer_append(pointer_append("/peers", index), "transport"),
                 fmt::format("UCX carries KV in plaintext: peer at {}, off loopback, needs a loopback address or "
                             "/ucx/trusted_network",
                             peer.address.to_string()));
  }
}

std::string line_and_column(std::string_view text, std::size_t byte_offset) {
  std::size_t line = 1;
  std::size_t column = 1;
  for (std::size_t index = 0; index < std::min(byte_offset, text.size()); ++index) {
    if (text[index] == '\n') {
      ++line;
      column = 1;
    } else {
      ++column;
    }
  }
  return fmt::format("line {}, column {}", line, column);
}

}  // namespace

// The admin section (its shape here, since parse_policy reads no files; the token itself in
// read_admin_token, which load_policy_file calls) and the same-host peers' uids.
namespace {

bool is_environment_name(std::string_view name) {
  if (name.empty() || (name.front() >= '0' && name.front() <= '9')) return false;
  return std::all_of(name.begin(), name.end(), [](char c) {
    return (c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z') || (c >= '0' && c <= '9') || c == '_';
  });
}

void read_admin(const json& value, const std::string& pointer, AdminPolicy& out, Diagnostics& diag) {
  ObjectReader reader(value, pointer, diag);
  if (!reader.is_object()) return;
  reader.read_string("token_file", out.token_file, false);
  if (reader.read_string("token_env", out.token_env, false) && !is_environment_name(out.token_env)) {
    const json got = out.token_env;
    diag.expected(reader.pointer_of("token_env"), "an environment variable name ([A-Za-z_][A-Za-z0-9_]*)", &got);
  }
  reader.read_bool("require_token_for_reads", out.require_token_for_reads);
  if (!out.token_file.empty() && !out.token_env.empty()) {
    diag.problem(reader.pointer_of("token_env"), "set either token_file or token_env, not both");
  }
  if (out.require_token_for_reads && !out.names_token()) {
    diag.problem(reader.pointer_of("require_token_for_reads"), "needs a token (token_file or token_env)");
  }
  reader.reject_unknown_keys();
}

// What is wrong with a token, never quoting it: "" when it is usable.
std::string admin_token_problem(std::string_view token) {
  if (token.size() < kMinAdminTokenBytes) {
    return fmt::format("expected a token of at least {} characters, got {}", kMinAdminTokenBytes, token.size());
  }
  const auto bad = std::find_if(token.begin(), token.end(), [](char c) { return c < '!' || c > '~'; });
  if (bad != token.end()) {
    return fmt::format("the token has a character outside printable ASCII (or a space) at offset {}",
                       bad - token.begin());
  }
  return {};
}

std::string_view trim_trailing_whitespace(std::string_view text) {
  while (!text.empty() && (text.back() == '\n' || text.back() == '\r' || text.back() == ' ' || text.back() == '\t'))
    text.remove_suffix(1);
  return text;
}

// Same-host peers are told apart by the uid of their data-plane connections (SO_PEERCRED), so
// two of them may not share one.
void check_same_host_peer_uids(const Policy& policy, Diagnostics& diag) {
  for (std::size_t index = 0; index < policy.peers.size(); ++index) {
    const auto& uid = policy.peers[index].uid;
    if (!uid) continue;
    for (std::size_t earlier = 0; earlier < index; ++earlier) {
      if (policy.peers[earlier].uid == uid) {
        diag.problem(pointer_append(pointer_append("/peers", index), "uid"),
                     fmt::format("uid {} is also peer \"{}\"'s: same-host peers need uids of their own", *uid,
                                 policy.peers[earlier].id));
        break;
      }
    }
  }
}

}  // namespace

Status read_admin_token(Policy& policy) {
  AdminPolicy& admin = policy.admin;
  admin.token.clear();
  if (!admin.names_token()) return ok();
  std::string token;
  std::string pointer;
  if (!admin.token_file.empty()) {
    pointer = "/admin/token_file";
    std::string contents;
    // Sized by the token's own check below, after trailing whitespace is trimmed.
    if (auto problem = read_secret_file(admin.token_file, contents, 0)) {
      return fail(ErrorCode::kInvalidArgument, fmt::format("{}: {}: {}", policy.source, pointer, *problem));
    }
    token = std::string(trim_trailing_whitespace(contents));
  } else {
    pointer = "/admin/token_env";
    const char* value = std::getenv(admin.token_env.c_str());
    if (value == nullptr) {
      return fail(ErrorCode::kNotFound,
                  fmt::format("{}: {}: environment variable {} is not set", policy.source, pointer, admin.token_env));
    }
    token = std::string(trim_trailing_whitespace(value));
  }
  if (const auto problem = admin_token_problem(token); !problem.empty()) {
    return fail(ErrorCode::kInvalidArgument, fmt::format("{}: {}: {}", policy.source, pointer, problem));
  }
  admin.token = std::move(token);
  return ok();
}

Result<Policy> parse_policy(std::string_view json_text, std::string_view source) {
  json document;
  try {
    document = json::parse(json_text.begin(), json_text.end());
  } catch (const json::parse_error& error) {
    // nlohmann's byte index is 1-based and points just past the offending character.
    const std::size_t offset = error.byte > 0 ? error.byte - 1 : 0;
    std::string reason = error.what();
    if (const auto colon = reason.find("parse error"); colon != std::string::npos) reason = reason.substr(colon);
    return fail(ErrorCode::kInvalidArgument,
                fmt::format("{}: malformed JSON at {}: {}", source, line_and_column(json_text, offset), reason));
  } catch (const json::exception& error) {
    // A number too large for a double ("1E777", found by fuzz_policy) is out_of_range, not a
    // parse_error, and carries no position; its message quotes the literal.
    std::string reason = error.what();
    if (const auto bracket = reason.find("] "); bracket != std::string::npos) reason = reason.substr(bracket + 2);
    return fail(ErrorCode::kInvalidArgument, fmt::format("{}: malformed JSON: {}", source, reason));
  }

  Diagnostics diag{std::string(source)};
  Policy policy;
  policy.source = std::string(source);
  ObjectReader root(document, "", diag);
  if (root.is_object()) {
    if (const auto* version = root.field("schema_version", true)) {
      if (!version->is_number_integer() || version->get<std::int64_t>() != kPolicySchemaVersion) {
        diag.expected(root.pointer_of("schema_version"), fmt::format("{}", kPolicySchemaVersion), version);
      }
    }
    if (const auto* node = root.field("node", true)) {
      ObjectReader node_reader(*node, "/node", diag);
      if (node_reader.is_object()) {
        read_identifier(node_reader, "id", policy.node_id, diag);
        node_reader.reject_unknown_keys();
      }
    }
    if (const auto* listen = root.field("listen", true)) read_listen(*listen, "/listen", policy.listen, diag);
    if (const auto* admin = root.field("admin", false)) read_admin(*admin, "/admin", policy.admin, diag);
    read_array(root, "peers", policy.peers, diag,
               [&](const json& v, const std::string& p, PeerPolicy& out) { read_peer(v, p, out, diag); });
    read_array(root, "agents", policy.agents, diag,
               [&](const json& v, const std::string& p, AgentPolicy& out) { read_agent(v, p, out, diag); });
    read_array(root, "routes", policy.routes, diag,
               [&](const json& v, const std::string& p, RoutePolicy& out) { read_route(v, p, out, diag); });
    if (const auto* limits = root.field("limits", false)) read_limits(*limits, "/limits", policy.limits, diag);
    if (const auto* store = root.field("kv_store", false)) read_kv_store(*store, "/kv_store", policy.kv_store, diag);
    if (const auto* scheduler = root.field("scheduler", false)) {
      read_scheduler(*scheduler, "/scheduler", policy.scheduler, diag);
    }
    if (const auto* codecs = root.field("codecs", false)) read_codecs(*codecs, "/codecs", policy.codecs, diag);
    if (const auto* logging = root.field("logging", false)) read_logging(*logging, "/logging", policy.logging, diag);
    if (const auto* cost_model = root.field("cost_model", false)) {
      read_cost_model(*cost_model, "/cost_model", policy.cost_model, diag);
    }
    read_array(root, "tenants", policy.tenants, diag,
               [&](const json& v, const std::string& p, TenantPolicy& out) { read_tenant(v, p, out, diag); });
    if (const auto* signing = root.field("signing", false)) read_signing(*signing, "/signing", policy.signing, diag);
    if (const auto* tls = root.field("peer_tls", false)) read_peer_tls(*tls, "/peer_tls", policy.peer_tls, diag);
    if (const auto* ucx = root.field("ucx", false)) {
      read_ucx(*ucx, "/ucx", policy.ucx, diag);
      policy.ucx.enabled = true;
    }
    if (std::any_of(policy.peers.begin(), policy.peers.end(),
                    [](const PeerPolicy& peer) { return peer.transport == PeerTransport::kUcx; })) {
      policy.ucx.enabled = true;
    }
    root.field("$schema", false);  // editors' hint; ignored
    root.reject_unknown_keys();
    if (diag.empty()) fit_standard_treatments(policy);
    if (diag.empty()) check_references(policy, diag);
    if (diag.empty()) check_same_host_peer_uids(policy, diag);
    if (diag.empty()) check_tenancy(policy, diag);
    if (diag.empty()) {
      // Both are about what crosses the network in plaintext: reported together.
      check_plaintext_peers(policy, diag);
      check_ucx_peers(policy, diag);
    }
    if (diag.empty()) check_reservations(policy, diag);
  }
  if (!diag.empty()) return fail(ErrorCode::kInvalidArgument, diag.joined());
  return policy;
}

Result<Policy> load_policy_file(const std::string& path, PolicySecrets secrets) {
  std::ifstream file(path, std::ios::binary);
  if (!file) return fail(ErrorCode::kNotFound, fmt::format("{}: cannot open policy file", path));
  std::ostringstream contents;
  contents << file.rdbuf();
  if (file.bad()) return fail(ErrorCode::kIo, fmt::format("{}: read failed", path));
  KVRELAY_TRY(auto policy, parse_policy(contents.str(), path));
  if (secrets == PolicySecrets::kRead) {
    KVRELAY_TRY(read_policy_secrets(policy));
  }
  return policy;
}

Status read_policy_secrets(Policy& policy) {
  KVRELAY_TRY(read_admin_token(policy));
  Diagnostics diag{policy.source};
  for (std::size_t index = 0; index < policy.tenants.size(); ++index) {
    auto& tenant = policy.tenants[index];
    if (auto problem = read_secret_file(tenant.salt_file, tenant.salt)) {
      diag.problem(pointer_append(pointer_append("/tenants", index), "salt_file"), *problem);
    }
  }
  if (policy.signing.enabled()) {
    if (auto problem = read_secret_file(policy.signing.node_key_file, policy.signing.node_key)) {
      diag.problem("/signing/node_key_file", *problem);
    }
  }
  if (!diag.empty()) return fail(ErrorCode::kInvalidArgument, diag.joined());
  return ok();
}

}  // namespace kvrelay
