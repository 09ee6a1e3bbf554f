#pragma once

// The sidecar end of the worker data plane: a Unix SOCK_SEQPACKET listener that hands out
// sealed memfd regions, validates commits, answers lookups and serves small messages over
// shared-memory rings. One thread runs a poll loop over every connection; resolves, which may
// wait on a peer, run on a small pool.

#include <atomic>
#include <chrono>
#include <cstdint>
#include <functional>
#include <memory>
#include <mutex>
#include <optional>
#include <span>
#include <string>
#include <thread>
#include <vector>

#include "kvrelay/core/memory_strategy.h"
#include "kvrelay/core/result.h"
#include "kvrelay/kv_store/arena.h"
#include "kvrelay/kv_store/entry_store.h"
#include "kvrelay/kv_store/memory_strategy.h"
#include "kvrelay/shm_transport/control_protocol.h"
#include "kvrelay/shm_transport/spsc_ring.h"

namespace kvrelay::shm {

// A same-host peer sidecar as the data plane knows it: the uid its connections carry (the
// policy's peers[].uid).
struct SameHostPeerUid {
  std::string peer_id;
  std::uint32_t uid = 0;
};

// Who a data-plane connection is, from its SO_PEERCRED uid alone, before any frame is read.
struct ConnectionIdentity {
  bool worker = false;  // the daemon's uid or one of listen.allowed_uids: every request
  std::string peer_id;  // the same-host peer whose uid it is ("" for none)
};

// nullopt: neither a worker's uid nor a same-host peer's; the connection is refused. A uid that
// is both is a worker's (SO_PEERCRED cannot tell the two apart), with peer_id set.
[[nodiscard]] std::optional<ConnectionIdentity> identify_connection(std::uint32_t uid, std::uint32_t own_uid,
                                                                    std::span<const std::uint32_t> allowed_uids,
                                                                    std::span<const SameHostPeerUid> peers);

struct ShmServerOptions {
  std::string socket_path;
  std::string socket_group;                 // "" keeps mode 0600; a group name gives 0660 + chgrp
  std::vector<std::uint32_t> allowed_uids;  // besides the daemon's own uid
  // Same-host peer sidecars, asked at each accepted connection (so that a reload applies). A
  // connection with one's uid and no worker's is that peer's: it may only look entries up,
  // each lookup passing DataPlaneHooks::authorize_peer_lookup.
  std::function<std::vector<SameHostPeerUid>()> same_host_peers;
  std::uint64_t max_region_bytes = 64ULL << 30;
  std::uint64_t max_pending_bytes_per_connection = 64ULL << 30;
  std::uint32_t max_connections = 256;
  RingGeometry ring{};
  // Resolves run on this many threads, so one waiting on a peer never holds up other clients
  // (each connection still gets its answers in order); 0 runs them on the poll thread.
  std::uint32_t resolve_threads = 4;
  // Bytes of the shared arena (0: none; every entry gets its own sealed memfd). See arena.h.
  std::uint64_t arena_bytes = 0;
  // kPrefault: one paced background thread prefaults the arena (kv_store/memory_strategy.h).
  MemoryStrategy memory_strategy = kDefaultMemoryStrategy;
  // Arena entries one connection may hold at once; past this it gets sealed copies.
  std::uint32_t max_leases_per_connection = 4096;
  // Version 6 reservations: how long a reserving Resolve's answer waits for its Claim, and how
  // many wait at once (past that the oldest is dropped).
  std::chrono::milliseconds reservation_ttl{30'000};
  std::uint32_t max_reservations = 4096;
};

// What a Resolve answers with: an entry (from the store, fetched from a peer, or converted for
// this request) covering `meta.blocks` leading blocks.
struct ResolvedEntry {
  std::shared_ptr<const kv_store::StoredEntry> entry;
  ResolvedMeta meta;
};

// The sidecar's KV policy behind the data plane (the daemon's KV path). resolve() is called on
// the server's resolve threads, concurrently for different connections, so implementations are
// thread-safe and bound their time; the other hooks run on the poll thread.
class DataPlaneHooks {
 public:
  virtual ~DataPlaneHooks() = default;
  // kNotFound is a miss (its message says why); other errors are reported to the worker as such.
  [[nodiscard]] virtual Result<ResolvedEntry> resolve(const ResolveRequest& request) = 0;
  // After a CommitContext put `entry` in the store under `key`.
  virtual void published(const kv_store::EntryKey& key, const std::shared_ptr<const kv_store::StoredEntry>& entry,
                         std::string_view params_json) = 0;
  virtual void prefill_observed(const PrefillReport& report) = 0;
  // A Lookup from a same-host peer sidecar's connection (ConnectionIdentity without worker) that
  // found `entry`: the rules a TCP peer's Fetch gets apply to it too. An error is the reply.
  // Poll thread.
  [[nodiscard]] virtual Status authorize_peer_lookup(std::string_view peer_id, const kv_store::EntryKey& key,
                                                     const kv_store::StoredEntry& entry) {
    (void)peer_id;
    (void)key;
    (void)entry;
    return ok();
  }
};

// The store alone: the longest exact prefix it holds, under the prefix's own key or as the first
// blocks of a longer entry (then served as a slice of exactly those blocks); no medium choice, no peers.
[[nodiscard]] Result<ResolvedEntry> resolve_from_store(kv_store::EntryStore& store, const ResolveRequest& request);

// Answers one small ring message; the default echoes it (a ping).
using SmallMessageHandler = std::function<std::vector<std::byte>(std::span<const std::byte>)>;

class ShmServer {
 public:
  ~ShmServer();
  ShmServer(const ShmServer&) = delete;
  ShmServer& operator=(const ShmServer&) = delete;

  // Binds the socket (replacing a stale socket file, never any other file) and applies mode,
  // group and uid policy. Does not start serving.
  [[nodiscard]] static Result<std::unique_ptr<ShmServer>> listen(ShmServerOptions options,
                                                                 std::shared_ptr<kv_store::EntryStore> store);

  void set_small_message_handler(SmallMessageHandler handler) { small_handler_ = std::move(handler); }
  // Set before start(); without hooks Resolve answers from the store alone.
  void set_hooks(std::shared_ptr<DataPlaneHooks> hooks) { hooks_ = std::move(hooks); }

  // Serves on the calling thread until stop().
  void run();
  // Serves on a background thread.
  void start();
  // Thread-safe; returns once the loop has exited (when started with start()).
  void stop();

  [[nodiscard]] ServerStats stats() const;
  [[nodiscard]] const std::string& socket_path() const { return options_.socket_path; }
  // nullptr without one. Other parts of the sidecar put entries they create here too.
  [[nodiscard]] const std::shared_ptr<kv_store::ShmArena>& arena() const { return arena_; }

 private:
  struct Connection;
  ShmServer(ShmServerOptions options, std::shared_ptr<kv_store::EntryStore> store);

  void accept_connections();
  // false: drop the connection.
  bool serve_connection(Connection& connection);
  bool serve_ring(Connection& connection);
  void handle_frame(Connection& connection, const ControlFrame& frame, std::vector<UniqueFd>& fds,
                    std::vector<std::byte>& reply, std::vector<int>& reply_fds, std::vector<UniqueFd>& reply_owned);
  // CommitContext carries the request's params after the Commit fields (and from version 5 may
  // carry a chain, its token ids in `fds`).
  [[nodiscard]] Result<std::vector<std::byte>> handle_commit(Connection& connection, const ControlFrame& frame,
                                                             bool with_context, std::span<const UniqueFd> fds);
  void close_connection(std::size_t index);
  [[nodiscard]] std::optional<ConnectionIdentity> identify(std::uint32_t uid) const;
  // The Resolved (with the entry's fd) or error reply to a resolve.
  // With `reserve` a found entry is kept under a new reservation and the reply is Reserved.
  void resolve_reply(Connection& connection, std::uint32_t id, Result<ResolvedEntry> resolved, bool reserve,
                     std::vector<std::byte>& reply, std::vector<int>& reply_fds, std::vector<UniqueFd>& reply_owned);
  // The fields and fd of an Entry/Resolved reply: an arena block under a new lease for clients
  // that speak version 3, else a sealed memfd (a copy, for arena entries). Returns the reply type.
  [[nodiscard]] Result<MessageType> entry_reply(Connection& connection,
                                                const std::shared_ptr<const kv_store::StoredEntry>& entry,
                                                bool resolved, ByteWriter& out, std::vector<int>& reply_fds,
                                                std::vector<UniqueFd>& reply_owned);
  // Runs a resolve on the pool; the connection is not polled until its reply is sent.
  void dispatch_resolve(Connection& connection, std::uint32_t id, ResolveRequest request);
  // Puts connections whose pooled resolve finished back into the poll set (or drops them).
  void collect_resolved(std::vector<Connection*>& dropped);

  struct ResolvePool;
  struct Reservations;
  std::unique_ptr<Reservations> reservations_;  // pool threads file, the poll thread claims
  struct ResolveDone {
    Connection* connection = nullptr;
    bool keep = true;
  };

  ShmServerOptions options_;
  std::shared_ptr<kv_store::EntryStore> store_;
  std::shared_ptr<kv_store::ShmArena> arena_;
  // Prefaults the arena under MemoryStrategy::kPrefault; stopped by stop().
  kv_store::PageWarmer arena_warmer_;
  SmallMessageHandler small_handler_;
  std::shared_ptr<DataPlaneHooks> hooks_;
  UniqueFd listen_fd_;
  UniqueFd stop_fd_;  // eventfd that wakes the poll loop for stop()
  std::vector<std::unique_ptr<Connection>> connections_;
  std::thread thread_;
  std::uint64_t next_region_id_ = 1;
  std::unique_ptr<ResolvePool> resolve_pool_;
  std::unique_ptr<ResolvePool> verifier_;  // one thread: hashes arena regions as they are written
  UniqueFd resolved_fd_;                   // eventfd: a pooled resolve finished
  std::mutex resolved_mutex_;
  std::vector<ResolveDone> resolved_;

  std::atomic<std::uint64_t> connections_count_{0};
  std::atomic<std::uint64_t> pending_regions_{0};
  std::atomic<std::uint64_t> pending_bytes_{0};
  std::atomic<std::uint64_t> commits_{0};
  std::atomic<std::uint64_t> rejected_{0};
  std::atomic<std::uint64_t> refused_{0};
  std::atomic<std::uint64_t> open_rings_{0};
  std::atomic<std::uint64_t> leases_{0};
};

}  // namespace kvrelay::shm
