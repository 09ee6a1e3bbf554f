#include "kvrelay/broker/peer_links.h"

#include <fmt/format.h>
#include <spdlog/spdlog.h>

#include <algorithm>

#include "shm_fetch.h"

namespace kvrelay::broker {

namespace {

constexpr std::chrono::milliseconds kProbeTimeout{1'000};

}  // namespace

PeerLinks::PeerLinks(std::shared_ptr<PolicySource> policy, metrics::Registry& registry)
    : policy_(std::move(policy)),
      buffers_(std::make_shared<WarmBufferPool>(kWarmBuffers, policy_->current()->limits.peer_buffer_bytes)),
      up_(registry.gauge("kvrelay_peer_up", "1 if the last call to the peer succeeded, else 0", {"peer"})),
      rtt_(registry.gauge("kvrelay_peer_link_rtt_seconds", "Windowed median RTT of the link to a peer", {"peer"})),
      throughput_(registry.gauge("kvrelay_peer_link_throughput_bytes_per_second",
                                 "Windowed throughput of KV transfers on the link to a peer", {"peer"})),
      certificate_expiry_(registry.gauge("kvrelay_peer_tls_certificate_expiry_seconds",
                                         "Seconds until a peer-plane TLS certificate expires: this node's "
                                         "(certificate=\"self\") and each connected peer's (its id)",
                                         {"certificate"})),
      refused_(registry.counter("kvrelay_peer_refused_total",
                                "Peer connections and requests this node's peer server refused (issue #25): "
                                "handshake, identity, push, fetch",
                                {"reason"})),
      probes_(registry.counter("kvrelay_peer_bandwidth_probes_total",
                               "Bandwidth probes of idle links (limits.peer_bandwidth_probe_interval_ms), by peer and "
                               "result (ok, failed)",
                               {"peer", "result"})) {}

PeerLinks::~PeerLinks() {
  stop();
}

void PeerLinks::start() {
  prober_ = std::thread([this] { run_prober(); });
}

void PeerLinks::stop() {
  {
    std::lock_guard lock(stop_mutex_);
    stopping_ = true;
  }
  stop_wake_.notify_all();
  if (prober_.joinable()) prober_.join();
}

PeerLinks::PeerState& PeerLinks::state_of(const std::string& peer_id) {
  std::lock_guard lock(mutex_);
  auto& state = peers_[peer_id];
  if (!state) state = std::make_unique<PeerState>();
  return *state;
}

void PeerLinks::note_result(const std::string& peer_id, const Error* error) {
  std::lock_guard lock(mutex_);
  auto& state = *peers_[peer_id];
  state.reachable = error == nullptr;
  if (error != nullptr) {
    state.last_error = error->to_string();
    ++state.failures;
  }
  up_.with({peer_id}).set(error == nullptr ? 1.0 : 0.0);
}

PeerLinks::Slot& PeerLinks::acquire_slot(PeerState& state, Purpose purpose, bool any_fetch_lane,
                                         std::unique_lock<std::mutex>& lock) {
  const auto lane = [&](std::size_t index) -> Slot& {
    return index == 0 ? state.slots[kFetch] : state.fetch_lanes[index - 1];
  };
  if (purpose != kFetch || !any_fetch_lane) {
    lock = std::unique_lock(state.slots[purpose].mutex);
    return state.slots[purpose];
  }
  for (std::size_t index = 0; index < kFetchLanes; ++index) {
    std::unique_lock<std::mutex> attempt(lane(index).mutex, std::try_to_lock);
    if (attempt.owns_lock()) {
      lock = std::move(attempt);
      return lane(index);
    }
  }
  Slot& slot = lane(state.next_lane.fetch_add(1) % kFetchLanes);  // every lane busy: queue on one in turn
  lock = std::unique_lock(slot.mutex);
  return slot;
}

template <class Call>
auto PeerLinks::with_client(const std::string& peer_id, Purpose purpose, std::chrono::milliseconds timeout,
                            peer::Deadline deadline, Call call) -> decltype(call(std::declval<peer::PeerClient&>())) {
  const auto policy = policy_->current();
  const PeerPolicy* peer_policy = policy->find_peer(peer_id);
  if (peer_policy == nullptr) return fail(ErrorCode::kNotFound, fmt::format("no peer '{}' in the policy", peer_id));
  PeerState& state = state_of(peer_id);
  std::unique_lock<std::mutex> lock;
  Slot& slot = acquire_slot(state, purpose, !peer_policy->same_host, lock);
  const bool over_ucx = peer_policy->transport == PeerTransport::kUcx;
  const std::string address =
      fmt::format("{} {}", peer_policy->address.to_string(), peer_transport_name(peer_policy->transport));
  if (slot.client && slot.address != address) slot.client.reset();  // a reload moved the peer
  if (!slot.client) {
    auto options = peer::peer_client_options(*policy);  // node id and chunk staging
    options.connect_timeout = timeout;
    options.read_timeout = timeout;
    options.link_estimator = estimator_;
    options.frame_buffers = buffers_;
    options.tls = tls_;
    options.identity = peer_identity(*peer_policy);
    options.codec_factor = codec_factor_;
    options.gate = gate_;
    if (over_ucx && !ucx_) {
      Error error{ErrorCode::kUnsupported,
                  fmt::format("peer '{}' has transport \"ucx\" but this node has no UCX context", peer_id)};
      note_result(peer_id, &error);
      return error;
    }
    if (over_ucx) options.ucx = ucx_;
    auto connected = peer::PeerClient::connect(peer_policy->address, std::move(options), deadline);
    if (!connected) {
      note_result(peer_id, &connected.error());
      return connected.error();
    }
    slot.client.emplace(std::move(connected).value());
    slot.address = address;
    std::lock_guard state_lock(mutex_);
    state.remote_node = slot.client->remote().node_id;
    state.ucx_lanes = slot.client->transport_lanes();
    if (tls_) state.certificate_not_after = slot.client->remote_certificate().not_after;
  }
  auto result = call(*slot.client);
  if (!result) {
    slot.client.reset();
    note_result(peer_id, &result.error());
  } else {
    note_result(peer_id, nullptr);
  }
  if (const auto estimate = estimator_->estimate(slot.client ? slot.client->remote().node_id : peer_id)) {
    if (estimate->transfer_samples > 0) throughput_.with({peer_id}).set(estimate->throughput_bytes_per_s);
  }
  return result;
}

std::vector<std::string> PeerLinks::candidates(std::uint64_t model_id, std::span<const std::uint64_t> hashes) {
  const auto policy = policy_->current();
  std::vector<std::pair<std::size_t, std::string>> ranked;  // (rank, peer): smaller rank first
  std::lock_guard lock(mutex_);
  for (const auto& peer_policy : policy->peers) {
    const auto& peer = peer_policy;
    std::size_t rank = hashes.size() + 1;  // not in any summary: asked last, in policy order
    if (const auto found = peers_.find(peer.id); found != peers_.end()) {
      for (std::size_t index = 0; index < hashes.size(); ++index) {
        if (found->second->held.contains(kv_store::EntryKey{model_id, hashes[index]})) {
          rank = index;
          break;
        }
      }
    }
    ranked.emplace_back(rank, peer.id);
  }
  std::stable_sort(ranked.begin(), ranked.end(), [](const auto& a, const auto& b) { return a.first < b.first; });
  std::vector<std::string> ids;
  for (auto& [rank, id] : ranked)
    ids.push_back(std::move(id));
  return ids;
}

Result<std::optional<peer::PeerClient::FetchedFrame>> PeerLinks::fetch(const std::string& peer_id,
                                                                       const peer::FetchRequest& request,
                                                                       peer::Deadline deadline,
                                                                       std::uint64_t max_frame_bytes,
                                                                       const codec::CodecRegistry& codecs) {
  const auto policy = policy_->current();
  const PeerPolicy* peer_policy = policy->find_peer(peer_id);
  const bool same_host = peer_policy != nullptr && peer_policy->same_host;
  const auto timeout = policy->limits.read_timeout;
  PeerState& state = state_of(peer_id);
  auto fetched = with_client(peer_id, kFetch, timeout, deadline,
                             [&](peer::PeerClient& client) -> Result<std::optional<peer::PeerClient::FetchedFrame>> {
                               // An older peer may hold KV computed over a lossy import filed as exact: it answers no
                               // lossless fetch (a miss here, not a failure of the link).
                               if ((client.remote().capabilities & peer::kCapFidelity) == 0 &&
                                   codec::fidelity_of(codecs, request.codec).is_exact()) {
                                 spdlog::debug("peer {} does not record fidelity: not asked for exact KV", peer_id);
                                 return std::optional<peer::PeerClient::FetchedFrame>{};
                               }
                               return same_host ? fetch_same_host(state, client, request, deadline, max_frame_bytes,
                                                                  codecs, timeout)
                                                : client.fetch(request, max_frame_bytes, deadline);
                             });
  if (fetched) {
    std::lock_guard lock(mutex_);
    ++peers_[peer_id]->fetches;
  }
  return fetched;
}

Result<std::optional<peer::PeerClient::FetchedFrame>> PeerLinks::fetch_same_host(
    PeerState& state, peer::PeerClient& client, const peer::FetchRequest& request, peer::Deadline deadline,
    std::uint64_t max_frame_bytes, const codec::CodecRegistry& codecs, std::chrono::milliseconds timeout) {
  const auto& remote = client.remote();
  std::string note = "peer offers no shared-memory socket: fetched over TCP";
  if ((remote.capabilities & peer::kCapSharedMemory) != 0 && !remote.shm_socket.empty()) {
    if (state.data_plane_socket != remote.shm_socket) state.data_plane.reset();
    state.data_plane_socket = remote.shm_socket;
    auto via_shm = fetch_over_shm({state.data_plane, remote.shm_socket, codecs, *buffers_, timeout}, request, deadline,
                                  max_frame_bytes);
    if (via_shm) return via_shm;
    state.data_plane.reset();  // its position in the exchange is unknown
    if (std::chrono::steady_clock::now() >= deadline) return via_shm;
    note = fmt::format("shared memory failed ({}): fetched over TCP", via_shm.error().to_string());
  }
  auto over_tcp = client.fetch(request, max_frame_bytes, deadline);
  if (over_tcp && over_tcp.value()) over_tcp.value()->transport_note = std::move(note);
  return over_tcp;
}

Status PeerLinks::push(const std::string& peer_id, std::string_view route, std::uint64_t transfer_id,
                       const kv_store::EntryKey& key, const kv_store::EntryChain& chain,
                       std::span<const std::uint8_t> frame, std::chrono::milliseconds timeout) {
  peer::PushOptions options;
  options.route = std::string(route);
  return push(peer_id, options, transfer_id, key, chain, frame, timeout);
}

Status PeerLinks::push(const std::string& peer_id, const peer::PushOptions& options, std::uint64_t transfer_id,
                       const kv_store::EntryKey& key, const kv_store::EntryChain& chain,
                       std::span<const std::uint8_t> frame, std::chrono::milliseconds timeout) {
  auto pushed =
      with_client(peer_id, kPush, timeout, peer::Deadline::max(), [&](peer::PeerClient& client) -> Result<bool> {
        KVRELAY_TRY(client.push_encoded(transfer_id, key, chain, frame, options));
        return true;
      });
  if (!pushed) return pushed.error();
  std::lock_guard lock(mutex_);
  ++peers_[peer_id]->pushes;
  return ok();
}

void PeerLinks::probe_all() {
  const auto policy = policy_->current();
  for (const auto& peer_policy : policy->peers) {
    const std::string& id = peer_policy.id;
    auto rtt = with_client(id, kProbe, kProbeTimeout, peer::Deadline::max(),
                           [](peer::PeerClient& client) { return client.ping(); });
    if (!rtt) continue;
    const double seconds = std::chrono::duration<double>(rtt.value()).count();
    if (on_rtt_) on_rtt_(id, seconds);
    if (const auto link = estimate(id)) rtt_.with({id}).set(std::chrono::duration<double>(link->rtt).count());
    auto summary = with_client(id, kProbe, kProbeTimeout, peer::Deadline::max(),
                               [](peer::PeerClient& client) { return client.summary_reply(); });
    if (!summary) continue;
    const auto& keys = summary.value().keys;
    std::lock_guard lock(mutex_);
    auto& state = *peers_[id];
    const auto& products = summary.value().products;
    state.held.clear();
    for (std::size_t index = 0; index < keys.size(); ++index)
      state.held.emplace(keys[index], index < products.size() ? products[index] : 1.0);
    state.node_state = summary.value().node;
    state.summary_time = std::chrono::steady_clock::now();
  }
  const auto probe_interval = policy->limits.peer_bandwidth_probe_interval;
  if (probe_interval.count() > 0) {
    for (const auto& peer_policy : policy->peers)
      maybe_probe_bandwidth(peer_policy.id, probe_interval);
  }
}

void PeerLinks::maybe_probe_bandwidth(const std::string& peer_id, std::chrono::milliseconds interval) {
  const auto now = std::chrono::steady_clock::now();
  {
    std::lock_guard lock(mutex_);
    const auto found = peers_.find(peer_id);
    if (found == peers_.end() || !found->second->reachable) return;
    PeerState& state = *found->second;
    const std::uint64_t transfers = state.fetches + state.pushes;
    if (transfers != state.transfers_at_measure) {  // real traffic measured the link meanwhile
      state.transfers_at_measure = transfers;
      state.measured_at = now;
      return;
    }
    if (now - state.measured_at < interval) return;
    state.measured_at = now;
  }
  auto elapsed = with_client(peer_id, kProbe, kProbeTimeout, peer::Deadline::max(),
                             [](peer::PeerClient& client) { return client.probe_bandwidth(peer::kMaxProbeBytes); });
  probes_.with({peer_id, elapsed ? "ok" : "failed"}).inc();
  if (!elapsed) {
    spdlog::debug("bandwidth probe of peer {}: {}", peer_id, elapsed.error().to_string());
    return;
  }
  const double seconds = std::chrono::duration<double>(elapsed.value()).count();
  if (on_probe_) on_probe_(peer_id, peer::kMaxProbeBytes, seconds);
}

void PeerLinks::refresh_certificate_expiry() {
  if (!tls_) return;
  certificate_expiry_.with({"self"}).set(peer::seconds_until(tls_->not_after()));
  std::lock_guard lock(mutex_);
  for (const auto& [id, state] : peers_) {
    if (state->certificate_not_after != std::chrono::system_clock::time_point{}) {
      certificate_expiry_.with({id}).set(peer::seconds_until(state->certificate_not_after));
    }
  }
}

void PeerLinks::run_prober() {
  while (true) {
    refresh_certificate_expiry();
    const auto interval = policy_->current()->limits.peer_summary_interval;
    if (interval.count() > 0) probe_all();
    std::unique_lock lock(stop_mutex_);
    const auto wait = interval.count() > 0 ? interval : std::chrono::milliseconds(1'000);
    if (stop_wake_.wait_for(lock, wait, [this] { return stopping_; })) return;
  }
}

std::optional<peer::LinkEstimate> PeerLinks::estimate(const std::string& peer_id) const {
  std::string node;
  {
    std::lock_guard lock(mutex_);
    const auto found = peers_.find(peer_id);
    node = found != peers_.end() && !found->second->remote_node.empty() ? found->second->remote_node : peer_id;
  }
  return estimator_->estimate(node);
}

std::optional<std::pair<std::size_t, double>> PeerLinks::listed_prefix(const PeerState& state, std::uint64_t model_id,
                                                                       std::span<const std::uint64_t> keys) {
  for (std::size_t blocks = keys.size(); blocks > 0; --blocks) {
    if (const auto found = state.held.find(kv_store::EntryKey{model_id, keys[blocks - 1]}); found != state.held.end())
      return std::pair{blocks, found->second};
  }
  return std::nullopt;
}

std::size_t PeerLinks::held_prefix_blocks(const std::string& peer_id, std::uint64_t model_id,
                                          std::span<const std::uint64_t> keys) const {
  std::lock_guard lock(mutex_);
  const auto found = peers_.find(peer_id);
  if (found == peers_.end()) return 0;
  const auto listed = listed_prefix(*found->second, model_id, keys);
  return listed ? listed->first : 0;
}

std::optional<PeerLinks::HeldElsewhere> PeerLinks::longest_held(std::uint64_t model_id,
                                                                std::span<const std::uint64_t> hashes) const {
  std::optional<HeldElsewhere> best;
  std::lock_guard lock(mutex_);
  for (const auto& [id, state] : peers_) {
    const auto listed = listed_prefix(*state, model_id, hashes);
    if (!listed) continue;
    const auto [blocks, product] = *listed;
    if (!best || blocks > best->blocks || (blocks == best->blocks && product > best->product))
      best = HeldElsewhere{blocks, product, id};
  }
  return best;
}

std::optional<peer::NodeState> PeerLinks::node_state(const std::string& peer_id) const {
  std::lock_guard lock(mutex_);
  const auto found = peers_.find(peer_id);
  return found != peers_.end() ? found->second->node_state : std::nullopt;
}

nlohmann::json PeerLinks::describe() const {
  const auto policy = policy_->current();
  nlohmann::json peers = nlohmann::json::array();
  const auto now = std::chrono::steady_clock::now();
  for (const auto& peer_policy : policy->peers) {
    const auto& peer = peer_policy;
    nlohmann::json view{{"id", peer.id},
                        {"address", peer.address.to_string()},
                        {"same_host", peer.same_host},
                        {"transport", peer_transport_name(peer.transport)}};
    std::string node = peer.id;
    {
      std::lock_guard lock(mutex_);
      const auto found = peers_.find(peer.id);
      if (found == peers_.end()) {
        view["state"] = "not_contacted";
      } else {
        const PeerState& state = *found->second;
        view["state"] = state.reachable ? "connected" : "unreachable";
        if (!state.last_error.empty()) view["last_error"] = state.last_error;
        if (!state.remote_node.empty()) node = state.remote_node;
        if (!state.ucx_lanes.empty()) view["ucx_lanes"] = state.ucx_lanes;
        view["summary_keys"] = state.held.size();
        if (const auto& reported = state.node_state) {
          view["node_state"] = {
              {"store_budget", reported->store_budget},         {"store_used", reported->store_used},
              {"arena_capacity", reported->arena_capacity},     {"arena_in_use", reported->arena_in_use},
              {"queued_transfers", reported->queued_transfers}, {"spill_accept_left", reported->spill_accept_left},
              {"link_bytes_per_s", reported->link_bytes_per_s}, {"sent_bytes_per_s", reported->sent_bytes_per_s}};
        }
        if (state.summary_time != std::chrono::steady_clock::time_point{}) {
          view["summary_age_s"] = std::chrono::duration<double>(now - state.summary_time).count();
        }
        if (state.certificate_not_after != std::chrono::system_clock::time_point{}) {
          view["certificate_expires_in_s"] = peer::seconds_until(state.certificate_not_after);
        }
        view["fetches"] = state.fetches;
        view["pushes"] = state.pushes;
        view["failures"] = state.failures;
      }
    }
    if (const auto estimate = estimator_->estimate(node)) {
      view["link"] = {{"rtt_us", estimate->rtt.count()},
                      {"rtt_samples", estimate->rtt_samples},
                      {"throughput_bytes_per_s", estimate->throughput_bytes_per_s},
                      {"transfer_samples", estimate->transfer_samples}};
    }
    peers.push_back(std::move(view));
  }
  nlohmann::json view{{"node", policy->node_id}, {"peers", std::move(peers)}};
  // Issue #25: whether the peer plane is TLS, and when this node's certificate expires.
  view["tls"] = tls_ != nullptr;
  if (tls_) view["certificate_expires_in_s"] = peer::seconds_until(tls_->not_after());
  return view;
}

}  // namespace kvrelay::broker
