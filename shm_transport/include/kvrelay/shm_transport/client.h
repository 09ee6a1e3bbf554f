#pragma once

// Worker-side client of the sidecar's data plane (C++). Engines that cannot link C++ use the
// C ABI in kvrelay_client.h, which wraps this class.
//
// Publishing is two-phase: allocate() returns a writable shared region, the engine writes KV
// into it in place, and commit() hands it back with its layout and checksum. The region is
// unmapped before the commit is sent so the sidecar can seal it against writes.

#include <cstdint>
#include <optional>
#include <span>
#include <string>
#include <vector>

#include "kvrelay/core/result.h"
#include "kvrelay/shm_transport/control_protocol.h"
#include "kvrelay/shm_transport/entry.h"
#include "kvrelay/shm_transport/memfd.h"
#include "kvrelay/shm_transport/spsc_ring.h"

namespace kvrelay::shm {

struct WritableRegion {
  std::uint64_t id = 0;
  std::uint64_t size = 0;
  UniqueFd fd;
  Mapping mapping;  // empty for regions publish() fills through the fd
  [[nodiscard]] std::span<std::byte> bytes() const { return mapping.bytes(); }
};

// A committed entry, mapped read-only (unless asked for unmapped); the fd is sealed against
// writes, so the bytes cannot change under the reader.
struct ReadOnlyEntry {
  EntryInfo info;
  UniqueFd fd;
  Mapping mapping;
  [[nodiscard]] std::span<const std::byte> bytes() const { return mapping.bytes(); }
};

// A Resolve answer: the entry, and which prefix it covers with which medium.
struct ResolvedPrefix {
  ReadOnlyEntry entry;
  ResolvedMeta meta;
};

class ShmClient {
 public:
  ShmClient() = default;
  ShmClient(ShmClient&&) noexcept = default;
  ShmClient& operator=(ShmClient&&) noexcept = default;
  ~ShmClient();

  [[nodiscard]] static Result<ShmClient> connect(const std::string& socket_path);

  [[nodiscard]] Result<WritableRegion> allocate(std::uint64_t size);
  // Hands over a memfd the client created itself (must carry F_SEAL_SHRINK | F_SEAL_GROW).
  [[nodiscard]] Result<WritableRegion> attach(UniqueFd memfd);
  // Unmaps the region, then asks the sidecar to validate and publish it. The region is
  // consumed either way.
  [[nodiscard]] Status commit(WritableRegion region, const EntryKey& key, const KvLayout& layout,
                              std::uint64_t checksum);
  [[nodiscard]] Status abort(WritableRegion region);
  // allocate + copy (hashing while the data is in cache) + commit. The copy goes through the
  // region's fd (pwrite), not a mapping: one kernel copy, no page faults in this process.
  [[nodiscard]] Status publish(const EntryKey& key, const KvLayout& layout, std::span<const std::byte> bytes);
  // kNotFound on a miss.
  [[nodiscard]] Result<ReadOnlyEntry> lookup(const EntryKey& key);

  // Data-plane version the sidecar announced in its hello (1: no context messages).
  [[nodiscard]] std::uint32_t server_version() const { return server_version_; }
  // Version 2. kNotFound on a miss (the message says why: medium tokens, nothing held, ...).
  [[nodiscard]] Result<ResolvedPrefix> resolve(const ResolveRequest& request);
  // The same, leaving the entry unmapped: a reader that copies it once into memory of its own
  // (pread on entry.fd) skips the mapping's page faults, ~1 ms per MiB on a VM.
  [[nodiscard]] Result<ResolvedPrefix> resolve_unmapped(const ResolveRequest& request);
  // Version 2: publish with the request's params, so the sidecar can push the KV ahead.
  [[nodiscard]] Status publish_with_context(const EntryKey& key, const KvLayout& layout,
                                            std::span<const std::byte> bytes, std::string_view params_json);
  [[nodiscard]] Status report_prefill(const PrefillReport& report);
  [[nodiscard]] Result<ServerStats> stats();
  [[nodiscard]] Result<std::vector<std::byte>> ping(std::span<const std::byte> payload);

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
  [[nodiscard]] Result<Reply> call(MessageType type, std::span<const std::byte> payload, MessageType expected_reply,
                                   std::size_t expected_fds, std::span<const int> fds = {});

  [[nodiscard]] Result<ReadOnlyEntry> map_entry(Reply& reply, ByteReader& reader, bool map = true);
  [[nodiscard]] Result<ResolvedPrefix> resolve_as(const ResolveRequest& request, bool map);
  [[nodiscard]] Status commit_as(MessageType type, WritableRegion region, const EntryKey& key, const KvLayout& layout,
                                 std::uint64_t checksum, std::string_view params_json);
  // A region of `size` bytes from the sidecar, not mapped here.
  [[nodiscard]] Result<WritableRegion> allocate_unmapped(std::uint64_t size);
  [[nodiscard]] Result<WritableRegion> copy_into_region(std::span<const std::byte> bytes, std::uint64_t& checksum);

  UniqueFd socket_;
  std::uint32_t next_request_ = 1;
  std::uint32_t server_version_ = 1;
  // Ring state (unique_ptr keeps the class movable; SpscRing points into ring_memory_).
  Mapping ring_memory_;
  std::optional<SpscRing> requests_;
  std::optional<SpscRing> responses_;
  UniqueFd wake_server_;
  UniqueFd wake_client_;
};

// xxh3_64, the checksum every commit carries.
[[nodiscard]] std::uint64_t checksum_bytes(std::span<const std::byte> bytes);

}  // namespace kvrelay::shm
