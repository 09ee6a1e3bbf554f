#pragma once

// Worker-side client of the sidecar's data plane (C++). Engines that cannot link C++ use the
// C ABI in kvrelay_client.h, which wraps this class.
//
// Publishing is two-phase: allocate() returns a writable shared region, the engine writes KV
// into it in place, and commit() hands it back with its layout and checksum. The region is
// unmapped before the commit is sent so the sidecar can seal it against writes.

#include <atomic>
#include <chrono>
#include <cstdint>
#include <memory>
#include <mutex>
#include <optional>
#include <span>
#include <string>
#include <vector>

#include "kvrelay/core/memory_strategy.h"
#include "kvrelay/core/result.h"
#include "kvrelay/kv_store/entry.h"
#include "kvrelay/kv_store/entry_chain.h"
#include "kvrelay/kv_store/memfd.h"
#include "kvrelay/kv_store/memory_strategy.h"
#include "kvrelay/shm_transport/control_protocol.h"
#include "kvrelay/shm_transport/spsc_ring.h"

namespace kvrelay::shm {

// The sidecar's arena as this process maps it: once, for as long as any region or entry in it
// lives, so its pages stay mapped across publishes and reads.
struct ClientArena {
  ClientArena() = default;
  ~ClientArena() { warmer.stop(); }  // before the mapping goes
  ClientArena(const ClientArena&) = delete;
  ClientArena& operator=(const ClientArena&) = delete;

  UniqueFd fd;
  kv_store::Mapping mapping;
  std::uint64_t device = 0;
  std::uint64_t inode = 0;
  // Started only under MemoryStrategy::kPrefault (ShmClientOptions::memory_strategy).
  kv_store::PageWarmer warmer;
};

// How a client talks to its sidecar, and what it may do inside the caller's process.
struct ShmClientOptions {
  // Below kDataPlaneVersion the client behaves as an older one (compatibility tests; a strictly
  // isolated client can also say 2 to keep out of the arena).
  std::uint32_t protocol_version = kDataPlaneVersion;
  // How long any reply, the hello's included, is waited for (SO_RCVTIMEO on socket_fd(), which a
  // caller may later set per call).
  std::chrono::milliseconds reply_timeout = std::chrono::seconds(60);
  // Whether allocate()/publish() use the sidecar's arena (version 3 and it has one).
  bool use_arena = true;
  // kPortable (the default) starts no thread in the caller's process. kPrefault starts one paced
  // background thread per mapped arena that touches each page of this process's mapping once
  // (kv_store/memory_strategy.h): pass the sidecar's limits.memory_strategy.
  MemoryStrategy memory_strategy = kDefaultMemoryStrategy;
};

// Arena entries this process holds; the client gives them back to the sidecar on its next call
// (or release_leases()), after which their blocks may be reused.
struct LeaseReturns {
  std::mutex mutex;
  std::vector<std::uint64_t> ids;
  // A second descriptor of the client's socket: the sidecar ends a connection's leases when it
  // hangs up, so the connection stays up while any entry holds a lease, even past the client.
  UniqueFd connection;
};
struct ArenaLease {
  ArenaLease(std::shared_ptr<LeaseReturns> returns, std::uint64_t id) : returns_(std::move(returns)), id_(id) {}
  ~ArenaLease();
  ArenaLease(const ArenaLease&) = delete;
  ArenaLease& operator=(const ArenaLease&) = delete;

 private:
  std::shared_ptr<LeaseReturns> returns_;
  std::uint64_t id_;
};

struct WritableRegion {
  std::uint64_t id = 0;
  std::uint64_t size = 0;
  UniqueFd fd;                               // a region of its own (empty for arena regions)
  kv_store::Mapping mapping;                 // its mapping; empty for regions publish() fills through the fd
  std::shared_ptr<const ClientArena> arena;  // an arena region: `size` bytes at `arena_offset`
  std::uint64_t arena_offset = 0;
  [[nodiscard]] bool in_arena() const { return arena != nullptr; }
  [[nodiscard]] std::span<std::byte> bytes() const {
    if (arena) return arena->mapping.bytes().subspan(arena_offset, size);
    return mapping.bytes();
  }
};

// A committed entry. Either its own memfd sealed against writes (mapped read-only unless asked
// for unmapped), or a block of the sidecar's arena held under a lease until this is destroyed.
struct ReadOnlyEntry {
  kv_store::EntryInfo info;
  UniqueFd fd;
  kv_store::Mapping mapping;
  std::shared_ptr<const ClientArena> arena;
  std::uint64_t arena_offset = 0;
  std::shared_ptr<ArenaLease> lease;
  // The token ids the entry's key is the chain of (version 5, entries published with them):
  // unverified here, a same-host sidecar's fetch stage recomputes the chain.
  std::optional<kv_store::EntryChain> chain;
  [[nodiscard]] bool in_arena() const { return arena != nullptr; }
  [[nodiscard]] std::span<const std::byte> bytes() const {
    if (arena) return arena->mapping.bytes().subspan(arena_offset, info.bytes);
    return mapping.bytes();
  }
  // Copies `out.size()` bytes from `offset` into `out` with pread: the kernel copies through its
  // own mapping, so this costs the same whether or not this process has touched those arena
  // pages before (a first read through a mapping faults per page), and works on entries
  // resolved unmapped.
  [[nodiscard]] Status read(std::uint64_t offset, std::span<std::byte> out) const;
};

// A Resolve answer: the entry, and which prefix it covers with which medium.
struct ResolvedPrefix {
  ReadOnlyEntry entry;
  ResolvedMeta meta;
};

// A reserving Resolve's answer (version 6): what it covers, and the id a Claim takes it by.
struct Reservation {
  ResolvedMeta meta;
  std::uint64_t id = 0;
};

class ShmClient {
 public:
  ShmClient() = default;
  ShmClient(ShmClient&&) noexcept = default;
  ShmClient& operator=(ShmClient&&) noexcept = default;
  ~ShmClient();

  [[nodiscard]] static Result<ShmClient> connect(const std::string& socket_path, const ShmClientOptions& options);
  // The same with default options but these two (see ShmClientOptions).
  [[nodiscard]] static Result<ShmClient> connect(const std::string& socket_path,
                                                 std::uint32_t protocol_version = kDataPlaneVersion,
                                                 std::chrono::milliseconds reply_timeout = std::chrono::seconds(60));

  [[nodiscard]] Result<WritableRegion> allocate(std::uint64_t size);
  // Hands over a memfd the client created itself (must carry F_SEAL_SHRINK | F_SEAL_GROW).
  [[nodiscard]] Result<WritableRegion> attach(UniqueFd memfd);
  // Unmaps the region, then asks the sidecar to validate and publish it. The region is
  // consumed either way.
  [[nodiscard]] Status commit(WritableRegion region, const kv_store::EntryKey& key, const KvLayout& layout,
                              std::uint64_t checksum);
  // commit() for a region the caller has finished writing, with the checksum computed here. In
  // the arena the hash tells the sidecar every few MiB how far it got, as publish's copy does,
  // so the sidecar's check runs alongside on its own thread (reading what this pass just
  // brought into the shared cache) instead of after it.
  [[nodiscard]] Status commit_written(WritableRegion region, const kv_store::EntryKey& key, const KvLayout& layout);
  // commit_written with what publish_with_context carries (params, fidelity, chain).
  [[nodiscard]] Status commit_written_with_context(WritableRegion region, const kv_store::EntryKey& key,
                                                   const KvLayout& layout, std::string_view params_json,
                                                   const Fidelity& fidelity, const kv_store::EntryChain* chain);
  [[nodiscard]] Status abort(WritableRegion region);
  // allocate + copy (hashing while the data is in cache) + commit. The copy goes through the
  // region's fd (pwrite), not a mapping: one kernel copy, no page faults in this process.
  [[nodiscard]] Status publish(const kv_store::EntryKey& key, const KvLayout& layout, std::span<const std::byte> bytes);
  // kNotFound on a miss.
  [[nodiscard]] Result<ReadOnlyEntry> lookup(const kv_store::EntryKey& key);

  // Data-plane version the sidecar announced in its hello (1: no context messages).
  [[nodiscard]] std::uint32_t server_version() const { return server_version_; }
  // Version 2. kNotFound on a miss (the message says why: medium tokens, nothing held, ...).
  [[nodiscard]] Result<ResolvedPrefix> resolve(const ResolveRequest& request);
  // The same, leaving the entry unmapped, for a reader that copies it once into memory of its
  // own (pread on entry.fd) and so needs no mapping.
  [[nodiscard]] Result<ResolvedPrefix> resolve_unmapped(const ResolveRequest& request);
  // Version 6: the same decision, kept in the sidecar (request.flags gets kResolveReserve) for a
  // later claim() from any worker connection of that sidecar, once; nothing is mapped here.
  [[nodiscard]] Result<Reservation> reserve(const ResolveRequest& request);
  // The entry a reservation holds (kNotFound: expired, unknown or claimed), mapped unless `map`
  // is false. `prompt_blocks` bounds the reply's blocks (0: unchecked).
  [[nodiscard]] Result<ResolvedPrefix> claim(std::uint64_t reservation, bool map = true);
  // Drops a reservation nobody will claim; an unknown id is not an error.
  [[nodiscard]] Status release_reservation(std::uint64_t reservation);
  // SO_RCVTIMEO for the replies of later calls. After a reply times out the client refuses every
  // further call (kIo): a late reply would answer the wrong request.
  void set_reply_timeout(std::chrono::milliseconds timeout);
  [[nodiscard]] std::chrono::milliseconds reply_timeout() const { return reply_timeout_; }
  // Version 2: publish with the request's params, so the sidecar can push the KV ahead; with
  // how faithful the KV is (version 4): a worker that imported a lossy prefix says so, and the
  // sidecar never files that KV as exact. Lossy KV is refused (kUnsupported, nothing sent) by a
  // sidecar older than version 4. With `chain` (version 5), the token ids `key` is the chain of
  // (tenant ""): the sidecar refuses a mismatch (kChainMismatch, nothing stored), and only KV
  // published with one may go to a peer. An older sidecar gets the KV without it.
  [[nodiscard]] Status publish_with_context(const kv_store::EntryKey& key, const KvLayout& layout,
                                            std::span<const std::byte> bytes, std::string_view params_json,
                                            const Fidelity& fidelity = Fidelity::exact(),
                                            const kv_store::EntryChain* chain = nullptr);
  [[nodiscard]] Status report_prefill(const PrefillReport& report);
  [[nodiscard]] Result<ServerStats> stats();
  [[nodiscard]] Result<std::vector<std::byte>> ping(std::span<const std::byte> payload);
  // Gives back the arena entries this client has destroyed (also done before every call).
  [[nodiscard]] Status release_leases();
  // ShmClientOptions::use_arena, after connecting; allocate()/publish() fall back to regions of
  // their own when the arena is full.
  void set_use_arena(bool use) { use_arena_ = use; }
  // ShmClientOptions::memory_strategy for arenas mapped from now on.
  void set_memory_strategy(MemoryStrategy strategy) { memory_strategy_ = strategy; }

  // Small messages over the shared-memory ring (opened on first use).
  [[nodiscard]] Status open_ring();
  // Sends one message and waits for its answer; returns the answer's length in `answer`.
  [[nodiscard]] Result<std::size_t> ring_call(std::span<const std::byte> message, std::span<std::byte> answer);

  [[nodiscard]] int socket_fd() const { return socket_.get(); }

 private:
  struct Reply {
    ControlFrame frame;
    std::vector<std::byte> storage;
    std::vector<UniqueFd> fds;
  };
  // `alternate_reply`, when set, is a second acceptable reply type with the same fd count; up to
  // `optional_fds` more fds than `expected_fds` are accepted (the caller checks them).
  [[nodiscard]] Result<Reply> call(MessageType type, std::span<const std::byte> payload, MessageType expected_reply,
                                   std::size_t expected_fds, std::span<const int> fds = {},
                                   std::optional<MessageType> alternate_reply = std::nullopt,
                                   std::size_t optional_fds = 0);
  [[nodiscard]] Result<Reply> exchange(MessageType type, std::span<const std::byte> payload, std::span<const int> fds);
  // The arena an arena reply's fd names, mapped once per arena.
  [[nodiscard]] Result<std::shared_ptr<const ClientArena>> adopt_arena(UniqueFd fd, std::uint64_t arena_bytes);
  [[nodiscard]] Result<WritableRegion> allocate_in_arena(std::uint64_t size);
  // An arena region when the sidecar has an arena with room; nullopt means "use a region of
  // your own" (and after kUnsupported, stop asking).
  [[nodiscard]] Result<std::optional<WritableRegion>> try_arena_region(std::uint64_t size);

  [[nodiscard]] Result<ReadOnlyEntry> map_entry(Reply& reply, ByteReader& reader, bool map = true);
  [[nodiscard]] Result<ResolvedPrefix> resolve_as(const ResolveRequest& request, bool map);
  // The meta that ends a Resolved reply (and a Reserved one, which always has the fidelity).
  [[nodiscard]] Result<ResolvedMeta> read_meta(ByteReader& reader, bool with_fidelity) const;
  [[nodiscard]] Result<ResolvedPrefix> resolved_reply(Reply& reply, bool map);
  [[nodiscard]] Status commit_as(MessageType type, WritableRegion region, const kv_store::EntryKey& key,
                                 const KvLayout& layout, std::uint64_t checksum, std::string_view params_json,
                                 const Fidelity& fidelity, const kv_store::EntryChain* chain);
  [[nodiscard]] Status lossy_unsupported() const;
  // A region of `size` bytes from the sidecar, not mapped here.
  [[nodiscard]] Result<WritableRegion> allocate_unmapped(std::uint64_t size);
  [[nodiscard]] Result<WritableRegion> copy_into_region(std::span<const std::byte> bytes, std::uint64_t& checksum);
  // The checksum of a written region (telling the sidecar the progress of big arena regions).
  [[nodiscard]] std::uint64_t checksum_written(const WritableRegion& region);
  // One-way RegionProgress: the sidecar may check the region's first `written` bytes.
  void report_progress(std::uint64_t region_id, std::uint64_t written);

  UniqueFd socket_;
  bool timed_out_ = false;  // a reply did not come in time: no further calls
  std::chrono::milliseconds reply_timeout_{std::chrono::seconds(60)};
  std::uint32_t next_request_ = 1;
  std::uint32_t server_version_ = 1;
  std::uint32_t protocol_version_ = kDataPlaneVersion;  // what this client said in its hello
  // Ring state (unique_ptr keeps the class movable; SpscRing points into ring_memory_).
  kv_store::Mapping ring_memory_;
  std::optional<SpscRing> requests_;
  std::optional<SpscRing> responses_;
  UniqueFd wake_server_;
  UniqueFd wake_client_;
  bool use_arena_ = true;
  MemoryStrategy memory_strategy_ = kDefaultMemoryStrategy;
  std::shared_ptr<const ClientArena> arena_;
  std::shared_ptr<LeaseReturns> lease_returns_ = std::make_shared<LeaseReturns>();
};

// xxh3_64, the checksum every commit carries (the AVX2 build where the CPU has it).
[[nodiscard]] std::uint64_t checksum_bytes(std::span<const std::byte> bytes);

}  // namespace kvrelay::shm
