#include "kvrelay/proxy/daemon.h"

#include <unistd.h>

#include <boost/asio/io_context.hpp>
#include <boost/asio/signal_set.hpp>
#include <boost/asio/steady_timer.hpp>
#include <fmt/format.h>
#include <fmt/ranges.h>
#include <nlohmann/json.hpp>
#include <spdlog/spdlog.h>

#include <atomic>
#include <cstdio>
#include <thread>
#include <vector>

#include "kvrelay/broker/kv_path.h"
#include "kvrelay/broker/link_queues.h"
#include "kvrelay/broker/peer_links.h"
#include "kvrelay/broker/spiller.h"
#include "kvrelay/broker/utility_eviction.h"
#include "kvrelay/codec_plugins/device_codecs.h"
#include "kvrelay/codec_plugins/registry.h"
#include "kvrelay/core/file_io.h"
#include "kvrelay/core/metrics.h"
#include "kvrelay/core/policy.h"
#include "kvrelay/decision/media.h"
#include "kvrelay/kv_store/entry_store.h"
#include "kvrelay/peer/peer_server.h"
#include "kvrelay/peer/peer_tls.h"
#include "kvrelay/peer/ucx_transport.h"
#include "kvrelay/proxy/admin_endpoints.h"
#include "kvrelay/proxy/admin_router.h"
#include "kvrelay/proxy/front_proxy.h"
#include "kvrelay/proxy/http_server.h"
#include "kvrelay/proxy/logging.h"
#include "kvrelay/proxy/memory_limit.h"
#include "kvrelay/proxy/upstream_prober.h"
#include "kvrelay/proxy/version.h"
#include "kvrelay/shm_transport/server.h"

#include "admin_console.h"
#include "kv_admin.h"
#include "kv_store_metrics.h"
#include "shm_metrics.h"

namespace kvrelay::proxy {

namespace asio = boost::asio;

namespace {

constexpr std::chrono::seconds kDrainDeadline{20};
constexpr std::chrono::seconds kTlsWatchInterval{2};

struct DaemonState {
  std::atomic<bool> ready{false};
  std::atomic<bool> draining{false};
};

// admin_port and peer_port are 0 when the policy has no such listener; the file then omits them.
Status write_ready_file(const std::string& path, std::uint16_t http_port, std::uint16_t admin_port,
                        std::uint16_t peer_port, const std::string& unix_socket) {
  nlohmann::json body{{"pid", ::getpid()}, {"http", http_port}};
  if (admin_port != 0) body["admin"] = admin_port;
  if (peer_port != 0) body["peer"] = peer_port;
  if (!unix_socket.empty()) body["unix_socket"] = unix_socket;
  return write_file_atomically(path, body.dump() + "\n");
}

// What the agent-facing listener answers besides /agents/{agent}/v1/...: health, and /metrics
// when the policy asks. Agents must not reach the admin API (routes, reload, KV), so every other
// path is a 404 that says where the admin API is, or that this policy has none.
HttpResponse serve_agent_listener_extra(const HttpRequest& request, const AdminRouter& admin_router,
                                        const RuntimePolicy& runtime_policy) {
  std::string_view path = request.target();
  path = path.substr(0, path.find('?'));
  const auto policy = runtime_policy.current();
  if (path == "/healthz" || path == "/readyz" || (path == "/metrics" && policy->listen.metrics_on_http)) {
    return admin_router.handle(request);
  }
  std::string message;
  if (path == "/metrics") {
    message = "/metrics is not served on the agent listener; set listen.metrics_on_http or use listen.admin";
  } else if (policy->listen.admin) {
    message = fmt::format(
        "no endpoint at {} on the agent listener (it serves /agents/{{agent}}/v1/...); the admin "
        "API is on the admin listener (listen.admin)",
        path);
  } else {
    message = fmt::format(
        "no endpoint at {} on the agent listener (it serves /agents/{{agent}}/v1/...); this "
        "policy has no listen.admin, so there is no admin API",
        path);
  }
  return make_json_error(http::status::not_found, "not_found", message, request.version(), request.keep_alive());
}

}  // namespace

int run_daemon(const DaemonOptions& options) {
  auto loaded = load_policy_file(options.config_path);
  if (!loaded) {
    // Logging is not configured yet: report on stderr exactly what check-config would print.
    std::fprintf(stderr, "kvrelay: invalid policy:\n%s\n", loaded.error().message.c_str());
    return 2;
  }
  const auto initial_policy = std::make_shared<const Policy>(std::move(loaded).value());
  const auto* policy = initial_policy.get();  // start-up settings; live settings come from runtime_policy
  if (auto logging = configure_logging(policy->logging); !logging) {
    std::fprintf(stderr, "kvrelay: %s\n", logging.error().to_string().c_str());
    return 2;
  }
  spdlog::info("kvrelay {} starting: node {}, policy {} ({} agents, {} routes, {} peers)", kVersion, policy->node_id,
               policy->source, policy->agents.size(), policy->routes.size(), policy->peers.size());
  // Before the arena and the store exist: shared memory past the container's limit would meet
  // the OOM killer at the first burst, not evictions. Reloads are held to the same check.
  const auto memory_limit = container_memory_limit(options.cgroup_root, options.self_cgroup);
  if (auto fits = check_memory_budget(*policy, memory_limit); !fits) {
    spdlog::critical("{}", fits.error().message);
    return 2;
  }
  const auto budget = memory_budget(*policy);
  if (memory_limit) {
    spdlog::info("memory: the policy commits {} of the container's memory limit {} ({}): {}",
                 memory_size_text(budget.total), memory_size_text(memory_limit->bytes), memory_limit->file,
                 budget.breakdown());
  } else {
    spdlog::info("memory: no container memory limit found; the policy commits {}: {}", memory_size_text(budget.total),
                 budget.breakdown());
  }

  asio::io_context io;
  // Signals are claimed before anything can announce readiness: a supervisor that sends SIGHUP
  // or SIGTERM as soon as the ready file appears must not meet the default action (exit).
  asio::signal_set reload_signal(io, SIGHUP);
  asio::signal_set signals(io, SIGINT, SIGTERM);
  auto state = std::make_shared<DaemonState>();
  const auto limits = HttpServerLimits::from_policy(policy->limits);

  auto registry = std::make_shared<metrics::Registry>();
  auto runtime_policy = std::make_shared<RuntimePolicy>(options.config_path, initial_policy, *registry);
  runtime_policy->set_reload_check([root = options.cgroup_root, self = options.self_cgroup](const Policy& next) {
    return check_memory_budget(next, container_memory_limit(root, self));
  });
  auto online_audit = std::make_shared<OnlineAudit>();
  // Lookups file what they delivered of audited treatments; the front proxy files it with the outcome.
  auto deliveries = std::make_shared<broker::Deliveries>();
  auto front_proxy = std::make_shared<FrontProxy>(runtime_policy, *registry, online_audit, deliveries);

  // The KV path: medium decisions, peer fetches and pushes behind the worker data plane.
  auto codecs = std::make_shared<codec::CodecRegistry>(codec::CodecRegistry::with_builtins());
  // A refused plugin is logged by the loader and listed at /admin/codecs; the daemon runs on.
  auto codec_load_failures = codecs->load_directories(policy->codecs.plugin_dirs);
  // A GPU the operator asked for and cannot have is a configuration error, like a bad policy.
  auto placement = codec::place_codecs(*codecs, policy->codecs.device);
  if (!placement) {
    spdlog::critical("{}: /codecs/device: {}", policy->source, placement.error().to_string());
    return 2;
  }
  if (!placement.value().on_gpu.empty()) {
    spdlog::info("codecs on the GPU: {}", fmt::join(placement.value().on_gpu, ", "));
  } else if (policy->codecs.device != "cpu") {
    spdlog::warn("codecs.device \"{}\": codecs stay on the CPU ({})", policy->codecs.device,
                 placement.value().cpu_reason);
  }
  // Worker data plane (Unix socket + shared memory) and peer plane share one store: an entry
  // received from a peer is what a local worker's lookup finds.
  // It drops the lowest-utility entries first (kv_store.eviction), with the live policy's tau.
  std::unique_ptr<kv_store::EvictionPolicy> eviction;
  if (policy->kv_store.eviction == EvictionKind::kUtility) {
    eviction = std::make_unique<broker::UtilityEviction>(
        [runtime_policy] { return runtime_policy->current()->kv_store.recency_tau_s; });
  } else {
    eviction = std::make_unique<kv_store::LruEviction>();
  }
  auto entry_store = std::make_shared<kv_store::InMemoryEntryStore>(policy->limits.kv_store_bytes, std::move(eviction));
  auto peer_links = std::make_shared<broker::PeerLinks>(runtime_policy, *registry);
  std::shared_ptr<peer::PeerTls> peer_tls;  // issue #25: the peer plane's TLS, when the policy has peer_tls
  if (policy->peer_tls.enabled()) {
    auto loaded_tls = peer::PeerTls::load(policy->peer_tls);
    if (!loaded_tls) {
      spdlog::critical("{}: /peer_tls: {}", policy->source, loaded_tls.error().to_string());
      return 2;
    }
    peer_tls = std::move(loaded_tls).value();
    peer_links->set_tls(peer_tls);
  }
  std::shared_ptr<peer::UcxContext> ucx;  // issue #29: when the policy has a ucx section or a ucx peer
  if (policy->ucx.enabled) {
    auto created = peer::UcxContext::create(policy->ucx);
    if (!created) {
      spdlog::critical("{}: /ucx: {}", policy->source, created.error().to_string());
      return 2;
    }
    ucx = std::move(created).value();
    peer_links->set_ucx(ucx);
    spdlog::info("UCX peer transport: UCX_TLS={} UCX_NET_DEVICES={}", policy->ucx.tls, policy->ucx.net_devices);
  }
  auto kv_path = std::make_shared<broker::KvPath>(runtime_policy, entry_store, codecs, peer_links, *registry);
  kv_path->set_deliveries(deliveries);
  front_proxy->set_audit_observer([weak = std::weak_ptr<broker::KvPath>(kv_path)](
                                      const std::string& route, const broker::Delivery& delivery, double ttft_s) {
    if (const auto path = weak.lock()) path->observe_audited_outcome(route, delivery, ttft_s);
  });
  // Issue #28, the summary medium (docs/summary.md): the front proxy asks the KV path how much of
  // B's prompt is A's published context and what the engine predicts, and files each summary.
  SummaryHooks summary_hooks;
  summary_hooks.handoff_span = [weak = std::weak_ptr<broker::KvPath>(kv_path)](const HandoffQuery& query) {
    const auto path = weak.lock();
    if (!path) return HandoffSpanAnswer{};
    const auto span = path->handoff_span(query.policy, query.route, query.prompt, query.chain_root, query.tenant);
    return HandoffSpanAnswer{span.tokens, span.receiver_cached};
  };
  summary_hooks.predict = [weak = std::weak_ptr<broker::KvPath>(kv_path)](
                              const Policy& current, const RoutePolicy& route, const decision::TransferShape& shape,
                              nlohmann::json& cost) -> std::optional<std::string> {
    const auto path = weak.lock();
    if (!path) return std::nullopt;
    auto advice = path->predict_handoff(current, route, shape, cost);
    if (!advice) return std::nullopt;
    return std::move(advice->medium);
  };
  summary_hooks.record = [weak = std::weak_ptr<broker::KvPath>(kv_path)](
                             nlohmann::json record, const std::string& route, std::string_view outcome,
                             std::optional<double> summariser_seconds) {
    if (const auto path = weak.lock()) path->record_summary(std::move(record), route, outcome, summariser_seconds);
  };
  front_proxy->set_summary_hooks(std::move(summary_hooks));
  // Issue #27: a codec's fidelity factor, which peer transfers stamp into their fidelity product:
  // 1 for lossless codecs, else the live policy's cost_model.media[].fidelity for its medium, else
  // the media catalogue's default (decision/media.h).
  const peer::CodecFactor codec_factor = [runtime_policy, codecs](std::string_view spec) {
    const auto resolved = codec::resolve_codec(*codecs, spec);
    if (resolved && resolved.value().codec->lossless()) return 1.0;
    const std::string medium = decision::medium_for_codec_spec(resolved ? resolved.value().codec->name() : spec);
    const auto current = runtime_policy->current();
    const MediumCostModel* model = current->cost_model.medium(medium);
    return model != nullptr && model->fidelity ? *model->fidelity : decision::builtin_medium(medium).profile.fidelity;
  };
  peer_links->set_codec_factor(codec_factor);
  // Issue #27: every fetch reply and push this node sends waits in its link's queue for each
  // chunk (scheduler.mode "off": none, chunks go as their window allows).
  std::shared_ptr<broker::LinkQueues> link_queues;
  if (policy->scheduler.mode != SchedulerMode::kOff) {
    broker::LinkQueuesOptions queue_options;
    queue_options.decision_log = &kv_path->decision_log();
    auto created = broker::LinkQueues::create(runtime_policy, broker::scheduler_config(policy->scheduler), *registry,
                                              std::move(queue_options));
    if (!created) {
      spdlog::critical("{}: {}", policy->source, created.error().message);
      return 2;
    }
    link_queues = std::move(created).value();
    peer_links->set_gate(link_queues);
  }
  // Issue #27: budget victims worth keeping go to a peer that takes spills (a stub stays here).
  auto spiller = std::make_shared<broker::Spiller>(runtime_policy, entry_store, codecs, peer_links, *registry,
                                                   kv_path->decision_log());
  entry_store->set_spill_sink(spiller);
  peer_links->set_rtt_observer(
      [path = kv_path.get()](const std::string& peer, double seconds) { path->observe_peer_rtt(peer, seconds); });
  peer_links->set_probe_observer([path = kv_path.get()](const std::string& peer, std::uint64_t bytes, double seconds) {
    path->observe_peer_transfer(peer, bytes, seconds);
  });
  auto upstream_prober = std::make_shared<UpstreamProber>(
      io, runtime_policy, *registry, [kv_path](const std::string& agent, const UpstreamLoad& load) {
        if (load.requests_waiting) kv_path->observe_load(agent, *load.requests_waiting);
        if (load.recent_tpot_s) kv_path->observe_decode(agent, *load.recent_tpot_s);
      });

  AdminContext admin_context;
  admin_context.policy = runtime_policy;
  admin_context.registry = registry;
  admin_context.is_ready = [state] { return state->ready.load() && !state->draining.load(); };
  admin_context.codecs = codecs;
  admin_context.codec_load_failures = std::move(codec_load_failures);
  admin_context.upstream_prober = upstream_prober;
  admin_context.audit = online_audit;
  admin_context.live_calibration = [weak = std::weak_ptr<broker::KvPath>(kv_path)]() {
    const auto path = weak.lock();
    return path ? path->live_calibration() : nlohmann::json();
  };
  admin_context.extra_endpoints = kv_admin_endpoints(kv_path, entry_store, link_queues,
                                                     [upstream_prober] { return upstream_prober->snapshot_json(); });
  for (auto& endpoint : console_endpoints())
    admin_context.extra_endpoints.push_back(std::move(endpoint));
  auto shm_metrics = std::make_shared<ShmServerMetrics>(*registry);
  auto store_metrics = std::make_shared<KvStoreMetrics>(*registry, entry_store);
  admin_context.before_metrics = [shm_metrics, store_metrics] {
    shm_metrics->refresh();
    store_metrics->refresh();
  };
  auto admin_router = std::make_shared<AdminRouter>(build_admin_endpoints(admin_context),
                                                    [runtime_policy] { return runtime_policy->current(); });
  const Dispatcher admin_dispatcher = [admin_router](HttpRequest&& request) -> Reply {
    return admin_router->handle(request);
  };
  // The agent listener never serves the admin API; only listen.admin does.
  const Dispatcher main_dispatcher = [front_proxy, admin_router, runtime_policy](HttpRequest&& request) -> Reply {
    if (parse_agent_target(request.target())) return front_proxy->dispatch(std::move(request));
    return serve_agent_listener_extra(request, *admin_router, *runtime_policy);
  };

  HttpServer main_server(io, limits, main_dispatcher);
  if (auto listening = main_server.listen(policy->listen.http); !listening) {
    spdlog::critical("cannot listen for HTTP: {}", listening.error().to_string());
    return 1;
  }
  std::unique_ptr<HttpServer> admin_server;
  if (policy->listen.admin) {
    admin_server = std::make_unique<HttpServer>(io, limits, admin_dispatcher);
    if (auto listening = admin_server->listen(*policy->listen.admin); !listening) {
      spdlog::critical("cannot listen for admin: {}", listening.error().to_string());
      return 1;
    }
  }
  std::unique_ptr<shm::ShmServer> shm_server;
  if (!policy->listen.unix_socket.empty()) {
    shm::ShmServerOptions shm_options;
    shm_options.socket_path = policy->listen.unix_socket;
    shm_options.socket_group = policy->listen.unix_socket_group;
    shm_options.allowed_uids = policy->listen.allowed_uids;
    shm_options.same_host_peers = [runtime_policy] {
      std::vector<shm::SameHostPeerUid> peers;
      for (const auto& peer : runtime_policy->current()->peers)
        if (peer.same_host && peer.uid) peers.push_back({peer.id, *peer.uid});
      return peers;
    };
    shm_options.max_region_bytes = policy->limits.kv_store_bytes;
    shm_options.arena_bytes = policy->limits.shm_arena_bytes;
    shm_options.memory_strategy = policy->limits.memory_strategy;
    shm_options.reservation_ttl = policy->limits.kv_reservation;
    auto listening = shm::ShmServer::listen(shm_options, entry_store);
    if (!listening) {
      spdlog::critical("cannot listen on unix socket: {}", listening.error().to_string());
      return 1;
    }
    shm_server = std::move(listening).value();
    kv_path->set_arena(shm_server->arena());
    shm_server->set_hooks(kv_path);
    shm_server->start();
    shm_metrics->attach(shm_server.get());
  }
  std::unique_ptr<peer::PeerServer> peer_server;
  if (policy->listen.peer) {
    peer::PeerServerOptions peer_options;
    peer_options.node_id = policy->node_id;
    peer_options.shm_socket = policy->listen.unix_socket;
    peer_options.idle_timeout = policy->limits.idle_timeout;
    peer_options.max_entry_bytes = policy->limits.kv_store_bytes;
    peer_options.warm_buffer_bytes = policy->limits.peer_buffer_bytes;
    if (shm_server) peer_options.arena = shm_server->arena();
    if (ucx) {
      peer_options.ucx = ucx;
      peer_options.ucx_workers = std::max(1U, options.io_threads);
      peer_options.ucx_trusted_network = policy->ucx.trusted_network;
      // Received and served KV lies in the arena: registered once, for every transfer.
      if (shm_server) {
        if (auto registered = ucx->register_memory(shm_server->arena()->bytes()); !registered) {
          spdlog::warn("UCX: the arena is not registered ({}): UCX registers per transfer", registered.error().message);
        }
      }
    }
    peer_options.stage_chunks = policy->limits.peer_staging;
    peer_options.codecs = codecs;
    peer_options.on_kv_bytes = [path = kv_path.get()](const peer::KvBytesEvent& event) { path->record_peer_kv(event); };
    peer_options.tls = peer_tls;
    peer_options.policy = [runtime_policy] { return runtime_policy->current(); };
    peer_options.on_refused = [links = peer_links.get()](std::string_view reason) { links->note_refused(reason); };
    peer_options.codec_factor = codec_factor;
    peer_options.store_budget_bytes = policy->limits.kv_store_bytes;
    peer_options.gate = link_queues;
    // The link toward the asker: its configured rate, and what went to it since the last summary.
    peer_options.node_state = [runtime_policy, link_queues](std::string_view peer_id, peer::NodeState& reported) {
      reported.link_bytes_per_s = static_cast<std::uint64_t>(runtime_policy->current()->scheduler.link_bytes_per_s);
      if (link_queues) reported.sent_bytes_per_s = link_queues->sent_bytes_per_s(std::string(peer_id));
    };
    peer_server = std::make_unique<peer::PeerServer>(io, peer_options, entry_store);
    if (auto listening = peer_server->listen(*policy->listen.peer); !listening) {
      spdlog::critical("cannot listen for peers: {}", listening.error().to_string());
      return 1;
    }
  }
  const std::uint16_t peer_port = peer_server ? peer_server->local_endpoint().port() : 0;
  const auto http_port = main_server.local_endpoint().port();
  const std::uint16_t admin_port = admin_server ? admin_server->local_endpoint().port() : 0;
  spdlog::info("listening: http {}:{}, admin port {}, peer port {}, unix socket '{}'", policy->listen.http.host,
               http_port, admin_port, peer_port, policy->listen.unix_socket);
  if (!admin_server) {
    spdlog::info("no listen.admin in the policy: no admin API (/admin/...); SIGHUP reloads the policy{}",
                 policy->listen.metrics_on_http ? "" : ", and /metrics is off (listen.metrics_on_http)");
  } else if (policy->admin.token.empty()) {
    spdlog::warn("no admin token configured (/admin/token_file): the admin API is read-only");
  } else {
    spdlog::info("admin API: changes need {}{}", admin_token_label(policy->admin.token),
                 policy->admin.require_token_for_reads ? ", and so do reads" : "");
  }
  if (!options.ready_file.empty()) {
    if (auto written =
            write_ready_file(options.ready_file, http_port, admin_port, peer_port, policy->listen.unix_socket);
        !written) {
      spdlog::critical("{}", written.error().to_string());
      return 1;
    }
  }
  peer_links->start();  // idles while the policy lists no peers; a reload may add some
  spiller->start();
  state->ready = true;
  upstream_prober->start();

  // SIGHUP reloads the policy file; a rejected policy leaves the current one serving.
  std::function<void()> wait_for_reload = [&] {
    reload_signal.async_wait([&](boost::system::error_code ec, int) {
      if (ec) return;
      spdlog::info("SIGHUP: reloading policy {}", runtime_policy->path());
      (void)runtime_policy->reload();  // outcome is logged and counted by reload() itself
      if (peer_tls) {
        if (auto reloaded = peer_tls->reload(); !reloaded) {
          spdlog::error("SIGHUP: peer TLS files not reloaded, the old certificate stays: {}",
                        reloaded.error().to_string());
        } else {
          spdlog::info("SIGHUP: peer TLS certificate, key and CA bundle reloaded");
        }
      }
      wait_for_reload();
    });
  };
  wait_for_reload();

  // Peer TLS files are watched too (Kubernetes updates a Secret by swapping a symlink): a change
  // rebuilds the context for new connections; a bad file keeps the old one.
  asio::steady_timer tls_watch(io);
  std::function<void()> watch_tls = [&] {
    tls_watch.expires_after(kTlsWatchInterval);
    tls_watch.async_wait([&](boost::system::error_code ec) {
      if (ec || state->draining) return;
      auto changed = peer_tls->reload_if_changed();
      if (!changed) {
        spdlog::error("peer TLS files changed but were not loaded, the old certificate stays: {}",
                      changed.error().to_string());
      } else if (changed.value()) {
        spdlog::info("peer TLS files changed: certificate, key and CA bundle reloaded");
      }
      watch_tls();
    });
  };
  if (peer_tls) watch_tls();

  asio::steady_timer drain_timer(io);
  const auto drain_started = std::make_shared<std::chrono::steady_clock::time_point>();
  std::function<void()> poll_drain = [&] {
    const bool idle =
        main_server.active_connections() == 0 && (!admin_server || admin_server->active_connections() == 0);
    if (idle || std::chrono::steady_clock::now() - *drain_started > kDrainDeadline) {
      if (!idle) spdlog::warn("drain deadline passed with connections still open; exiting");
      io.stop();
      return;
    }
    drain_timer.expires_after(std::chrono::milliseconds(20));
    drain_timer.async_wait([&](boost::system::error_code) { poll_drain(); });
  };
  signals.async_wait([&](boost::system::error_code ec, int signal_number) {
    if (ec) return;
    spdlog::info("signal {}: draining (stop accepting, finish in-flight requests)", signal_number);
    state->draining = true;
    *drain_started = std::chrono::steady_clock::now();
    reload_signal.cancel();
    tls_watch.cancel();
    upstream_prober->stop();
    main_server.drain();
    if (admin_server) admin_server->drain();
    // In-flight peer transfers fail (the sender retries elsewhere); nothing partial is kept.
    if (peer_server) peer_server->stop();
    poll_drain();
  });

  std::vector<std::thread> workers;
  for (unsigned index = 1; index < std::max(1U, options.io_threads); ++index) {
    workers.emplace_back([&io] { io.run(); });
  }
  io.run();
  for (auto& worker : workers)
    worker.join();
  shm_metrics->attach(nullptr);
  if (shm_server) shm_server->stop();
  spiller->stop();  // before the links its pushes use
  peer_links->stop();
  spdlog::info("kvrelay stopped");
  return 0;
}

}  // namespace kvrelay::proxy
