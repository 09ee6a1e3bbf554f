#pragma once

// Typed form of a kvrelay JSON policy file (config/kvrelay.schema.json is its public contract).
// Parsing validates everything up front and reports each problem with the file name and the
// JSON pointer of the offending value, so a daemon never starts (or reloads) on a bad policy.

#include <chrono>
#include <cstddef>
#include <cstdint>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "kvrelay/core/memory_strategy.h"
#include "kvrelay/core/model_fingerprint.h"
#include "kvrelay/core/result.h"
#include "kvrelay/core/treatment.h"

namespace kvrelay {

inline constexpr int kPolicySchemaVersion = 1;

struct HostPort {
  std::string host;
  std::uint16_t port = 0;  // 0: pick an ephemeral port (tests, demos)
  [[nodiscard]] std::string to_string() const;
  friend bool operator==(const HostPort&, const HostPort&) = default;
};

struct HttpUrl {
  std::string host;
  std::uint16_t port = 80;
  std::string base_path;  // without trailing slash; "" for the root
  [[nodiscard]] std::string to_string() const;
  friend bool operator==(const HttpUrl&, const HttpUrl&) = default;
};

struct ListenPolicy {
  HostPort http{"127.0.0.1", 8080};
  std::optional<HostPort> admin;            // the admin API; none when absent
  bool metrics_on_http = false;             // also serve GET /metrics on the agent listener (read live)
  std::optional<HostPort> peer;             // TCP peer plane; disabled when absent
  std::string unix_socket;                  // worker data plane; disabled when empty
  std::string unix_socket_group;            // group that may connect; "" keeps the daemon's group
  std::vector<std::uint32_t> allowed_uids;  // empty: only the daemon's own uid
};

// How chunk streams to a peer travel (issue #29). Control frames always go over the TCP (or TLS)
// peer connection, whichever the chunks take.
enum class PeerTransport : std::uint8_t { kTcp, kUcx };
// "tcp" or "ucx", as the policy spells it.
[[nodiscard]] std::string_view peer_transport_name(PeerTransport transport) noexcept;

struct PeerPolicy {
  std::string id;
  HostPort address;
  bool same_host = false;  // may use the shared-memory path instead of TCP
  // same_host only: the uid its sidecar runs as, which its data-plane connections must carry
  // (SO_PEERCRED); none: this daemon's own uid, so its connections are a worker's.
  std::optional<std::uint32_t> uid;
  std::string identity;  // what its TLS certificate must name (DNS or URI SAN); "" = address.host
  // Spills exchanged with this peer (issue #27; live): on a receiver, the bytes of this peer's
  // spilled entries its store may hold; on a sender, nonzero makes the peer a spill target.
  std::uint64_t accept_spill_bytes = 0;
  // How chunk streams to this peer travel; control frames always go over the TCP/TLS peer
  // connection. Read at start.
  PeerTransport transport = PeerTransport::kTcp;
};

struct AgentPolicy {
  std::string id;
  HttpUrl upstream;
  ModelFingerprint model;
  int role_priority = 0;      // 0..7
  bool kv_connector = false;  // upstream accepts kv_transfer_params.kvrelay
  std::string node;           // node that serves this agent; "" = this node
  std::optional<HttpUrl> metrics_url;
  bool accepts_sparse_kv = false;  // receiver declared support for position-sparse KV
  // Receiver declared it imports KV that does not start at position 0, after prefilling what
  // precedes it (audit span "generated", T2). vLLM's connector API reuses leading prefixes only.
  bool accepts_kv_spans = false;
  std::string tenant;                      // a tenant id from Policy::tenants; "" = the unsalted default tenant
  std::uint32_t tensor_parallel_size = 1;  // its engine's TP ranks: each publishes and loads one shard
};

// Media a transfer can use. Plugin codecs appear as "codec:<name>".
// `summary` (docs/summary.md) replaces A's context by a summary of it: it moves no KV, and a
// route takes it only when it names it (allowed_media, forced_medium or an audit treatment).
inline constexpr std::string_view kSummaryMedium = "summary";
inline constexpr std::string_view kBuiltinMedia[] = {"tokens",  "kv_raw",  "kv_lossless", "kv_fp8",
                                                     "kv_int8", "kv_int4", "kv_sparse",   kSummaryMedium};
[[nodiscard]] bool is_known_medium(std::string_view medium) noexcept;

// A route's online audit: a `fraction` of its requests get a uniformly random treatment from
// `treatments` instead of the decision; assignments and outcomes are appended to `trials_file`
// ("" keeps them in memory only) and served at GET /admin/audit/report.
struct RouteAuditPolicy {
  double fraction = 0.0;              // 0..1
  std::vector<Treatment> treatments;  // core/treatment.h
  std::string trials_file;
  // Treatments a client names in kv_transfer_params.kvrelay (the offline audit runner) are
  // honoured; otherwise the front proxy drops them and logs it.
  bool client_treatments = false;
  // Live calibration (issue #28): "live" refits the engine's per-medium audit correction on this
  // route from its audited outcomes every `calibrate_window` of them, moving it at most
  // `calibrate_max_step_s` per refit (broker/live_calibration.h).
  bool calibrate_live = false;
  std::uint32_t calibrate_window = 16;
  double calibrate_max_step_s = 0.05;
  // Not in the JSON: the treatments are audit_fraction's T0..T3 (those the route and its
  // receiver can take), not a list the operator wrote.
  bool standard_treatments = false;
  friend bool operator==(const RouteAuditPolicy&, const RouteAuditPolicy&) = default;
};

// T0..T3 over kv_raw, the treatments used when a route sets only audit_fraction.
[[nodiscard]] std::vector<Treatment> default_audit_treatments();

// How the front proxy has A's context summarised when a handoff on the route uses the summary
// medium (docs/summary.md). Read per request.
struct RouteSummaryPolicy {
  // An OpenAI-compatible base URL, asked at <base>/v1/completions; none: the from-agent's upstream.
  std::optional<HttpUrl> summariser;
  std::uint32_t max_tokens = 64;  // the summary's token budget
  // Text prompts: what replaces A's context in B's prompt; "{summary}" stands for the summary.
  std::string prompt_template = "Summary of the earlier context: {summary}\n\n";
  // Text prompts: appended to A's context in the request to the summariser.
  std::string instruction = "\n\nSummarize the text above.\nSummary:";
  std::string model;  // the summariser request's "model"; "" leaves it out
  std::chrono::milliseconds timeout{30'000};
  friend bool operator==(const RouteSummaryPolicy&, const RouteSummaryPolicy&) = default;
};

struct RoutePolicy {
  std::string id;
  std::string from_agent;
  std::string to_agent;
  bool enabled = true;
  std::vector<std::string> allowed_media;  // empty: every medium
  std::optional<std::string> forced_medium;
  int priority = 0;  // 0..7
  std::optional<std::chrono::milliseconds> deadline;
  double audit_fraction = 0.0;         // 0..1; equals audit.fraction
  RouteAuditPolicy audit;              // treatments default to T0..T3 (kv_raw)
  double hysteresis_threshold = 0.15;  // relative predicted gain needed to switch medium
  double quality_floor = 0.0;          // 0..1, minimum fidelity product along a lossy chain
  bool push = false;                   // publish pushes KV ahead to the destination's sidecar
  // Issue #27: a critical route (periodic syncs, heartbeats) gets `reserved_share` of each link
  // its transfers cross whenever it has work; the shares of all critical routes add up to at
  // most scheduler.max_reserved_share.
  bool critical = false;
  double reserved_share = 0.0;  // 0..0.9; > 0 only on a critical route
  RouteSummaryPolicy summary;
};

// Whether the route names the summary medium in allowed_media or forced_medium (an empty
// allowed_media, "every medium", does not include it).
[[nodiscard]] bool route_allows_summary(const RoutePolicy& route) noexcept;

struct LimitsPolicy {
  std::uint32_t max_header_bytes = 16 * 1024;
  std::uint64_t max_body_bytes = 16ULL * 1024 * 1024;
  std::chrono::milliseconds read_timeout{30'000};
  std::chrono::milliseconds upstream_timeout{600'000};
  std::chrono::milliseconds idle_timeout{60'000};
  std::uint32_t max_connections = 1024;
  std::uint32_t max_queued_responses = 64;
  std::uint64_t kv_store_bytes = 1ULL << 30;
  // Peer transfer buffers kept warm between fetches, per side (fetching, serving); read at start.
  std::uint64_t peer_buffer_bytes = 192ULL << 20;
  // Peer chunks pass through one reused buffer on each side, moved by the checksum pass, instead
  // of the kernel copying them to and from the entry's memory (docs/transports.md, "Staged
  // chunks"); read at start by the receiving side, per transfer by the sending side.
  bool peer_staging = true;
  // The shared-memory arena entries live in (0: one sealed memfd per entry); read at start.
  std::uint64_t shm_arena_bytes = 256ULL << 20;
  // Whether long-lived shared memory is prefaulted by background threads (memory_strategy.h);
  // read at start.
  MemoryStrategy memory_strategy = kDefaultMemoryStrategy;
  std::chrono::milliseconds probe_interval{1'000};  // scrape of agents' metrics_url
  // Longest a worker's KV lookup may wait on peers before the sidecar answers "miss".
  std::chrono::milliseconds kv_lookup_timeout{2'000};
  // How long a reserving Resolve's answer waits for the worker's Claim (data plane v6); read at start.
  std::chrono::milliseconds kv_reservation{30'000};
  // How often the sidecar asks each peer which KV chains it holds (0: only on demand).
  std::chrono::milliseconds peer_summary_interval{1'000};
  // A peer whose link carried no measured transfer this long is sent a bandwidth probe (1 MiB
  // of filler, at most); 0: never. Checked at each summary round.
  std::chrono::milliseconds peer_bandwidth_probe_interval{30'000};
};

// How the KV store chooses what to drop when it needs room (docs/configuration.md, kv_store.*).
enum class EvictionKind : std::uint8_t {
  kUtility,  // lowest (1 + log2(1 + hits)) * exp(-age / recency_tau_s) * (1 + route priority) first
  kLru,      // least recently used first
};

struct StorePolicy {
  EvictionKind eviction = EvictionKind::kUtility;  // read at start
  double recency_tau_s = 60.0;                     // > 0; live
  // Spill (live): a budget victim of at least this utility is encoded with spill_medium's codec
  // and pushed to a peer that accepts spills, leaving a stub; at most spill_inflight_bytes of
  // victims wait for their push at once (more are dropped).
  double spill_min_utility = 1.5;
  std::string spill_medium = "kv_lossless";
  std::uint64_t spill_inflight_bytes = 64ULL << 20;
  // Prefetch (live): a publish sends its entry ahead, at background priority, to the remote
  // destinations of the agent's enabled routes that do not push (or only to the request's
  // next_agents among them), when the entry is at most prefetch_max_bytes.
  bool prefetch = true;
  std::uint64_t prefetch_max_bytes = 256ULL << 20;
};

// How peer transfers share each link (issue #27; docs/configuration.md, scheduler.*). Read at
// start: the daemon builds its link queues from it once.
enum class SchedulerMode : std::uint8_t {
  kWrr,   // weighted round robin with preemption, reservations and deadline raising
  kFifo,  // one transfer at a time in arrival order (the benchmarks' baseline)
  kOff,   // streams are not scheduled: each chunk goes as soon as its window allows
};

struct SchedulerPolicy {
  SchedulerMode mode = SchedulerMode::kWrr;
  std::chrono::milliseconds time_slice{10};  // 5..20
  std::uint32_t chunk_bytes = 256 * 1024;    // a grant is one chunk of a gated stream
  std::uint32_t window_chunks = 4;           // granted, unacknowledged chunks per link (>= 2)
  double base = 1.0;                         // urgency = base + alpha * exp(beta * queue delay in s)
  double alpha = 1.0;
  double beta = 10.0;
  double preempt_factor = 2.0;    // a waiting transfer this many times heavier preempts...
  double preempt_max_done = 0.4;  // ...a running one less than this far done
  double max_reserved_share = 0.5;
  double link_bytes_per_s = 0.0;           // > 0: pace each link to this rate; 0: no pacing
  std::chrono::milliseconds max_stall{0};  // 0: limits.read_timeout / 4
};

struct CodecPolicy {
  std::vector<std::string> plugin_dirs;
  // Where the sidecar runs the codecs that have GPU kernels (fp8, int8, int4): "cpu", "cuda"
  // (startup fails without a usable device) or "auto" (CUDA when a device is found). Read at start.
  std::string device = "cpu";
};

struct LoggingPolicy {
  std::string level = "info";   // trace, debug, info, warn, error, critical, off
  std::string format = "text";  // text or json
  std::string file;             // "" = stderr
};

// Cost-model parameters an operator sets (typically from `kvrelay audit calibrate`), overriding
// the decision engine's priors: per receiving agent its prefill fit and decode time, per medium
// its calibrated quality.
struct AgentCostModel {
  std::optional<double> prefill_a_s;  // t(n, cached) = a + b n + c n (n + 2 cached)
  std::optional<double> prefill_b_s;
  std::optional<double> prefill_c_s;
  std::optional<double> decode_s_per_token;
};

struct MediumCostModel {
  std::optional<double> fidelity;               // (0, 1]
  std::optional<double> extra_decode_fraction;  // >= 0
};

struct CostModelPolicy {
  std::vector<std::pair<std::string, AgentCostModel>> agents;  // by agent id
  std::vector<std::pair<std::string, MediumCostModel>> media;  // by medium name
  [[nodiscard]] bool empty() const noexcept { return agents.empty() && media.empty(); }
  // The policy's calibration of `name`; null when it has none.
  [[nodiscard]] const MediumCostModel* medium(std::string_view name) const noexcept;
};

// The admin API's credential (docs/security.md). Without a token the admin API is
// read-only. `token` is a secret: nothing logs it or serves it at any endpoint.
struct AdminPolicy {
  std::string token_file;                // read at load (start and every reload), trailing whitespace trimmed
  std::string token_env;                 // or the name of an environment variable holding it; never both
  bool require_token_for_reads = false;  // GET endpoints need it too (health probes never do)
  std::string token;                     // filled by load_policy_file; "" = none configured
  [[nodiscard]] bool names_token() const noexcept { return !token_file.empty() || !token_env.empty(); }
};

inline constexpr std::size_t kMinAdminTokenBytes = 16;

// Whether loading reads the secrets a policy names (the admin token, tenant salts, the node
// key): the daemon and check-config do; tools that need only the policy's shape may skip them.
enum class PolicySecrets { kRead, kSkip };

// Tenant isolation (docs/security.md). Each tenant's KV chains start at a root derived
// from its secret salt (and the request's cache_salt), so KV is never shared across tenants; the
// front proxy signs the kvrelay fields it injects with the node key, and the KV path treats
// unsigned or forged fields as absent. Secrets are read from files by load_policy_file (at start
// and on every reload) and never logged or shown at any endpoint.
inline constexpr std::size_t kMinSecretBytes = 16;
inline constexpr std::size_t kMaxSecretBytes = 4096;

struct TenantPolicy {
  std::string id;
  std::string salt_file;
  std::string salt;  // the file's bytes (read_policy_secrets)
};

struct SigningPolicy {
  // "": the front proxy signs nothing and the KV path trusts a worker's kvrelay fields as they
  // are (no tenants may be configured then).
  std::string node_key_file;
  std::string node_key;  // the file's bytes (read_policy_secrets)
  [[nodiscard]] bool enabled() const noexcept { return !node_key_file.empty(); }
};
// Peer TLS (issue #25): TLS 1.3 with mutual authentication on the peer plane. The three files
// are set together (TLS on) or not at all; without them peers are plaintext, which the policy
// allows only on loopback unless `trusted_network` says the network itself is trusted.
struct PeerTlsPolicy {
  std::string certificate;  // PEM: this node's certificate (chain), presented to every peer
  std::string private_key;  // PEM: its key
  std::string ca_bundle;    // PEM: the CAs whose certificates may connect, and that peers must have
  bool trusted_network = false;
  [[nodiscard]] bool enabled() const noexcept { return !certificate.empty(); }
};
// UCX peer transport (issue #29; read at start). UCX carries KV in plaintext: only loopback
// peers, or any with trusted_network.
struct UcxPolicy {
  // The section is present, or a peer uses transport "ucx": this node offers and uses UCX.
  bool enabled = false;
  std::string tls = "posix,tcp";        // UCX_TLS for kvrelay's UCP context
  std::string net_devices = "lo";       // UCX_NET_DEVICES: loopback only unless set (one machine)
  std::uint64_t rndv_thresh_bytes = 0;  // UCX_RNDV_THRESH; 0: UCX chooses ("auto")
  bool trusted_network = false;         // UCX allowed with peers off loopback (an RDMA fabric inside a cluster)
};
struct PeerPolicy;
// The name a peer's certificate must carry as a DNS or URI SAN: its `identity`, else its host.
[[nodiscard]] const std::string& peer_identity(const PeerPolicy& peer) noexcept;
// 127.0.0.0/8, ::1 or "localhost".
[[nodiscard]] bool is_loopback_host(std::string_view host) noexcept;

struct Policy {
  int schema_version = kPolicySchemaVersion;
  std::string node_id;
  ListenPolicy listen;
  AdminPolicy admin;
  std::vector<PeerPolicy> peers;
  std::vector<AgentPolicy> agents;
  std::vector<RoutePolicy> routes;
  LimitsPolicy limits;
  StorePolicy kv_store;
  SchedulerPolicy scheduler;
  CodecPolicy codecs;
  LoggingPolicy logging;
  CostModelPolicy cost_model;
  std::vector<TenantPolicy> tenants;
  SigningPolicy signing;
  PeerTlsPolicy peer_tls;
  UcxPolicy ucx;
  std::string source;  // file the policy came from, for messages

  [[nodiscard]] const AgentPolicy* find_agent(std::string_view id) const noexcept;
  [[nodiscard]] const RoutePolicy* find_route(std::string_view id) const noexcept;
  [[nodiscard]] const PeerPolicy* find_peer(std::string_view id) const noexcept;
  // Whether any peer has accept_spill_bytes (issue #27: this node may spill to it).
  [[nodiscard]] bool any_peer_accepts_spills() const noexcept;
  [[nodiscard]] const TenantPolicy* find_tenant(std::string_view id) const noexcept;
};

// Parses and validates; on failure the error message lists every problem found, one per line,
// each as "<source>: <json pointer>: <what was expected>, got <value>".
[[nodiscard]] Result<Policy> parse_policy(std::string_view json_text, std::string_view source);
// parse_policy reads no files; load_policy_file also reads the secrets (read_policy_secrets)
// unless told to skip them.
[[nodiscard]] Result<Policy> load_policy_file(const std::string& path, PolicySecrets secrets = PolicySecrets::kRead);
// Reads the admin token (read_admin_token), every tenant's salt_file and signing.node_key_file
// into the policy. A file that is missing, unreadable, not a regular file, or not
// kMinSecretBytes..kMaxSecretBytes long fails, naming its JSON pointer and path (never its contents).
[[nodiscard]] Status read_policy_secrets(Policy& policy);
// Fills policy.admin.token from its file or variable; errors name /admin/token_file or /admin/token_env.
[[nodiscard]] Status read_admin_token(Policy& policy);

[[nodiscard]] Result<HostPort> parse_host_port(std::string_view text);
[[nodiscard]] Result<HttpUrl> parse_http_url(std::string_view text);

}  // namespace kvrelay
