#include "kvrelay/shm_transport/server.h"

#include <fcntl.h>
#include <grp.h>
#include <poll.h>
#include <sys/eventfd.h>
#include <sys/random.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/un.h>
#include <unistd.h>

#include <boost/asio/post.hpp>
#include <boost/asio/thread_pool.hpp>
#include <fmt/format.h>
#include <spdlog/spdlog.h>

#include <algorithm>
#include <cerrno>
#include <condition_variable>
#include <cstring>
#include <deque>
#include <map>
#include <optional>
#include <unordered_map>

#include "kvrelay/core/bulk_hash.h"
#include "kvrelay/core/byte_io.h"
#include "kvrelay/kv_store/entry_slice.h"
#include "kvrelay/kv_store/memfd.h"
#include "kvrelay/kv_store/prefix_scan.h"
#include "kvrelay/shm_transport/fd_passing.h"

namespace kvrelay::shm {

namespace {

constexpr std::uint32_t kServerProtocolVersion = kDataPlaneVersion;

}  // namespace

// Named rather than anonymous: ShmServer::Connection holds these, and GCC warns
// (-Wsubobject-linkage) when a unity build includes this file into another.
namespace server_detail {

// The running check of an arena region the client reports progress on: the verifier thread
// hashes what has been written while the client writes the rest, so a commit only hashes the tail.
struct ArenaVerification {
  std::mutex mutex;
  std::condition_variable idle;
  BulkHashStream hash;
  std::uint64_t hashed = 0;
  std::uint64_t target = 0;
  bool running = false;
};

struct ServedRegion {
  UniqueFd fd;                                  // a memfd region, or
  std::shared_ptr<kv_store::ArenaBlock> block;  // an arena region
  std::uint64_t size = 0;
  std::shared_ptr<ArenaVerification> verification;  // once the client reported progress
};

}  // namespace server_detail

using server_detail::ArenaVerification;
using server_detail::ServedRegion;

namespace {

Result<sockaddr_un> socket_address(const std::string& path) {
  sockaddr_un address{};
  address.sun_family = AF_UNIX;
  if (path.empty() || path.size() >= sizeof(address.sun_path)) {
    return fail(ErrorCode::kInvalidArgument, fmt::format("unix socket path '{}' is empty or too long", path));
  }
  std::memcpy(address.sun_path, path.c_str(), path.size() + 1);
  return address;
}

// What a same-host peer sidecar's connection may send: what fetch_over_shm (broker) uses to
// read an entry by key, and the harmless probes.
bool peer_may_send(MessageType type) {
  switch (type) {
    case MessageType::kHello:
    case MessageType::kLookup:
    case MessageType::kReleaseLeases:
    case MessageType::kPing:
    case MessageType::kStats:
      return true;
    default:
      return false;
  }
}

// Tells a refused client why, then hangs up without leaving its requests unread: closing a
// Unix socket with unread data makes the peer's recv fail with ECONNRESET before it can read
// our explanation. Shutting down first makes later client sends fail with EPIPE instead.
void refuse_connection(UniqueFd& client, const Error& error) {
  (void)send_message(client.get(), encode_error(0, error));
  ::shutdown(client.get(), SHUT_RDWR);
  while (true) {
    auto drained = receive_message(client.get());  // non-blocking socket; closes any fds
    if (!drained || drained.value().closed) break;
  }
}

// The chain a commit carries, its ids read from its one fd and checked against its key and
// layout (null: a commit without one, which attaches no fd).
Result<std::shared_ptr<const kv_store::EntryChain>> commit_chain(const CommitRequest& commit,
                                                                 std::span<const UniqueFd> fds) {
  if (!commit.chain) {
    if (!fds.empty()) {
      return fail(ErrorCode::kProtocol, fmt::format("commit without a chain with {} fds attached", fds.size()));
    }
    return std::shared_ptr<const kv_store::EntryChain>();
  }
  if (fds.size() != 1) {
    return fail(ErrorCode::kProtocol, fmt::format("commit with a chain of {} token ids takes 1 fd (the ids), got {}",
                                                  commit.chain->count, fds.size()));
  }
  if (commit.chain->count != commit.layout.tokens) {
    return fail(ErrorCode::kChainMismatch, fmt::format("commit of {} tokens carries a chain of {} token ids",
                                                       commit.layout.tokens, commit.chain->count));
  }
  KVRELAY_TRY(auto chain, read_chain(*commit.chain, fds[0].get()));
  // A worker's chain is unscoped: the KV path files the entry in its tenant's scope later.
  KVRELAY_TRY(kv_store::verify_chain(commit.key, commit.layout.tokens, chain, kv_store::ChainScope::kUnscoped));
  return std::make_shared<const kv_store::EntryChain>(std::move(chain));
}

}  // namespace

Result<ResolvedEntry> resolve_from_store(kv_store::EntryStore& store, const ResolveRequest& request) {
  // Served as kv_raw: only exact KV answers, and never the whole prompt (its last token is
  // prefilled for the logits). A longer entry that holds the prompt's first blocks answers too.
  const std::size_t max_blocks =
      request.prompt_tokens == 0 ? 0 : static_cast<std::size_t>((request.prompt_tokens - 1) / request.block_tokens);
  auto held = kv_store::longest_held_prefix(store, {request.model_id, request.block_hashes, max_blocks,
                                                    request.block_tokens, kv_store::FidelityRule::exact_only(), true});
  if (!held) return fail(ErrorCode::kNotFound, "no stored prefix of this prompt");
  std::shared_ptr<const kv_store::StoredEntry> entry = std::move(held.entry);
  const std::uint64_t tokens = held.blocks * std::uint64_t{request.block_tokens};
  // The reply's entry is exactly the blocks it names (kvrelay_claim derives the block size from it).
  if (entry->info.layout.tokens > tokens) {
    KVRELAY_TRY(entry, kv_store::slice_entry(*entry, tokens));
  }
  return ResolvedEntry{std::move(entry), ResolvedMeta{static_cast<std::uint32_t>(held.blocks), "kv_raw", {}, 0, {}}};
}

struct ShmServer::Connection {
  UniqueFd socket;
  std::uint32_t uid = 0;
  std::int32_t pid = 0;
  ConnectionIdentity identity;
  std::map<std::uint64_t, ServedRegion> regions;
  std::uint32_t client_version = 1;
  // Arena entries handed to this client: their blocks stay allocated until it gives them back
  // (ReleaseLeases) or hangs up.
  std::unordered_map<std::uint64_t, std::shared_ptr<const kv_store::StoredEntry>> leases;
  std::uint64_t next_lease = 1;
  std::uint64_t pending_bytes = 0;
  // Small-message ring pair, once opened: requests flow client -> server in `requests`.
  kv_store::Mapping ring_memory;
  std::optional<SpscRing> requests;
  std::optional<SpscRing> responses;
  UniqueFd wake_server;    // client writes after pushing a request
  UniqueFd wake_client;    // we write after pushing a response
  bool resolving = false;  // a pooled resolve owns the socket until it has replied
};

// Answers of reserving Resolves waiting for their Claim: bounded, oldest dropped first, expired
// ones dropped as they are met.
struct ShmServer::Reservations {
  struct Held {
    ResolvedEntry resolved;
    std::chrono::steady_clock::time_point deadline;
  };
  std::mutex mutex;
  std::unordered_map<std::uint64_t, Held> held;
  std::deque<std::uint64_t> order;  // filing order; ids already claimed are skipped

  void drop_front_expired_or_over(std::size_t limit, std::chrono::steady_clock::time_point now) {
    while (!order.empty()) {
      const auto found = held.find(order.front());
      if (found == held.end()) {
        order.pop_front();
      } else if (found->second.deadline <= now || held.size() > limit) {
        held.erase(found);
        order.pop_front();
      } else {
        break;
      }
    }
  }
};

namespace {

// An id nobody can guess (a claim is the KV itself), never 0.
std::uint64_t random_reservation_id() {
  std::uint64_t id = 0;
  while (id == 0) {
    if (::getrandom(&id, sizeof(id), 0) != static_cast<ssize_t>(sizeof(id))) id = 0;
  }
  return id;
}

}  // namespace

struct ShmServer::ResolvePool {
  explicit ResolvePool(std::uint32_t threads) : pool(threads) {}
  boost::asio::thread_pool pool;
};

namespace {

// Queues hashing of the region's bytes up to `target` on `pool`, unless a job is already at it
// (that job picks the new target up before it finishes).
void advance_verification(boost::asio::thread_pool& pool, ServedRegion& region, std::uint64_t target) {
  if (!region.verification) {
    region.verification = std::make_shared<ArenaVerification>();
    if (!region.verification->hash.valid()) {
      region.verification.reset();
      return;
    }
  }
  auto verification = region.verification;
  {
    std::lock_guard lock(verification->mutex);
    if (target <= verification->target) return;
    verification->target = target;
    if (verification->running) return;
    verification->running = true;
  }
  boost::asio::post(pool, [verification, block = region.block] {
    std::unique_lock lock(verification->mutex);
    while (verification->hashed < verification->target) {
      const std::uint64_t from = verification->hashed;
      const std::uint64_t to = verification->target;
      lock.unlock();
      verification->hash.update(block->bytes().data() + from, static_cast<std::size_t>(to - from));
      lock.lock();
      verification->hashed = to;
    }
    verification->running = false;
    verification->idle.notify_all();
  });
}

// The region's xxh3: what the verifier has not hashed yet, hashed here.
std::uint64_t arena_region_checksum(ServedRegion& region) {
  if (!region.verification) return bulk_hash64(region.block->bytes().data(), static_cast<std::size_t>(region.size));
  auto& verification = *region.verification;
  std::unique_lock lock(verification.mutex);
  verification.idle.wait(lock, [&] { return !verification.running; });
  verification.hash.update(region.block->bytes().data() + verification.hashed,
                           static_cast<std::size_t>(region.size - verification.hashed));
  return verification.hash.digest();
}

}  // namespace

ShmServer::ShmServer(ShmServerOptions options, std::shared_ptr<kv_store::EntryStore> store)
    : reservations_(std::make_unique<Reservations>()), options_(std::move(options)), store_(std::move(store)) {
  small_handler_ = [](std::span<const std::byte> message) {
    return std::vector<std::byte>(message.begin(), message.end());
  };
}

ShmServer::~ShmServer() {
  stop();
  if (listen_fd_) ::unlink(options_.socket_path.c_str());
}

Result<std::unique_ptr<ShmServer>> ShmServer::listen(ShmServerOptions options,
                                                     std::shared_ptr<kv_store::EntryStore> store) {
  if (!store) return fail(ErrorCode::kInvalidArgument, "shm server needs an entry store");
  KVRELAY_TRY(options.ring.validate());
  KVRELAY_TRY(const auto address, socket_address(options.socket_path));
  std::unique_ptr<ShmServer> server(new ShmServer(std::move(options), std::move(store)));
  const std::string& path = server->options_.socket_path;

  struct stat existing {};
  if (::lstat(path.c_str(), &existing) == 0) {
    if (!S_ISSOCK(existing.st_mode)) {
      return fail(ErrorCode::kAlreadyExists,
                  fmt::format("{} exists and is not a socket; refusing to replace it", path));
    }
    ::unlink(path.c_str());
  }
  UniqueFd fd(::socket(AF_UNIX, SOCK_SEQPACKET | SOCK_CLOEXEC | SOCK_NONBLOCK, 0));
  if (!fd) return fail(ErrorCode::kIo, fmt::format("socket: {}", std::strerror(errno)));
  // The file must never exist with a wider mode than ours, not even between bind and chmod.
  const mode_t previous_mask = ::umask(0177);
  const int bound = ::bind(fd.get(), reinterpret_cast<const sockaddr*>(&address), sizeof(address));
  const int bind_errno = errno;
  ::umask(previous_mask);
  if (bound != 0) return fail(ErrorCode::kIo, fmt::format("bind {}: {}", path, std::strerror(bind_errno)));
  server->listen_fd_ = std::move(fd);  // from here on the destructor unlinks the path
  if (!server->options_.socket_group.empty()) {
    const group* entry = ::getgrnam(server->options_.socket_group.c_str());
    if (entry == nullptr) {
      return fail(ErrorCode::kInvalidArgument, fmt::format("unknown group '{}'", server->options_.socket_group));
    }
    if (::chown(path.c_str(), static_cast<uid_t>(-1), entry->gr_gid) != 0 || ::chmod(path.c_str(), 0660) != 0) {
      return fail(ErrorCode::kPermissionDenied, fmt::format("cannot give {} to group {}: {}", path,
                                                            server->options_.socket_group, std::strerror(errno)));
    }
  }
  if (::listen(server->listen_fd_.get(), 64) != 0) {
    return fail(ErrorCode::kIo, fmt::format("listen {}: {}", path, std::strerror(errno)));
  }
  server->stop_fd_.reset(::eventfd(0, EFD_CLOEXEC | EFD_NONBLOCK));
  server->resolved_fd_.reset(::eventfd(0, EFD_CLOEXEC | EFD_NONBLOCK));
  if (!server->stop_fd_ || !server->resolved_fd_) return fail(ErrorCode::kIo, "eventfd failed");
  if (server->options_.arena_bytes > 0) {
    auto arena = kv_store::ShmArena::create(server->options_.arena_bytes);
    if (!arena) {
      return fail(arena.error().code, fmt::format("shared-memory arena of {} bytes: {}", server->options_.arena_bytes,
                                                  arena.error().message));
    }
    server->arena_ = std::move(arena).value();
    server->verifier_ = std::make_unique<ResolvePool>(1);
    // A full arena makes room by evicting its least recently used entries from the store, as the
    // store does within its own budget. Weak: the store's entries keep the arena alive.
    server->arena_->set_reclaimer([store = std::weak_ptr<kv_store::EntryStore>(server->store_),
                                   arena = server->arena_.get()](std::uint64_t bytes) {
      const auto alive = store.lock();
      return alive && alive->make_arena_room(*arena, bytes);
    });
    // Kernel mode too: the peer plane receives into arena blocks.
    server->arena_warmer_.start(server->options_.memory_strategy, server->arena_->bytes(),
                                kv_store::PrefaultViews::kUserAndKernel, server->arena_, "shm arena");
  }
  if (server->options_.resolve_threads > 0) {
    server->resolve_pool_ = std::make_unique<ResolvePool>(server->options_.resolve_threads);
  }
  return server;
}

void ShmServer::start() {
  thread_ = std::thread([this] { run(); });
}

void ShmServer::stop() {
  if (stop_fd_) {
    const std::uint64_t one = 1;
    [[maybe_unused]] const auto written = ::write(stop_fd_.get(), &one, sizeof(one));
  }
  arena_warmer_.stop();
  if (thread_.joinable()) thread_.join();
  // Pooled resolves hold connection pointers: they finish before any connection is destroyed.
  if (resolve_pool_) resolve_pool_->pool.join();
  if (verifier_) verifier_->pool.join();
}

std::optional<ConnectionIdentity> identify_connection(std::uint32_t uid, std::uint32_t own_uid,
                                                      std::span<const std::uint32_t> allowed_uids,
                                                      std::span<const SameHostPeerUid> peers) {
  ConnectionIdentity identity;
  identity.worker = uid == own_uid || std::find(allowed_uids.begin(), allowed_uids.end(), uid) != allowed_uids.end();
  const auto peer = std::find_if(peers.begin(), peers.end(), [&](const SameHostPeerUid& p) { return p.uid == uid; });
  if (peer != peers.end()) identity.peer_id = peer->peer_id;
  if (!identity.worker && identity.peer_id.empty()) return std::nullopt;
  return identity;
}

std::optional<ConnectionIdentity> ShmServer::identify(std::uint32_t uid) const {
  const auto peers = options_.same_host_peers ? options_.same_host_peers() : std::vector<SameHostPeerUid>{};
  return identify_connection(uid, static_cast<std::uint32_t>(::geteuid()), options_.allowed_uids, peers);
}

ServerStats ShmServer::stats() const {
  ServerStats stats;
  stats.connections = connections_count_.load();
  stats.pending_regions = pending_regions_.load();
  stats.pending_bytes = pending_bytes_.load();
  const auto store_stats = store_->stats();
  stats.entries = store_stats.entries;
  stats.entry_bytes = store_stats.bytes;
  stats.commits = commits_.load();
  stats.rejected_messages = rejected_.load();
  stats.refused_connections = refused_.load();
  stats.open_rings = open_rings_.load();
  if (arena_) {
    const auto arena_stats = arena_->stats();
    stats.arena_bytes = arena_stats.capacity;
    stats.arena_bytes_in_use = arena_stats.in_use;
  }
  stats.leases = leases_.load();
  return stats;
}

void ShmServer::run() {
  std::vector<pollfd> polled;
  // Which connection each pollfd after the first two belongs to, and whether it is the ring wake fd.
  std::vector<std::pair<Connection*, bool>> owners;
  while (true) {
    polled.clear();
    owners.clear();
    polled.push_back({stop_fd_.get(), POLLIN, 0});
    polled.push_back({listen_fd_.get(), POLLIN, 0});
    polled.push_back({resolved_fd_.get(), POLLIN, 0});
    for (auto& connection : connections_) {
      if (connection->resolving) continue;
      polled.push_back({connection->socket.get(), POLLIN, 0});
      owners.emplace_back(connection.get(), false);
      if (connection->wake_server) {
        polled.push_back({connection->wake_server.get(), POLLIN, 0});
        owners.emplace_back(connection.get(), true);
      }
    }
    const int ready = ::poll(polled.data(), polled.size(), -1);
    if (ready < 0) {
      if (errno == EINTR) continue;
      spdlog::error("shm server poll: {}", std::strerror(errno));
      return;
    }
    if ((polled[0].revents & POLLIN) != 0) return;
    if ((polled[1].revents & POLLIN) != 0) accept_connections();
    std::vector<Connection*> dropped;
    if ((polled[2].revents & POLLIN) != 0) collect_resolved(dropped);
    constexpr std::size_t kFixedFds = 3;
    for (std::size_t index = kFixedFds; index < polled.size(); ++index) {
      if (polled[index].revents == 0) continue;
      auto [connection, is_ring] = owners[index - kFixedFds];
      if (std::find(dropped.begin(), dropped.end(), connection) != dropped.end()) continue;
      const bool keep = is_ring ? serve_ring(*connection) : serve_connection(*connection);
      if (!keep) dropped.push_back(connection);
    }
    for (Connection* connection : dropped) {
      const auto found = std::find_if(connections_.begin(), connections_.end(),
                                      [&](const auto& candidate) { return candidate.get() == connection; });
      close_connection(static_cast<std::size_t>(found - connections_.begin()));
    }
  }
}

void ShmServer::accept_connections() {
  while (true) {
    UniqueFd client(::accept4(listen_fd_.get(), nullptr, nullptr, SOCK_CLOEXEC | SOCK_NONBLOCK));
    if (!client) return;
    ucred credentials{};
    socklen_t length = sizeof(credentials);
    const auto identity = ::getsockopt(client.get(), SOL_SOCKET, SO_PEERCRED, &credentials, &length) == 0
                              ? identify(credentials.uid)
                              : std::nullopt;
    if (!identity) {
      ++refused_;
      spdlog::warn(
          "shm: refused connection from uid {} pid {}: neither a worker's uid (listen.allowed_uids) nor a "
          "same-host peer's (peers[].uid)",
          credentials.uid, credentials.pid);
      refuse_connection(client, Error{ErrorCode::kPermissionDenied,
                                      "uid not allowed by listen.allowed_uids or a same-host peer's peers[].uid"});
      continue;
    }
    if (connections_.size() >= options_.max_connections) {
      ++refused_;
      refuse_connection(client, Error{ErrorCode::kResourceExhausted, "too many connections"});
      continue;
    }
    auto connection = std::make_unique<Connection>();
    connection->socket = std::move(client);
    connection->uid = credentials.uid;
    connection->pid = credentials.pid;
    connection->identity = *identity;
    connections_.push_back(std::move(connection));
    ++connections_count_;
  }
}

void ShmServer::close_connection(std::size_t index) {
  Connection& connection = *connections_[index];
  // Uncommitted regions die with their connection: this is what reclaims a crashed writer's memory.
  pending_regions_ -= connection.regions.size();
  pending_bytes_ -= connection.pending_bytes;
  if (connection.wake_server) --open_rings_;
  leases_ -= connection.leases.size();
  connections_.erase(connections_.begin() + static_cast<std::ptrdiff_t>(index));
  --connections_count_;
}

void ShmServer::resolve_reply(Connection& connection, std::uint32_t id, Result<ResolvedEntry> resolved, bool reserve,
                              std::vector<std::byte>& reply, std::vector<int>& reply_fds,
                              std::vector<UniqueFd>& reply_owned) {
  if (!resolved) {
    // A miss is an answer, not a rejected message.
    if (resolved.error().code != ErrorCode::kNotFound) ++rejected_;
    reply = encode_error(id, resolved.error());
    return;
  }
  if (resolved.value().meta.kept.size() > kMaxKeptRuns) {
    ++rejected_;
    reply = encode_error(id, Error{ErrorCode::kInternal, fmt::format("sparse KV of {} runs (a reply names at most {}); "
                                                                     "not served",
                                                                     resolved.value().meta.kept.size(), kMaxKeptRuns)});
    return;
  }
  if (connection.client_version < kSpanDataPlaneVersion && !resolved.value().meta.is_prefix()) {
    // Only a client that asked for spans or sparse KV (version 7 flags) is answered with them.
    ++rejected_;
    reply = encode_error(id, Error{ErrorCode::kInternal,
                                   "span or sparse KV resolved for a client older than "
                                   "data-plane version 7; not served"});
    return;
  }
  if (connection.client_version < kFidelityDataPlaneVersion && !resolved.value().meta.fidelity.is_exact()) {
    // It would republish what it computed over this KV as exact.
    reply = encode_error(id, Error{ErrorCode::kNotFound,
                                   fmt::format("lossy KV ({}) is served to data-plane version {} clients only; this "
                                               "one speaks {}",
                                               resolved.value().meta.fidelity.lossy_codec, kFidelityDataPlaneVersion,
                                               connection.client_version)});
    return;
  }
  if (reserve) {
    // The worker claims it later, from its own connection: nothing is mapped or leased now.
    const std::uint64_t reservation = random_reservation_id();
    ByteWriter out;
    out.put(reservation).put(resolved.value().meta.blocks);
    out.put_string(resolved.value().meta.medium);
    encode_fidelity(out, resolved.value().meta.fidelity);
    if (connection.client_version >= kSpanDataPlaneVersion) encode_resolved_span(out, resolved.value().meta);
    const auto now = std::chrono::steady_clock::now();
    {
      std::lock_guard lock(reservations_->mutex);
      reservations_->held[reservation] =
          Reservations::Held{std::move(resolved).value(), now + options_.reservation_ttl};
      reservations_->order.push_back(reservation);
      reservations_->drop_front_expired_or_over(options_.max_reservations, now);
    }
    reply = encode_frame(MessageType::kReserved, id, out.bytes());
    return;
  }
  ByteWriter out;
  auto type = entry_reply(connection, resolved.value().entry, true, out, reply_fds, reply_owned);
  if (!type) {
    ++rejected_;
    reply = encode_error(id, type.error());
    return;
  }
  out.put(resolved.value().meta.blocks);
  out.put_string(resolved.value().meta.medium);
  if (connection.client_version >= kFidelityDataPlaneVersion) encode_fidelity(out, resolved.value().meta.fidelity);
  if (connection.client_version >= kSpanDataPlaneVersion) encode_resolved_span(out, resolved.value().meta);
  reply = encode_frame(type.value(), id, out.bytes());
}

Result<MessageType> ShmServer::entry_reply(Connection& connection,
                                           const std::shared_ptr<const kv_store::StoredEntry>& shared, bool resolved,
                                           ByteWriter& out, std::vector<int>& reply_fds,
                                           std::vector<UniqueFd>& reply_owned) {
  const kv_store::StoredEntry& stored = *shared;
  const kv_store::StoredEntry* entry = &stored;
  std::shared_ptr<kv_store::StoredEntry> copy;
  if (stored.in_arena()) {
    if (connection.client_version >= kArenaDataPlaneVersion &&
        connection.leases.size() < options_.max_leases_per_connection) {
      // The lease keeps the block (and so these bytes) from being reused while the client reads.
      const std::uint64_t lease = connection.next_lease++;
      connection.leases.emplace(lease, shared);
      ++leases_;
      kv_store::encode_layout(out, stored.info.layout);
      out.put(stored.info.bytes).put(stored.info.checksum);
      out.put(stored.block->offset()).put(lease).put(stored.block->arena().capacity());
      reply_fds.push_back(stored.block->arena().fd());
      return resolved ? MessageType::kArenaResolved : MessageType::kArenaEntry;
    }
    // An older client (or one holding too many leases) gets a sealed copy of its own.
    KVRELAY_TRY(copy, kv_store::make_stored_entry(stored.info.layout, stored.block->bytes()));
    entry = copy.get();
  }
  UniqueFd duplicate(::fcntl(entry->fd.get(), F_DUPFD_CLOEXEC, 0));
  if (!duplicate) return fail(ErrorCode::kResourceExhausted, "cannot duplicate entry fd");
  kv_store::encode_layout(out, entry->info.layout);
  out.put(entry->info.bytes).put(entry->info.checksum);
  reply_fds.push_back(duplicate.get());
  reply_owned.push_back(std::move(duplicate));
  return resolved ? MessageType::kResolved : MessageType::kEntry;
}

void ShmServer::dispatch_resolve(Connection& connection, std::uint32_t id, ResolveRequest request) {
  connection.resolving = true;
  boost::asio::post(resolve_pool_->pool, [this, client = &connection, id, request = std::move(request)] {
    std::vector<std::byte> reply;
    std::vector<int> reply_fds;
    std::vector<UniqueFd> owned;
    const bool reserve = (request.flags & kResolveReserve) != 0;
    resolve_reply(*client, id, hooks_->resolve(request), reserve, reply, reply_fds, owned);
    const bool sent = send_message(client->socket.get(), reply, reply_fds).has_value();
    {
      std::lock_guard lock(resolved_mutex_);
      resolved_.push_back({client, sent});
    }
    const std::uint64_t one = 1;
    [[maybe_unused]] const auto written = ::write(resolved_fd_.get(), &one, sizeof(one));
  });
}

void ShmServer::collect_resolved(std::vector<Connection*>& dropped) {
  std::uint64_t count = 0;
  [[maybe_unused]] const auto drained = ::read(resolved_fd_.get(), &count, sizeof(count));
  std::vector<ResolveDone> done;
  {
    std::lock_guard lock(resolved_mutex_);
    done.swap(resolved_);
  }
  for (const auto& finished : done) {
    finished.connection->resolving = false;
    if (!finished.keep) dropped.push_back(finished.connection);
  }
}

bool ShmServer::serve_connection(Connection& connection) {
  auto received = receive_message(connection.socket.get());
  if (!received) {
    ++rejected_;
    spdlog::debug("shm: pid {}: {}", connection.pid, received.error().to_string());
    // The datagram is consumed and its fds closed; tell the client and keep the connection.
    const auto reply = encode_error(0, received.error());
    return send_message(connection.socket.get(), reply).has_value();
  }
  if (received.value().closed) return false;
  std::vector<std::byte> reply;
  std::vector<int> reply_fds;
  std::vector<UniqueFd> owned;
  auto frame = decode_frame(received.value().bytes);
  if (!frame) {
    ++rejected_;
    reply = encode_error(0, frame.error());
  } else {
    handle_frame(connection, frame.value(), received.value().fds, reply, reply_fds, owned);
    if (connection.resolving) return true;  // the pool thread replies
    if (reply.empty()) return true;         // a one-way message
  }
  return send_message(connection.socket.get(), reply, reply_fds).has_value();
}

void ShmServer::handle_frame(Connection& connection, const ControlFrame& frame, std::vector<UniqueFd>& fds,
                             std::vector<std::byte>& reply, std::vector<int>& reply_fds,
                             std::vector<UniqueFd>& reply_owned) {
  const auto id = frame.request_id;
  auto refuse = [&](ErrorCode code, std::string message) {
    ++rejected_;
    reply = encode_error(id, Error{code, std::move(message)});
  };
  // An allocated or attached region, filed under a new id and counted as pending until its commit.
  auto file_region = [&](ServedRegion region) {
    const std::uint64_t region_id = next_region_id_++;
    connection.pending_bytes += region.size;
    pending_bytes_ += region.size;
    ++pending_regions_;
    connection.regions.emplace(region_id, std::move(region));
    return region_id;
  };
  const bool takes_fd = frame.type == MessageType::kAttachRegion;
  // From version 5 a CommitContext's chain brings its token ids as an fd (handle_commit counts them).
  const bool may_take_fd =
      takes_fd || (frame.type == MessageType::kCommitContext && connection.client_version >= kChainDataPlaneVersion);
  if (frame.type == MessageType::kRegionProgress && !fds.empty()) {
    ++rejected_;  // one-way: the fds are closed, nothing is answered
    return;
  }
  if (!may_take_fd && !fds.empty()) return refuse(ErrorCode::kProtocol, "unexpected fds attached");
  if (!connection.identity.worker && !peer_may_send(frame.type)) {
    // A peer's KV arrives as pushes over the peer plane, where they are authorized and checked.
    return refuse(
        ErrorCode::kPermissionDenied,
        fmt::format("same-host peer {} may only look entries up on this data plane", connection.identity.peer_id));
  }
  ByteReader reader(frame.payload);
  switch (frame.type) {
    case MessageType::kHello: {
      const auto version = reader.get<std::uint32_t>();
      if (!version || reader.remaining() != 0) return refuse(ErrorCode::kProtocol, "malformed hello");
      if (*version < 1) return refuse(ErrorCode::kBadVersion, "client protocol version 0");
      connection.client_version = *version;
      ByteWriter out;
      out.put(kServerProtocolVersion).put(static_cast<std::uint32_t>(kMaxFdsPerMessage)).put(options_.max_region_bytes);
      reply = encode_frame(MessageType::kHelloOk, id, out.bytes());
      return;
    }
    case MessageType::kAllocRegion:
    case MessageType::kAttachRegion: {
      const auto size = reader.get<std::uint64_t>();
      if (!size || reader.remaining() != 0) return refuse(ErrorCode::kProtocol, "malformed region request");
      if (*size > options_.max_region_bytes) {
        return refuse(ErrorCode::kResourceExhausted, fmt::format("region of {} bytes exceeds the limit", *size));
      }
      if (connection.pending_bytes + *size > options_.max_pending_bytes_per_connection) {
        return refuse(ErrorCode::kResourceExhausted, "too many uncommitted bytes on this connection");
      }
      ServedRegion region;
      region.size = *size;
      if (takes_fd) {
        if (fds.size() != 1) return refuse(ErrorCode::kProtocol, fmt::format("attach needs 1 fd, got {}", fds.size()));
        auto checked = kv_store::check_sealed_memfd(fds[0].get(), 0);
        if (!checked) return refuse(checked.error().code, checked.error().message);
        if (checked.value() != *size) {
          return refuse(ErrorCode::kInvalidArgument,
                        fmt::format("memfd holds {} bytes, message says {}", checked.value(), *size));
        }
        region.fd = std::move(fds[0]);
      } else {
        auto created = kv_store::create_sealed_memfd("kvrelay-region", *size);
        if (!created) return refuse(created.error().code, created.error().message);
        region.fd = std::move(created).value();
        reply_fds.push_back(region.fd.get());
      }
      const std::uint64_t region_id = file_region(std::move(region));
      ByteWriter out;
      out.put(region_id).put(*size);
      reply = encode_frame(takes_fd ? MessageType::kRegionAttached : MessageType::kRegion, id, out.bytes());
      return;
    }
    case MessageType::kAllocArenaRegion: {
      const auto size = reader.get<std::uint64_t>();
      if (!size || reader.remaining() != 0) return refuse(ErrorCode::kProtocol, "malformed arena region request");
      if (!arena_) return refuse(ErrorCode::kUnsupported, "this sidecar has no arena (limits.shm_arena_bytes is 0)");
      if (connection.pending_bytes + *size > options_.max_pending_bytes_per_connection) {
        return refuse(ErrorCode::kResourceExhausted, "too many uncommitted bytes on this connection");
      }
      auto block = arena_->allocate(*size);
      // The client falls back to a region of its own on this answer.
      if (!block) return refuse(block.error().code, block.error().message);
      ServedRegion region;
      region.size = *size;
      region.block = std::move(block).value();
      const std::uint64_t offset = region.block->offset();
      const std::uint64_t region_id = file_region(std::move(region));
      ByteWriter out;
      out.put(region_id).put(*size).put(offset).put(arena_->capacity());
      reply = encode_frame(MessageType::kArenaRegion, id, out.bytes());
      reply_fds.push_back(arena_->fd());
      return;
    }
    case MessageType::kCommit:
    case MessageType::kCommitContext: {
      auto committed = handle_commit(connection, frame, frame.type == MessageType::kCommitContext, fds);
      if (!committed) return refuse(committed.error().code, committed.error().message);
      reply = std::move(committed).value();
      return;
    }
    case MessageType::kAbort: {
      const auto region_id = reader.get<std::uint64_t>();
      if (!region_id || reader.remaining() != 0) return refuse(ErrorCode::kProtocol, "malformed abort");
      const auto found = connection.regions.find(*region_id);
      if (found == connection.regions.end()) return refuse(ErrorCode::kNotFound, "no such region");
      connection.pending_bytes -= found->second.size;
      pending_bytes_ -= found->second.size;
      --pending_regions_;
      connection.regions.erase(found);
      reply = encode_frame(MessageType::kAborted, id, {});
      return;
    }
    case MessageType::kLookup: {
      const auto key = kv_store::decode_key(reader);
      if (!key || reader.remaining() != 0) return refuse(ErrorCode::kProtocol, "malformed lookup");
      // A lookup by key asks for the KV as published: lossy entries are not that.
      auto entry = store_->get_exact(*key);
      if (!entry) return refuse(ErrorCode::kNotFound, "no exact entry for this key");
      if (!connection.identity.worker && hooks_) {
        if (auto authorized = hooks_->authorize_peer_lookup(connection.identity.peer_id, *key, *entry); !authorized)
          return refuse(authorized.error().code, authorized.error().message);
      }
      const bool peer = !connection.identity.worker;
      // KV published without token ids cannot be checked by a receiver: it never leaves the node.
      if (peer && !entry->chain) return refuse(ErrorCode::kNotFound, "entry published without token ids");
      // The kernel duplicates the descriptor into the client; ours stays with the store.
      ByteWriter out;
      auto type = entry_reply(connection, entry, false, out, reply_fds, reply_owned);
      if (!type) return refuse(type.error().code, type.error().message);
      if (connection.client_version >= kChainDataPlaneVersion) {
        // Version 5: whether the entry's chain follows. A same-host sidecar that shares the
        // workers' uid is identified as a worker, and it verifies the chain like a peer.
        const bool with_chain = entry->chain != nullptr;
        out.put(static_cast<std::uint8_t>(with_chain ? 1 : 0));
        if (with_chain) {
          auto tokens = chain_tokens_memfd(entry->chain->tokens);
          if (!tokens) return refuse(tokens.error().code, tokens.error().message);
          encode_chain_header(out, ChainHeader::of(*entry->chain), connection.client_version);
          reply_fds.push_back(tokens.value().get());
          reply_owned.push_back(std::move(tokens).value());
        }
      }
      reply = encode_frame(type.value(), id, out.bytes());
      return;
    }
    case MessageType::kRegionProgress: {
      // One-way: nothing is sent back, so a bad report is only counted (a commit still checks
      // the whole region).
      const auto region_id = reader.get<std::uint64_t>();
      const auto written = reader.get<std::uint64_t>();
      const auto found = region_id ? connection.regions.find(*region_id) : connection.regions.end();
      if (!written || reader.remaining() != 0 || found == connection.regions.end() || !found->second.block ||
          !verifier_) {
        ++rejected_;
        return;
      }
      advance_verification(verifier_->pool, found->second, std::min(*written, found->second.size));
      return;
    }
    case MessageType::kReleaseLeases: {
      const auto count = reader.get<std::uint32_t>();
      if (!count || reader.remaining() != std::size_t{*count} * sizeof(std::uint64_t)) {
        return refuse(ErrorCode::kProtocol, "malformed lease release");
      }
      std::uint32_t released = 0;
      for (std::uint32_t index = 0; index < *count; ++index) {
        // Unknown ids are ignored: releasing twice is harmless, and another client's ids are not ours.
        if (connection.leases.erase(*reader.get<std::uint64_t>()) == 1) ++released;
      }
      leases_ -= released;
      ByteWriter out;
      out.put(released);
      reply = encode_frame(MessageType::kLeasesReleased, id, out.bytes());
      return;
    }
    case MessageType::kResolve: {
      // Only a version-6 client sends flags, so only it can reserve.
      auto request = decode_resolve(frame.payload, connection.client_version);
      if (!request) return refuse(request.error().code, request.error().message);
      request.value().client_version = connection.client_version;
      if (hooks_ && resolve_pool_) return dispatch_resolve(connection, id, std::move(request).value());
      const bool reserve = (request.value().flags & kResolveReserve) != 0;
      auto resolved = hooks_ ? hooks_->resolve(request.value()) : resolve_from_store(*store_, request.value());
      return resolve_reply(connection, id, std::move(resolved), reserve, reply, reply_fds, reply_owned);
    }
    case MessageType::kClaim:
    case MessageType::kRelease: {
      if (connection.client_version < kReservationDataPlaneVersion) {
        return refuse(ErrorCode::kProtocol, fmt::format("reservations need data-plane version {}; this client said {}",
                                                        kReservationDataPlaneVersion, connection.client_version));
      }
      const auto reservation = reader.get<std::uint64_t>();
      if (!reservation || reader.remaining() != 0) return refuse(ErrorCode::kProtocol, "malformed reservation request");
      std::optional<Reservations::Held> held;
      {
        std::lock_guard lock(reservations_->mutex);
        const auto found = reservations_->held.find(*reservation);
        if (found != reservations_->held.end()) {
          held = std::move(found->second);
          reservations_->held.erase(found);  // claimed or released: once
        }
        reservations_->drop_front_expired_or_over(options_.max_reservations, std::chrono::steady_clock::now());
      }
      if (frame.type == MessageType::kRelease) {
        reply = encode_frame(MessageType::kReleased, id, {});  // an unknown id too: idempotent
        return;
      }
      if (!held || held->deadline <= std::chrono::steady_clock::now()) {
        reply = encode_error(
            id, Error{ErrorCode::kNotFound, fmt::format("reservation {} expired or unknown", *reservation)});
        return;
      }
      return resolve_reply(connection, id, std::move(held->resolved), false, reply, reply_fds, reply_owned);
    }
    case MessageType::kPrefillReport: {
      auto report = decode_prefill_report(frame.payload);
      if (!report) return refuse(report.error().code, report.error().message);
      if (hooks_) hooks_->prefill_observed(report.value());
      reply = encode_frame(MessageType::kPrefillNoted, id, {});
      return;
    }
    case MessageType::kStats: {
      if (reader.remaining() != 0) return refuse(ErrorCode::kProtocol, "malformed stats request");
      reply = encode_frame(MessageType::kStatsReply, id, encode_stats(stats()));
      return;
    }
    case MessageType::kOpenRing: {
      if (reader.remaining() != 0) return refuse(ErrorCode::kProtocol, "malformed open-ring request");
      if (connection.wake_server) return refuse(ErrorCode::kAlreadyExists, "ring already open on this connection");
      const std::uint64_t ring_bytes = options_.ring.ring_bytes();
      auto memory = kv_store::create_sealed_memfd("kvrelay-ring", 2 * ring_bytes);
      if (!memory) return refuse(memory.error().code, memory.error().message);
      auto mapping = kv_store::Mapping::map(memory.value().get(), 2 * ring_bytes, true);
      if (!mapping) return refuse(mapping.error().code, mapping.error().message);
      UniqueFd wake_server(::eventfd(0, EFD_CLOEXEC | EFD_NONBLOCK));
      UniqueFd wake_client(::eventfd(0, EFD_CLOEXEC));
      if (!wake_server || !wake_client) return refuse(ErrorCode::kResourceExhausted, "eventfd failed");
      connection.ring_memory = std::move(mapping).value();
      connection.requests.emplace(connection.ring_memory.data(), options_.ring);
      connection.responses.emplace(connection.ring_memory.data() + ring_bytes, options_.ring);
      connection.requests->initialize();
      connection.responses->initialize();
      reply_fds = {memory.value().get(), wake_server.get(), wake_client.get()};
      reply_owned.push_back(std::move(memory).value());
      connection.wake_server = std::move(wake_server);
      connection.wake_client = std::move(wake_client);
      ++open_rings_;
      ByteWriter out;
      out.put(options_.ring.slots).put(options_.ring.slot_bytes);
      reply = encode_frame(MessageType::kRingOpened, id, out.bytes());
      return;
    }
    case MessageType::kPing:
      reply = encode_frame(MessageType::kPong, id, frame.payload);
      return;
    default:
      return refuse(ErrorCode::kProtocol, "not a request type");
  }
}

Result<std::vector<std::byte>> ShmServer::handle_commit(Connection& connection, const ControlFrame& frame,
                                                        bool with_context, std::span<const UniqueFd> fds) {
  KVRELAY_TRY(const auto commit, decode_commit(frame.payload, with_context, connection.client_version));
  const auto found = connection.regions.find(commit.region_id);
  if (found == connection.regions.end()) return fail(ErrorCode::kNotFound, "no such region on this connection");
  // A commit consumes its region whatever the outcome (after F_SEAL_WRITE it could not be
  // written again anyway), so a failed commit never strands memory.
  ServedRegion region = std::move(found->second);
  connection.regions.erase(found);
  connection.pending_bytes -= region.size;
  pending_bytes_ -= region.size;
  --pending_regions_;
  const kv_store::EntryInfo info{commit.layout, commit.bytes, commit.checksum};
  KVRELAY_TRY(kv_store::validate_entry_info(info));
  if (info.bytes != region.size) {
    return fail(ErrorCode::kLayoutMismatch,
                fmt::format("commit of {} bytes into a region of {}", info.bytes, region.size));
  }
  KVRELAY_TRY(auto chain, commit_chain(commit, fds));
  std::uint64_t actual = 0;
  if (region.block) {
    // Nothing but this check stands between the client's writes and readers: after it, the
    // block belongs to the entry (and the client was granted no other range).
    actual = arena_region_checksum(region);
  } else {
    KVRELAY_TRY(kv_store::seal_contents(region.fd.get()));
    // Read through the kernel rather than a new mapping (see kv_store::checksum_memfd).
    KVRELAY_TRY(actual, kv_store::checksum_memfd(region.fd.get(), region.size));
  }
  if (actual != info.checksum) {
    return fail(ErrorCode::kChecksumMismatch,
                fmt::format("region checksum 0x{:016x} != committed 0x{:016x}", actual, info.checksum));
  }
  auto entry = std::make_shared<kv_store::StoredEntry>();
  entry->info = info;
  entry->fd = std::move(region.fd);
  entry->block = std::move(region.block);
  entry->fidelity = commit.fidelity.prefix(commit.layout.tokens);
  entry->chain = std::move(chain);
  const std::shared_ptr<const kv_store::StoredEntry> stored = entry;
  KVRELAY_TRY(store_->put(commit.key, stored));
  ++commits_;
  if (with_context && hooks_) hooks_->published(commit.key, stored, commit.params_json);
  return encode_frame(with_context ? MessageType::kContextCommitted : MessageType::kCommitted, frame.request_id, {});
}

bool ShmServer::serve_ring(Connection& connection) {
  std::uint64_t count = 0;
  [[maybe_unused]] const auto drained = ::read(connection.wake_server.get(), &count, sizeof(count));
  std::vector<std::byte> message(options_.ring.max_message());
  bool pushed = false;
  while (true) {
    auto popped = connection.requests->pop(message);
    if (!popped) {
      spdlog::warn("shm: pid {}: {}; closing", connection.pid, popped.error().to_string());
      return false;
    }
    if (!popped.value()) break;
    auto answer = small_handler_(std::span(message.data(), *popped.value()));
    auto written = connection.responses->push(answer);
    if (!written || !written.value()) {
      // A client that does not drain its responses is not following the protocol.
      spdlog::warn("shm: pid {}: response ring full or corrupt; closing", connection.pid);
      return false;
    }
    pushed = true;
  }
  if (pushed) {
    const std::uint64_t one = 1;
    [[maybe_unused]] const auto woke = ::write(connection.wake_client.get(), &one, sizeof(one));
  }
  return true;
}

}  // namespace kvrelay::shm
