#include "kvrelay/shm_transport/client.h"

#include <fcntl.h>
#include <poll.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/un.h>
#include <unistd.h>

#include <climits>
#include <fmt/format.h>

#include <algorithm>
#include <cerrno>
#include <cstdint>
#include <cstring>
#include <memory>

#include "kvrelay/core/bulk_hash.h"
#include "kvrelay/core/byte_io.h"
#include "kvrelay/shm_transport/fd_passing.h"

namespace kvrelay::shm {

namespace {

constexpr std::uint32_t kClientProtocolVersion = kDataPlaneVersion;
// Busy-polls this many times for a ring answer before sleeping on the eventfd: a round trip
// is a few microseconds, a wake-up through the scheduler costs more.
constexpr int kRingSpins = 20000;

}  // namespace

std::uint64_t checksum_bytes(std::span<const std::byte> bytes) {
  return bulk_hash64(bytes.data(), bytes.size());
}

ArenaLease::~ArenaLease() {
  std::lock_guard lock(returns_->mutex);
  returns_->ids.push_back(id_);
}

Status ReadOnlyEntry::read(std::uint64_t offset, std::span<std::byte> out) const {
  if (offset > info.bytes || out.size() > info.bytes - offset) {
    return fail(ErrorCode::kOutOfRange,
                fmt::format("read of {} bytes at {} from a {}-byte entry", out.size(), offset, info.bytes));
  }
  if (arena) return kv_store::read_memfd(arena->fd.get(), arena_offset + offset, out);
  return kv_store::read_memfd(fd.get(), offset, out);
}

ShmClient::~ShmClient() = default;

Result<ShmClient> ShmClient::connect(const std::string& socket_path, std::uint32_t protocol_version,
                                     std::chrono::milliseconds reply_timeout) {
  ShmClientOptions options;
  options.protocol_version = protocol_version;
  options.reply_timeout = reply_timeout;
  return connect(socket_path, options);
}

Result<ShmClient> ShmClient::connect(const std::string& socket_path, const ShmClientOptions& options) {
  const std::uint32_t protocol_version = options.protocol_version;
  sockaddr_un address{};
  address.sun_family = AF_UNIX;
  if (socket_path.empty() || socket_path.size() >= sizeof(address.sun_path)) {
    return fail(ErrorCode::kInvalidArgument, "bad unix socket path");
  }
  std::memcpy(address.sun_path, socket_path.c_str(), socket_path.size() + 1);
  ShmClient client;
  client.socket_.reset(::socket(AF_UNIX, SOCK_SEQPACKET | SOCK_CLOEXEC, 0));
  if (!client.socket_) return fail(ErrorCode::kIo, fmt::format("socket: {}", std::strerror(errno)));
  const auto wait_us = std::max<std::int64_t>(1, std::chrono::microseconds(options.reply_timeout).count());
  timeval timeout{static_cast<time_t>(wait_us / 1'000'000), static_cast<suseconds_t>(wait_us % 1'000'000)};
  // A Unix connect waits on the send timeout while the sidecar's accept backlog is full: bound it
  // too, then let sends block as before.
  ::setsockopt(client.socket_.get(), SOL_SOCKET, SO_SNDTIMEO, &timeout, sizeof(timeout));
  if (::connect(client.socket_.get(), reinterpret_cast<const sockaddr*>(&address), sizeof(address)) != 0) {
    const int error = errno;
    return fail(error == EAGAIN ? ErrorCode::kTimeout : ErrorCode::kIo,
                fmt::format("connect {}: {}", socket_path, std::strerror(error)));
  }
  const timeval no_timeout{0, 0};
  ::setsockopt(client.socket_.get(), SOL_SOCKET, SO_SNDTIMEO, &no_timeout, sizeof(no_timeout));
  ::setsockopt(client.socket_.get(), SOL_SOCKET, SO_RCVTIMEO, &timeout, sizeof(timeout));
  client.reply_timeout_ = options.reply_timeout;
  if (protocol_version == 0 || protocol_version > kClientProtocolVersion) {
    return fail(ErrorCode::kInvalidArgument, fmt::format("data-plane version {} (this client speaks 1..{})",
                                                         protocol_version, kClientProtocolVersion));
  }
  client.use_arena_ = options.use_arena && protocol_version >= kArenaDataPlaneVersion;
  client.memory_strategy_ = options.memory_strategy;
  client.protocol_version_ = protocol_version;
  client.lease_returns_->connection.reset(::fcntl(client.socket_.get(), F_DUPFD_CLOEXEC, 0));
  if (!client.lease_returns_->connection) {
    return fail(ErrorCode::kResourceExhausted, fmt::format("dup: {}", std::strerror(errno)));
  }
  ByteWriter hello;
  hello.put(protocol_version);
  KVRELAY_TRY(auto reply, client.call(MessageType::kHello, hello.bytes(), MessageType::kHelloOk, 0));
  ByteReader reader(reply.frame.payload);
  if (const auto version = reader.get<std::uint32_t>()) client.server_version_ = *version;
  return client;
}

Result<ShmClient::Reply> ShmClient::call(MessageType type, std::span<const std::byte> payload,
                                         MessageType expected_reply, std::size_t expected_fds, std::span<const int> fds,
                                         std::optional<MessageType> alternate_reply, std::size_t optional_fds) {
  if (type != MessageType::kReleaseLeases && type != MessageType::kHello) {
    KVRELAY_TRY(release_leases());
  }
  KVRELAY_TRY(auto reply, exchange(type, payload, fds));
  if (reply.frame.type != expected_reply && reply.frame.type != alternate_reply.value_or(expected_reply)) {
    return fail(ErrorCode::kProtocol, "unexpected reply type");
  }
  if (reply.fds.size() < expected_fds || reply.fds.size() > expected_fds + optional_fds) {
    return fail(ErrorCode::kProtocol, "unexpected number of fds in reply");
  }
  return reply;
}

Result<ShmClient::Reply> ShmClient::exchange(MessageType type, std::span<const std::byte> payload,
                                             std::span<const int> fds) {
  if (!socket_) return fail(ErrorCode::kInvalidArgument, "client is not connected");
  if (timed_out_)
    return fail(ErrorCode::kIo, "an earlier reply timed out; this client takes no more calls (reconnect)");
  const std::uint32_t request_id = next_request_++;
  auto sent = send_message(socket_.get(), encode_frame(type, request_id, payload), fds);
  if (!sent) {
    // A sidecar that refuses us (uid policy) says why and hangs up before our request lands.
    pollfd readable{socket_.get(), POLLIN, 0};
    if (sent.error().code != ErrorCode::kIo || ::poll(&readable, 1, 0) != 1) return outcome::failure(sent.error());
  }
  auto receiving = receive_message(socket_.get());
  if (!receiving) {
    if (receiving.error().code == ErrorCode::kTimeout) timed_out_ = true;
    return outcome::failure(receiving.error());
  }
  auto received = std::move(receiving).value();
  if (received.closed) return fail(ErrorCode::kIo, "sidecar closed the connection");
  Reply reply;
  reply.storage = std::move(received.bytes);
  reply.fds = std::move(received.fds);
  KVRELAY_TRY(auto frame, decode_frame(reply.storage));
  reply.frame = frame;
  if (reply.frame.type == MessageType::kError) return outcome::failure(decode_error(reply.frame.payload));
  if (reply.frame.request_id != request_id) return fail(ErrorCode::kProtocol, "reply for another request");
  return reply;
}

Status ShmClient::release_leases() {
  if (!lease_returns_) return ok();
  std::vector<std::uint64_t> ids;
  {
    std::lock_guard lock(lease_returns_->mutex);
    ids.swap(lease_returns_->ids);
  }
  // Small batches keep each message far below the datagram limit.
  constexpr std::size_t kBatch = 4096;
  for (std::size_t first = 0; first < ids.size(); first += kBatch) {
    const std::size_t count = std::min(kBatch, ids.size() - first);
    ByteWriter request;
    request.put(static_cast<std::uint32_t>(count));
    for (std::size_t index = first; index < first + count; ++index)
      request.put(ids[index]);
    KVRELAY_TRY(call(MessageType::kReleaseLeases, request.bytes(), MessageType::kLeasesReleased, 0));
  }
  return ok();
}

Result<std::shared_ptr<const ClientArena>> ShmClient::adopt_arena(UniqueFd fd, std::uint64_t arena_bytes) {
  struct stat info {};
  if (::fstat(fd.get(), &info) != 0) return fail(ErrorCode::kInvalidArgument, "cannot stat the arena fd");
  if (arena_ && arena_->device == info.st_dev && arena_->inode == info.st_ino) return arena_;
  KVRELAY_TRY(kv_store::check_sealed_memfd(fd.get(), arena_bytes));
  auto arena = std::make_shared<ClientArena>();
  KVRELAY_TRY(arena->mapping, kv_store::Mapping::map(fd.get(), arena_bytes, true));
  arena->fd = std::move(fd);
  arena->device = info.st_dev;
  arena->inode = info.st_ino;
  // The arena owns its warmer and joins it before unmapping, so the thread holds no owner.
  arena->warmer.start(memory_strategy_, arena->mapping.bytes(), kv_store::PrefaultViews::kUser, nullptr,
                      "client arena");
  arena_ = arena;
  return arena_;
}

Result<WritableRegion> ShmClient::allocate_in_arena(std::uint64_t size) {
  ByteWriter request;
  request.put(size);
  KVRELAY_TRY(auto reply, call(MessageType::kAllocArenaRegion, request.bytes(), MessageType::kArenaRegion, 1));
  ByteReader reader(reply.frame.payload);
  const auto id = reader.get<std::uint64_t>();
  const auto granted = reader.get<std::uint64_t>();
  const auto offset = reader.get<std::uint64_t>();
  const auto arena_bytes = reader.get<std::uint64_t>();
  if (!arena_bytes || reader.remaining() != 0 || *granted != size || *offset > *arena_bytes ||
      size > *arena_bytes - *offset) {
    return fail(ErrorCode::kProtocol, "malformed arena region reply");
  }
  WritableRegion region;
  region.id = *id;
  region.size = size;
  region.arena_offset = *offset;
  KVRELAY_TRY(region.arena, adopt_arena(std::move(reply.fds[0]), *arena_bytes));
  return region;
}

Result<std::optional<WritableRegion>> ShmClient::try_arena_region(std::uint64_t size) {
  if (!use_arena_ || server_version_ < kArenaDataPlaneVersion) return std::optional<WritableRegion>{};
  auto in_arena = allocate_in_arena(size);
  if (in_arena) return std::optional<WritableRegion>(std::move(in_arena).value());
  // No arena, or no room in it: a region of our own still works, just slower.
  if (in_arena.error().code == ErrorCode::kUnsupported) {
    use_arena_ = false;
  } else if (in_arena.error().code != ErrorCode::kResourceExhausted) {
    return outcome::failure(in_arena.error());
  }
  return std::optional<WritableRegion>{};
}

Result<WritableRegion> ShmClient::allocate(std::uint64_t size) {
  KVRELAY_TRY(auto in_arena, try_arena_region(size));
  if (in_arena) return std::move(*in_arena);
  KVRELAY_TRY(auto region, allocate_unmapped(size));
  KVRELAY_TRY(auto mapping, kv_store::Mapping::map(region.fd.get(), size, true));
  region.mapping = std::move(mapping);
  return region;
}

Result<WritableRegion> ShmClient::allocate_unmapped(std::uint64_t size) {
  ByteWriter request;
  request.put(size);
  KVRELAY_TRY(auto reply, call(MessageType::kAllocRegion, request.bytes(), MessageType::kRegion, 1));
  ByteReader reader(reply.frame.payload);
  const auto id = reader.get<std::uint64_t>();
  const auto granted = reader.get<std::uint64_t>();
  if (!granted || *granted != size) return fail(ErrorCode::kProtocol, "malformed region reply");
  KVRELAY_TRY(kv_store::check_sealed_memfd(reply.fds[0].get(), size));
  WritableRegion region;
  region.id = *id;
  region.size = size;
  region.fd = std::move(reply.fds[0]);
  return region;
}

Result<WritableRegion> ShmClient::attach(UniqueFd memfd) {
  struct stat info {};
  if (::fstat(memfd.get(), &info) != 0) return fail(ErrorCode::kInvalidArgument, "cannot stat memfd");
  const auto size = static_cast<std::uint64_t>(info.st_size);
  ByteWriter request;
  request.put(size);
  const int fds[] = {memfd.get()};
  KVRELAY_TRY(auto reply, call(MessageType::kAttachRegion, request.bytes(), MessageType::kRegionAttached, 0, fds));
  ByteReader reader(reply.frame.payload);
  const auto id = reader.get<std::uint64_t>();
  if (!id) return fail(ErrorCode::kProtocol, "malformed attach reply");
  WritableRegion region;
  region.id = *id;
  region.size = size;
  region.fd = std::move(memfd);
  KVRELAY_TRY(auto mapping, kv_store::Mapping::map(region.fd.get(), size, true));
  region.mapping = std::move(mapping);
  return region;
}

Status ShmClient::commit(WritableRegion region, const kv_store::EntryKey& key, const KvLayout& layout,
                         std::uint64_t checksum) {
  return commit_as(MessageType::kCommit, std::move(region), key, layout, checksum, {}, Fidelity::exact(), nullptr);
}

Status ShmClient::lossy_unsupported() const {
  return fail(ErrorCode::kUnsupported,
              fmt::format("the sidecar speaks data-plane version {}, which cannot record lossy KV (version {} "
                          "can); not published, so it is not mistaken for exact KV",
                          server_version_, kFidelityDataPlaneVersion));
}

Status ShmClient::commit_as(MessageType type, WritableRegion region, const kv_store::EntryKey& key,
                            const KvLayout& layout, std::uint64_t checksum, std::string_view params_json,
                            const Fidelity& fidelity, const kv_store::EntryChain* chain) {
  const bool with_context = type == MessageType::kCommitContext;
  const std::uint64_t size = region.size;
  region.mapping.reset();  // a writable mapping would block the sidecar's F_SEAL_WRITE
  CommitRequest commit{region.id, key, layout, size, checksum, std::string(params_json), fidelity, std::nullopt};
  // An older sidecar files the entry without token ids (it never sends KV to a peer over them).
  UniqueFd tokens;
  const std::uint32_t version = std::min(server_version_, protocol_version_);
  if (with_context && chain != nullptr && version >= kChainDataPlaneVersion) {
    if (chain->tokens.size() > kv_store::kMaxChainTokens) {
      return fail(ErrorCode::kResourceExhausted,
                  fmt::format("chain of {} token ids (at most {})", chain->tokens.size(), kv_store::kMaxChainTokens));
    }
    KVRELAY_TRY(tokens, chain_tokens_memfd(chain->tokens));
    commit.chain = ChainHeader::of(*chain);
  }
  const auto request = encode_commit(commit, with_context, version);
  const int fds[] = {tokens.get()};
  KVRELAY_TRY(call(type, request, with_context ? MessageType::kContextCommitted : MessageType::kCommitted, 0,
                   tokens ? std::span<const int>(fds) : std::span<const int>()));
  return ok();
}

Status ShmClient::abort(WritableRegion region) {
  region.mapping.reset();
  ByteWriter request;
  request.put(region.id);
  KVRELAY_TRY(call(MessageType::kAbort, request.bytes(), MessageType::kAborted, 0));
  return ok();
}

Status ShmClient::publish(const kv_store::EntryKey& key, const KvLayout& layout, std::span<const std::byte> bytes) {
  std::uint64_t checksum = 0;
  KVRELAY_TRY(auto region, copy_into_region(bytes, checksum));
  return commit(std::move(region), key, layout, checksum);
}

Status ShmClient::publish_with_context(const kv_store::EntryKey& key, const KvLayout& layout,
                                       std::span<const std::byte> bytes, std::string_view params_json,
                                       const Fidelity& fidelity, const kv_store::EntryChain* chain) {
  if (!fidelity.is_exact() && server_version_ < kFidelityDataPlaneVersion) return lossy_unsupported();
  if (server_version_ < 2) return publish(key, layout, bytes);
  std::uint64_t checksum = 0;
  KVRELAY_TRY(auto region, copy_into_region(bytes, checksum));
  return commit_as(MessageType::kCommitContext, std::move(region), key, layout, checksum, params_json, fidelity, chain);
}

namespace {

// Progress reports go out every this many bytes of an arena region, for regions of at least two.
constexpr std::size_t kProgressBytes = 4U << 20;

}  // namespace

void ShmClient::report_progress(std::uint64_t region_id, std::uint64_t written) {
  ByteWriter progress;
  progress.put(region_id).put(written);
  // One-way; if it cannot be sent the commit still checks everything.
  (void)send_message(socket_.get(), encode_frame(MessageType::kRegionProgress, next_request_++, progress.bytes()));
}

std::uint64_t ShmClient::checksum_written(const WritableRegion& region) {
  const auto bytes = region.bytes();
  if (!region.in_arena() || bytes.size() < 2 * kProgressBytes) return checksum_bytes(bytes);
  BulkHashStream hash;
  if (!hash.valid()) return checksum_bytes(bytes);
  for (std::size_t offset = 0; offset < bytes.size(); offset += kProgressBytes) {
    const std::size_t take = std::min(kProgressBytes, bytes.size() - offset);
    hash.update(bytes.data() + offset, take);
    if (offset + take < bytes.size()) report_progress(region.id, offset + take);
  }
  return hash.digest();
}

Status ShmClient::commit_written(WritableRegion region, const kv_store::EntryKey& key, const KvLayout& layout) {
  const std::uint64_t checksum = checksum_written(region);
  return commit(std::move(region), key, layout, checksum);
}

Status ShmClient::commit_written_with_context(WritableRegion region, const kv_store::EntryKey& key,
                                              const KvLayout& layout, std::string_view params_json,
                                              const Fidelity& fidelity, const kv_store::EntryChain* chain) {
  if (!fidelity.is_exact() && server_version_ < kFidelityDataPlaneVersion) {
    (void)abort(std::move(region));
    return lossy_unsupported();
  }
  const std::uint64_t checksum = checksum_written(region);
  if (server_version_ < 2) return commit(std::move(region), key, layout, checksum);
  return commit_as(MessageType::kCommitContext, std::move(region), key, layout, checksum, params_json, fidelity, chain);
}

Result<WritableRegion> ShmClient::copy_into_region(std::span<const std::byte> bytes, std::uint64_t& checksum) {
  KVRELAY_TRY(auto arena_region, try_arena_region(bytes.size()));
  BulkHashStream hash;
  if (!hash.valid()) return fail(ErrorCode::kResourceExhausted, "cannot allocate a hash state");
  // Cache-sized pieces: progress reports go out between them, and the sealed-segment path hashes
  // each one while it is hot before the kernel copies it.
  constexpr std::size_t kPiece = 256 * 1024;
  if (arena_region) {
    // Every few MiB the sidecar hears how far the copy got and verifies that much on its own
    // thread while this one copies on, so the commit is left with only the tail to check.
    const bool progress = bytes.size() >= 2 * kProgressBytes;
    const auto destination = arena_region->bytes();
    for (std::size_t offset = 0; offset < bytes.size(); offset += kPiece) {
      const auto piece = bytes.subspan(offset, std::min(kPiece, bytes.size() - offset));
      // One pass: each 64-byte stripe is copied with ordinary stores (so the lines stay in the
      // shared cache for the sidecar's verifier) and hashed right after from L1
      // (bench/results/transports-notes.md, "Fused copy and hash").
      hash.update_copy(destination.data() + offset, piece.data(), piece.size());
      const std::size_t written = offset + piece.size();
      if (progress && written % kProgressBytes == 0 && written < bytes.size())
        report_progress(arena_region->id, written);
    }
    checksum = hash.digest();
    return std::move(*arena_region);
  }
  KVRELAY_TRY(auto region, allocate_unmapped(bytes.size()));
  // The kernel writes into a fresh segment through its own mapping: no mapping here, no faults.
  for (std::size_t offset = 0; offset < bytes.size(); offset += kPiece) {
    const auto piece = bytes.subspan(offset, std::min(kPiece, bytes.size() - offset));
    hash.update(piece.data(), piece.size());
    KVRELAY_TRY(kv_store::write_memfd(region.fd.get(), offset, piece));
  }
  checksum = hash.digest();
  return region;
}

Result<ReadOnlyEntry> ShmClient::lookup(const kv_store::EntryKey& key) {
  ByteWriter request;
  kv_store::encode_key(request, key);
  // A second fd: the chain's token ids, in a version-5 reply to a same-host peer.
  KVRELAY_TRY(auto reply,
              call(MessageType::kLookup, request.bytes(), MessageType::kEntry, 1, {}, MessageType::kArenaEntry, 1));
  ByteReader reader(reply.frame.payload);
  KVRELAY_TRY(auto entry, map_entry(reply, reader));
  std::uint8_t has_chain = 0;
  if (std::min(server_version_, protocol_version_) >= kChainDataPlaneVersion) {
    const auto flag = reader.get<std::uint8_t>();
    if (!flag || *flag > 1) return fail(ErrorCode::kProtocol, "malformed entry reply: chain flag");
    has_chain = *flag;
  }
  if (reply.fds.size() != 1U + has_chain) return fail(ErrorCode::kProtocol, "unexpected number of fds in reply");
  if (has_chain != 0) {
    auto header = decode_chain_header(reader, std::min(server_version_, protocol_version_));
    if (!header) return fail(header.error().code, fmt::format("entry reply: {}", header.error().message));
    KVRELAY_TRY(entry.chain, read_chain(header.value(), reply.fds[1].get()));
  }
  if (reader.remaining() != 0) return fail(ErrorCode::kProtocol, "malformed entry reply");
  return entry;
}

Result<ResolvedPrefix> ShmClient::resolve(const ResolveRequest& request) {
  return resolve_as(request, true);
}

Result<ResolvedPrefix> ShmClient::resolve_unmapped(const ResolveRequest& request) {
  return resolve_as(request, false);
}

Result<ResolvedMeta> ShmClient::read_meta(ByteReader& reader, bool with_fidelity) const {
  const auto blocks = reader.get<std::uint32_t>();
  auto medium = reader.get_string();
  if (!blocks || !medium) return fail(ErrorCode::kProtocol, "malformed resolved reply");
  ResolvedMeta meta;
  meta.blocks = *blocks;
  meta.medium = std::move(*medium);
  if (with_fidelity) {  // an older sidecar serves exact KV, or cannot tell
    auto decoded = decode_fidelity(reader);
    if (!decoded) return fail(ErrorCode::kProtocol, fmt::format("resolved reply: {}", decoded.error().message));
    meta.fidelity = std::move(decoded).value();
  }
  if (std::min(server_version_, protocol_version_) >= kSpanDataPlaneVersion) {
    KVRELAY_TRY(decode_resolved_span(reader, meta));
  }
  if (reader.remaining() != 0) return fail(ErrorCode::kProtocol, "malformed resolved reply");
  return meta;
}

Result<ResolvedPrefix> ShmClient::resolved_reply(Reply& reply, bool map) {
  ByteReader reader(reply.frame.payload);
  KVRELAY_TRY(auto entry, map_entry(reply, reader, map));
  const bool with_fidelity =
      server_version_ >= kFidelityDataPlaneVersion && protocol_version_ >= kFidelityDataPlaneVersion;
  KVRELAY_TRY(auto meta, read_meta(reader, with_fidelity));
  return ResolvedPrefix{std::move(entry), std::move(meta)};
}

Result<ResolvedPrefix> ShmClient::resolve_as(const ResolveRequest& request, bool map) {
  if (server_version_ < 2) return fail(ErrorCode::kUnsupported, "the sidecar speaks data-plane version 1 (no resolve)");
  ResolveRequest asked = request;
  asked.flags &= ~kResolveReserve;  // reserve() is the call that reserves
  const std::uint32_t version = std::min(server_version_, protocol_version_);
  KVRELAY_TRY(auto reply, call(MessageType::kResolve, encode_resolve(asked, version), MessageType::kResolved, 1, {},
                               MessageType::kArenaResolved));
  KVRELAY_TRY(auto resolved, resolved_reply(reply, map));
  if (std::uint64_t{resolved.meta.first_block} + resolved.meta.blocks > request.block_hashes.size()) {
    return fail(
        ErrorCode::kProtocol,
        fmt::format("resolved blocks {}..{} of a {}-block prompt", resolved.meta.first_block,
                    std::uint64_t{resolved.meta.first_block} + resolved.meta.blocks, request.block_hashes.size()));
  }
  return resolved;
}

Result<Reservation> ShmClient::reserve(const ResolveRequest& request) {
  const std::uint32_t version = std::min(server_version_, protocol_version_);
  if (version < kReservationDataPlaneVersion) {
    return fail(ErrorCode::kUnsupported,
                fmt::format("reservations need data-plane version {}; this connection speaks {}",
                            kReservationDataPlaneVersion, version));
  }
  ResolveRequest asked = request;
  asked.flags |= kResolveReserve;
  KVRELAY_TRY(auto reply, call(MessageType::kResolve, encode_resolve(asked, version), MessageType::kReserved, 0));
  ByteReader reader(reply.frame.payload);
  const auto id = reader.get<std::uint64_t>();
  if (!id || *id == 0) return fail(ErrorCode::kProtocol, "malformed reserved reply");
  KVRELAY_TRY(auto meta, read_meta(reader, true));
  if (std::uint64_t{meta.first_block} + meta.blocks > request.block_hashes.size()) {
    return fail(ErrorCode::kProtocol,
                fmt::format("reserved blocks {}..{} of a {}-block prompt", meta.first_block,
                            std::uint64_t{meta.first_block} + meta.blocks, request.block_hashes.size()));
  }
  return Reservation{std::move(meta), *id};
}

Result<ResolvedPrefix> ShmClient::claim(std::uint64_t reservation, bool map) {
  const std::uint32_t version = std::min(server_version_, protocol_version_);
  if (version < kReservationDataPlaneVersion) return fail(ErrorCode::kUnsupported, "no reservations before version 6");
  ByteWriter request;
  request.put(reservation);
  KVRELAY_TRY(auto reply,
              call(MessageType::kClaim, request.bytes(), MessageType::kResolved, 1, {}, MessageType::kArenaResolved));
  return resolved_reply(reply, map);
}

Status ShmClient::release_reservation(std::uint64_t reservation) {
  const std::uint32_t version = std::min(server_version_, protocol_version_);
  if (version < kReservationDataPlaneVersion) return fail(ErrorCode::kUnsupported, "no reservations before version 6");
  ByteWriter request;
  request.put(reservation);
  KVRELAY_TRY(call(MessageType::kRelease, request.bytes(), MessageType::kReleased, 0));
  return ok();
}

void ShmClient::set_reply_timeout(std::chrono::milliseconds timeout) {
  const auto wait_us = std::max<std::int64_t>(1, std::chrono::microseconds(timeout).count());
  timeval value{static_cast<time_t>(wait_us / 1'000'000), static_cast<suseconds_t>(wait_us % 1'000'000)};
  ::setsockopt(socket_.get(), SOL_SOCKET, SO_RCVTIMEO, &value, sizeof(value));
  reply_timeout_ = timeout;
}

Status ShmClient::report_prefill(const PrefillReport& report) {
  if (server_version_ < 2) return ok();  // a version-1 sidecar has no cost model to feed
  KVRELAY_TRY(call(MessageType::kPrefillReport, encode_prefill_report(report), MessageType::kPrefillNoted, 0));
  return ok();
}

Result<ReadOnlyEntry> ShmClient::map_entry(Reply& reply, ByteReader& reader, bool map) {
  KVRELAY_TRY(const auto layout, kv_store::decode_layout(reader));
  const auto bytes = reader.get<std::uint64_t>();
  const auto checksum = reader.get<std::uint64_t>();
  if (!checksum) return fail(ErrorCode::kProtocol, "malformed entry reply");
  ReadOnlyEntry entry;
  entry.info = kv_store::EntryInfo{layout, *bytes, *checksum};
  KVRELAY_TRY(kv_store::validate_entry_info(entry.info));
  if (reply.frame.type == MessageType::kArenaEntry || reply.frame.type == MessageType::kArenaResolved) {
    const auto offset = reader.get<std::uint64_t>();
    const auto lease = reader.get<std::uint64_t>();
    const auto arena_bytes = reader.get<std::uint64_t>();
    if (!arena_bytes || *offset > *arena_bytes || entry.info.bytes > *arena_bytes - *offset) {
      return fail(ErrorCode::kProtocol, "malformed arena entry reply");
    }
    // Owned from here, so an entry this client cannot use still goes back to the sidecar.
    entry.lease = std::make_shared<ArenaLease>(lease_returns_, *lease);
    KVRELAY_TRY(entry.arena, adopt_arena(std::move(reply.fds[0]), *arena_bytes));
    entry.arena_offset = *offset;
    return entry;
  }
  KVRELAY_TRY(kv_store::check_sealed_memfd(reply.fds[0].get(), 0));
  KVRELAY_TRY(const unsigned seals, kv_store::get_seals(reply.fds[0].get()));
  if ((seals & 0x0008U) == 0) return fail(ErrorCode::kPermissionDenied, "entry memfd is not sealed against writes");
  entry.fd = std::move(reply.fds[0]);
  struct stat info {};
  if (::fstat(entry.fd.get(), &info) != 0 || static_cast<std::uint64_t>(info.st_size) != entry.info.bytes) {
    return fail(ErrorCode::kCorrupt, "entry memfd size differs from its metadata");
  }
  if (!map) return entry;
  KVRELAY_TRY(auto mapping, kv_store::Mapping::map(entry.fd.get(), entry.info.bytes, false));
  entry.mapping = std::move(mapping);
  return entry;
}

Result<ServerStats> ShmClient::stats() {
  KVRELAY_TRY(auto reply, call(MessageType::kStats, {}, MessageType::kStatsReply, 0));
  return decode_stats(reply.frame.payload);
}

Result<std::vector<std::byte>> ShmClient::ping(std::span<const std::byte> payload) {
  KVRELAY_TRY(auto reply, call(MessageType::kPing, payload, MessageType::kPong, 0));
  return std::vector<std::byte>(reply.frame.payload.begin(), reply.frame.payload.end());
}

Status ShmClient::open_ring() {
  if (requests_) return ok();
  KVRELAY_TRY(auto reply, call(MessageType::kOpenRing, {}, MessageType::kRingOpened, 3));
  ByteReader reader(reply.frame.payload);
  const auto slots = reader.get<std::uint32_t>();
  const auto slot_bytes = reader.get<std::uint32_t>();
  if (!slot_bytes || reader.remaining() != 0) return fail(ErrorCode::kProtocol, "malformed ring reply");
  const RingGeometry geometry{*slots, *slot_bytes};
  KVRELAY_TRY(geometry.validate());
  KVRELAY_TRY(kv_store::check_sealed_memfd(reply.fds[0].get(), 2 * geometry.ring_bytes()));
  KVRELAY_TRY(auto mapping, kv_store::Mapping::map(reply.fds[0].get(), 2 * geometry.ring_bytes(), true));
  ring_memory_ = std::move(mapping);
  requests_.emplace(ring_memory_.data(), geometry);
  responses_.emplace(ring_memory_.data() + geometry.ring_bytes(), geometry);
  KVRELAY_TRY(requests_->check_header());
  KVRELAY_TRY(responses_->check_header());
  wake_server_ = std::move(reply.fds[1]);
  wake_client_ = std::move(reply.fds[2]);
  return ok();
}

Result<std::size_t> ShmClient::ring_call(std::span<const std::byte> message, std::span<std::byte> answer) {
  if (timed_out_)
    return fail(ErrorCode::kIo, "an earlier reply timed out; this client takes no more calls (reconnect)");
  KVRELAY_TRY(open_ring());
  KVRELAY_TRY(const bool pushed, requests_->push(message));
  if (!pushed) return fail(ErrorCode::kResourceExhausted, "request ring full");
  const std::uint64_t one = 1;
  if (::write(wake_server_.get(), &one, sizeof(one)) != sizeof(one)) return fail(ErrorCode::kIo, "eventfd write");
  for (int spin = 0;; ++spin) {
    KVRELAY_TRY(const auto popped, responses_->pop(answer));
    if (popped) {
      if (spin >= kRingSpins) {
        std::uint64_t drained = 0;  // consume the wake-up we were waiting on, if it is there
        pollfd ready{wake_client_.get(), POLLIN, 0};
        if (::poll(&ready, 1, 0) == 1) (void)::read(wake_client_.get(), &drained, sizeof(drained));
      }
      return *popped;
    }
    if (spin >= kRingSpins) {
      pollfd waits[2] = {{wake_client_.get(), POLLIN, 0}, {socket_.get(), POLLIN, 0}};
      const int ready =
          ::poll(waits, 2, static_cast<int>(std::clamp<std::int64_t>(reply_timeout_.count(), 1, INT_MAX)));
      if (ready == 0) {
        timed_out_ = true;  // a late answer would be taken for the next call's
        return fail(ErrorCode::kTimeout, "no ring answer");
      }
      if ((waits[1].revents & (POLLHUP | POLLIN)) != 0 && (waits[0].revents & POLLIN) == 0) {
        return fail(ErrorCode::kIo, "sidecar closed the connection");
      }
      std::uint64_t drained = 0;
      (void)::read(wake_client_.get(), &drained, sizeof(drained));
    }
  }
}

}  // namespace kvrelay::shm
