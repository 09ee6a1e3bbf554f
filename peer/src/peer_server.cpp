#include "kvrelay/peer/peer_server.h"

// GCC 12 reports a false -Wmismatched-new-delete for Asio's coroutine frame allocator
// (awaitable_frame_base has matching class-level new/delete).
#pragma GCC diagnostic ignored "-Wmismatched-new-delete"

#include <boost/asio/co_spawn.hpp>
#include <boost/asio/detached.hpp>
#include <boost/asio/post.hpp>
#include <boost/asio/strand.hpp>
#include <fmt/format.h>
#include <spdlog/spdlog.h>

#include <algorithm>
#include <deque>
#include <mutex>
#include <optional>
#include <set>
#include <unordered_set>
#include <vector>

#include "kvrelay/codec_plugins/frame.h"
#include "kvrelay/core/bulk_hash.h"
#include "kvrelay/core/kv_tokens.h"
#include "kvrelay/core/byte_io.h"
#include "kvrelay/kv_store/memfd.h"

#include "kvrelay/peer/fetch_encoding.h"
#include "peer_io.h"

namespace kvrelay::peer {

using namespace detail;

struct PeerServer::Shared {
  static constexpr std::size_t kWarmBuffers = 4;
  Shared(PeerServerOptions server_options, std::shared_ptr<kv_store::EntryStore> entry_store)
      : options(std::move(server_options)),
        store(std::move(entry_store)),
        buffers(kWarmBuffers, options.warm_buffer_bytes) {}
  const PeerServerOptions options;
  const std::shared_ptr<kv_store::EntryStore> store;
  WarmBufferPool buffers;  // fetches' read and encode buffers, pushed frames
  std::unique_ptr<tcp::acceptor> acceptor;

  mutable std::mutex mutex;
  PeerServerStats counters;
  std::unordered_set<std::uint64_t> active;
  std::unordered_set<std::uint64_t> committed;
  std::deque<std::uint64_t> committed_order;
  std::set<std::weak_ptr<PeerConnection>, std::owner_less<>> sessions;
  bool stopped = false;
  // Receive buffers kept between transfers: their pages are faulted in once and stay mapped,
  // so a steady stream of transfers pays no first-touch faults (a page fault per 4 KiB costs
  // ~4 ms/MiB on hosts with lazily built page tables). Bounded: kSpareReceiveBuffers buffers of
  // one chunk each (at most kMaxChunkBytes), i.e. 4 MiB at the default chunk size.
  static constexpr std::size_t kSpareReceiveBuffers = 4;
  std::vector<std::vector<std::byte>> spare_receive_buffers;

  void remember_committed(std::uint64_t transfer_id) {
    committed.insert(transfer_id);
    committed_order.push_back(transfer_id);
    while (committed_order.size() > options.remembered_transfers) {
      committed.erase(committed_order.front());
      committed_order.pop_front();
    }
  }
};

namespace {

using SharedPtr = std::shared_ptr<PeerServer::Shared>;

// Claims a transfer id for one session; released on every exit path.
class ActiveTransfer {
 public:
  ActiveTransfer(SharedPtr shared, std::uint64_t id) : shared_(std::move(shared)), id_(id) {}
  ~ActiveTransfer() {
    std::lock_guard lock(shared_->mutex);
    shared_->active.erase(id_);
    --shared_->counters.active_transfers;
    if (!committed_) ++shared_->counters.failed_transfers;
  }
  ActiveTransfer(const ActiveTransfer&) = delete;
  ActiveTransfer& operator=(const ActiveTransfer&) = delete;
  void mark_committed() { committed_ = true; }

 private:
  SharedPtr shared_;
  std::uint64_t id_;
  bool committed_ = false;
};

// A chunk-sized receive buffer for one transfer, taken from and returned to the spares.
class ReceiveBuffer {
 public:
  ReceiveBuffer(SharedPtr shared, std::size_t bytes) : shared_(std::move(shared)) {
    {
      std::lock_guard lock(shared_->mutex);
      auto& spares = shared_->spare_receive_buffers;
      if (!spares.empty()) {
        buffer_ = std::move(spares.back());
        spares.pop_back();
      }
    }
    if (buffer_.size() < bytes) buffer_.resize(bytes);
  }
  ~ReceiveBuffer() {
    std::lock_guard lock(shared_->mutex);
    if (shared_->spare_receive_buffers.size() < PeerServer::Shared::kSpareReceiveBuffers) {
      shared_->spare_receive_buffers.push_back(std::move(buffer_));
    }
  }
  ReceiveBuffer(const ReceiveBuffer&) = delete;
  ReceiveBuffer& operator=(const ReceiveBuffer&) = delete;
  [[nodiscard]] std::byte* data() { return buffer_.data(); }

 private:
  SharedPtr shared_;
  std::vector<std::byte> buffer_;
};

asio::awaitable<Status> send_frame(PeerConnection& connection, const std::vector<std::byte>& frame,
                                   std::chrono::milliseconds timeout) {
  co_return co_await write_all(connection, asio::buffer(frame), asio::const_buffer{}, timeout);
}

// Reads and drops the chunks a sender wrote right after its Begin (Begin::eager_chunks) when
// this receiver will not take the transfer, so that what it reads next is the sender's next
// message and the sender's writes do not fail before it can read the answer.
asio::awaitable<Status> drop_eager_chunks(PeerConnection& connection, const Begin& begin,
                                          std::chrono::milliseconds timeout) {
  if (begin.eager_chunks == 0) co_return ok();
  std::vector<std::byte> sink(std::min<std::size_t>(64 * 1024, kChunkHeaderBytes + begin.chunk_bytes));
  for (std::uint32_t index = 0; index < begin.eager_chunks; ++index) {
    auto frame = co_await read_frame(connection, timeout, timeout);
    if (!frame) co_return outcome::failure(frame.error());
    if (frame.value().header.type != PeerMessage::kChunk) {
      co_return fail(ErrorCode::kProtocol,
                     fmt::format("expected eager chunk {} of transfer {}", index, begin.transfer_id));
    }
    std::uint64_t left = frame.value().header.length;
    if (left > kChunkHeaderBytes + std::uint64_t{begin.chunk_bytes}) {
      co_return fail(ErrorCode::kProtocol, fmt::format("eager chunk {} has {} bytes", index, left));
    }
    while (left > 0) {
      const auto take = static_cast<std::size_t>(std::min<std::uint64_t>(left, sink.size()));
      if (auto got = co_await read_exact(connection, asio::buffer(sink.data(), take), timeout); !got) co_return got;
      left -= take;
    }
  }
  co_return ok();
}

// Receives the chunks of one transfer into a fresh sealed memfd and publishes it.
asio::awaitable<Status> receive_transfer(const SharedPtr& shared, PeerConnection& connection, const Begin& begin,
                                         bool cumulative_acks) {
  const auto& options = shared->options;
  std::optional<Error> refusal;
  if (begin.info.bytes > options.max_entry_bytes) {
    refusal = Error{ErrorCode::kResourceExhausted, fmt::format("transfer of {} bytes exceeds the limit {}",
                                                               begin.info.bytes, options.max_entry_bytes)};
  }
  std::unique_ptr<ActiveTransfer> claim;
  if (!refusal) {
    std::lock_guard lock(shared->mutex);
    if (shared->committed.contains(begin.transfer_id)) {
      ++shared->counters.duplicate_transfers;
      claim = nullptr;
    } else if (shared->active.contains(begin.transfer_id)) {
      refusal = Error{ErrorCode::kAlreadyExists, fmt::format("transfer {} is in progress", begin.transfer_id)};
    } else {
      shared->active.insert(begin.transfer_id);
      ++shared->counters.active_transfers;
      claim = std::make_unique<ActiveTransfer>(shared, begin.transfer_id);
    }
  }
  ByteWriter reply;
  reply.put(begin.transfer_id)
      .put(static_cast<std::uint8_t>(claim ? BeginState::kProceed : BeginState::kAlreadyCommitted));
  const auto begin_ok = encode_peer_frame(PeerMessage::kBeginOk, reply.bytes());
  if (!claim) {
    if (auto dropped = co_await drop_eager_chunks(connection, begin, options.read_timeout); !dropped) co_return dropped;
    if (refusal) co_return outcome::failure(std::move(*refusal));
    co_return co_await send_frame(connection, begin_ok, options.read_timeout);
  }

  // With an arena, chunks go into the entry's block: memory that stays mapped, so no page
  // faults of a new mapping; a failed transfer just frees the block. Staged (the default), each
  // lands in a reused buffer and the checksum pass copies it into the block. Without an arena
  // (or when it is full) each chunk lands in that buffer, is checked while it is in cache and
  // goes into a new segment with one kernel copy: receiving into a mapping of the new segment
  // would pay a first-touch fault per 4 KiB, which costs far more.
  std::shared_ptr<kv_store::ArenaBlock> block;
  if (options.arena) {
    if (auto allocated = options.arena->allocate(begin.info.bytes)) block = std::move(allocated).value();
  }
  UniqueFd memfd;
  std::optional<ReceiveBuffer> buffer;
  if (!block) {
    auto created = kv_store::create_sealed_memfd_to_fill("kvrelay-peer", begin.info.bytes);
    if (!created) co_return outcome::failure(created.error());
    memfd = std::move(created).value();
  }
  if (!block || options.stage_arena_chunks) {
    buffer.emplace(shared, static_cast<std::size_t>(std::min<std::uint64_t>(begin.chunk_bytes, begin.info.bytes)));
  }
  if (auto sent = co_await send_frame(connection, begin_ok, options.read_timeout); !sent) co_return sent;

  BulkHashStream total;
  if (!total.valid()) co_return fail(ErrorCode::kResourceExhausted, "XXH3_createState");
  const std::uint64_t chunks = begin.chunk_count();
  std::array<std::byte, kChunkHeaderBytes> chunk_header_bytes{};
  std::vector<std::byte> last_ack_frame;
  // A sender that takes cumulative acks hears from us every half window (its eager chunks are its
  // window, or the whole transfer when that is smaller), so it never stalls on a full window.
  const std::uint64_t ack_every =
      cumulative_acks && begin.eager_chunks >= 2 ? std::uint64_t{begin.eager_chunks} / 2 : 1;
  for (std::uint64_t index = 0; index < chunks; ++index) {
    auto frame = co_await read_frame(connection, options.read_timeout, options.read_timeout);
    if (!frame) co_return outcome::failure(frame.error());
    if (frame.value().header.type == PeerMessage::kError) {
      co_return outcome::failure(decode_peer_error(frame.value().payload));
    }
    if (frame.value().header.type != PeerMessage::kChunk) co_return fail(ErrorCode::kProtocol, "expected a chunk");
    const std::uint64_t offset = index * begin.chunk_bytes;
    const std::uint64_t expected = std::min<std::uint64_t>(begin.chunk_bytes, begin.info.bytes - offset);
    if (frame.value().header.length != kChunkHeaderBytes + expected) {
      co_return fail(ErrorCode::kProtocol, fmt::format("chunk {} has {} bytes, expected {}", index,
                                                       frame.value().header.length - kChunkHeaderBytes, expected));
    }
    const auto length = static_cast<std::size_t>(expected);
    std::byte* landing = buffer ? buffer->data() : block->bytes().data() + offset;
    if (auto got = co_await read_exact(connection, asio::buffer(chunk_header_bytes), asio::buffer(landing, length),
                                       options.read_timeout);
        !got) {
      co_return got;
    }
    const auto chunk = decode_chunk_header(chunk_header_bytes);
    if (chunk.transfer_id != begin.transfer_id || chunk.index != index) {
      co_return fail(ErrorCode::kProtocol,
                     fmt::format("chunk {} of transfer {} out of order", chunk.index, chunk.transfer_id));
    }
    std::byte* staged_to = block && buffer ? block->bytes().data() + offset : nullptr;
    const std::span<const std::byte> received(landing, length);
    const std::uint64_t actual = begin.running_checksums ? running_checksum(total, received, staged_to)
                                                         : checksum_chunk_into(total, received, staged_to);
    if (actual != chunk.checksum) {
      co_return fail(ErrorCode::kChecksumMismatch,
                     fmt::format("chunk {} checksum 0x{:016x} != 0x{:016x}", index, actual, chunk.checksum));
    }
    if (!block) {
      if (auto written = kv_store::write_memfd(memfd.get(), offset, std::span<const std::byte>(landing, length)); !written) {
        co_return written;
      }
    }
    {
      std::lock_guard lock(shared->mutex);
      shared->counters.bytes_received += expected;
      ++shared->counters.chunks_received;
    }
    const bool last = index + 1 == chunks;
    if (!last && (index + 1) % ack_every != 0) continue;
    ByteWriter ack;
    ack.put(begin.transfer_id).put(static_cast<std::uint32_t>(index));
    auto ack_frame = encode_peer_frame(PeerMessage::kChunkAck, ack.bytes());
    // The last chunk's acknowledgement goes out with Committed, in one write: sent alone it
    // woke the sender, which then slept again until Committed came a moment later.
    if (last) {
      last_ack_frame = std::move(ack_frame);
      break;
    }
    if (auto sent = co_await send_frame(connection, ack_frame, options.read_timeout); !sent) co_return sent;
  }
  const std::uint64_t digest = total.digest();
  // Running checksums need no second check: the last chunk's, already checked, is the entry's.
  if (!begin.running_checksums && digest != begin.info.checksum) {
    co_return fail(ErrorCode::kChecksumMismatch,
                   fmt::format("entry checksum 0x{:016x} != announced 0x{:016x}", digest, begin.info.checksum));
  }
  if (!block) {
    if (auto sealed = kv_store::seal_contents(memfd.get()); !sealed) co_return sealed;
  }
  auto entry = std::make_shared<kv_store::StoredEntry>();
  entry->info = begin.info;
  entry->info.checksum = digest;
  entry->fd = std::move(memfd);
  entry->block = std::move(block);
  {
    // Publish and remember the id under one lock, so a concurrent retry sees one or the other.
    std::lock_guard lock(shared->mutex);
    if (auto put = shared->store->put(begin.key, std::move(entry)); !put) co_return put;
    shared->remember_committed(begin.transfer_id);
    ++shared->counters.committed_transfers;
    claim->mark_committed();
  }
  ByteWriter done;
  done.put(begin.transfer_id);
  const auto committed_frame = encode_peer_frame(PeerMessage::kCommitted, done.bytes());
  co_return co_await write_all(connection, asio::buffer(last_ack_frame), asio::buffer(committed_frame),
                               options.read_timeout);
}

// Answers a Fetch with the longest prefix of the chain this node holds, encoded with the
// requested codec, or "not found".
asio::awaitable<Status> serve_fetch(const SharedPtr& shared, PeerConnection& connection, const FetchRequest& request) {
  const auto& options = shared->options;
  if (!options.codecs) co_return fail(ErrorCode::kUnsupported, "this sidecar has no codecs for fetches");
  auto spec = codec::resolve_codec(*options.codecs, request.codec);
  if (!spec) co_return outcome::failure(spec.error());
  std::shared_ptr<const kv_store::StoredEntry> entry;
  kv_store::EntryKey key;
  for (const std::uint64_t hash : request.hashes) {
    key = kv_store::EntryKey{request.model_id, hash};
    // A lossless fetch is served exact KV only: the asker files it as exact.
    entry = spec.value().codec->lossless() ? shared->store->get_exact(key) : shared->store->get(key);
    if (entry && entry->info.layout.layers != 0) break;
    entry = nullptr;
  }
  // A held prefix that adds nothing to what the asker has is a miss, like no prefix at all.
  if (!entry || entry->info.layout.tokens <= request.skip_tokens) {
    const auto miss = encode_fetch_reply(request.request_id, nullptr);
    co_return co_await send_frame(connection, miss, options.read_timeout);
  }
  // Read through the kernel into a warm buffer and encoded into another: mapping the entry, or
  // encoding into a fresh buffer, paid a first touch per 4 KiB page on every fetch, several
  // times the cost of the copies on hosts with lazily built page tables.
  auto stored = shared->buffers.take(static_cast<std::size_t>(entry->info.bytes));
  if (auto read = kv_store::read_entry(*entry, 0, stored.bytes()); !read) co_return read;
  auto encoded =
      encode_for_fetch(entry->info.layout, stored.bytes(), request.skip_tokens, spec.value(), shared->buffers);
  if (!encoded) co_return outcome::failure(encoded.error());
  stored = {};  // back to the pool before the send: a concurrent fetch may use it meanwhile
  const auto frame = encoded.value().frame();
  EncodedEntryHeader header;
  header.id = request.request_id;
  header.key = key;
  header.frame_bytes = frame.size();
  header.chunk_bytes = 1U << 20;
  // Every chunk's checksum and the whole frame's in one pass, the chunks hashed from cache.
  const auto checksums = checksum_chunks(std::as_bytes(frame), header.chunk_bytes);
  header.frame_checksum = checksums.whole;
  const auto reply = encode_fetch_reply(request.request_id, &header);
  if (auto sent = co_await send_frame(connection, reply, options.read_timeout); !sent) co_return sent;
  const auto& chunk_checksums = checksums.chunks;
  if (auto sent = co_await write_encoded_chunks(connection, header, frame, chunk_checksums, options.read_timeout);
      !sent) {
    co_return sent;
  }
  if (options.on_kv_bytes) {
    options.on_kv_bytes({"served", request.codec, header.frame_bytes, encoded.value().raw_bytes,
                         encoded.value().layout.dtype, encoded.value().encode_seconds});
  }
  co_return ok();
}

// Receives an encoded entry pushed ahead by a peer, decodes it to raw KV and files it.
// `sender_records_fidelity`: the sender announced kCapFidelity; without it even a lossless
// frame may carry KV computed over a lossy import, so it is filed as unverified (never exact).
asio::awaitable<Status> receive_pushed(const SharedPtr& shared, PeerConnection& connection,
                                       const EncodedEntryHeader& header, bool sender_records_fidelity) {
  const auto& options = shared->options;
  if (!options.codecs) co_return fail(ErrorCode::kUnsupported, "this sidecar has no codecs for pushed KV");
  if (header.frame_bytes > options.max_entry_bytes) {
    co_return fail(ErrorCode::kResourceExhausted, fmt::format("pushed frame of {} bytes exceeds the limit {}",
                                                              header.frame_bytes, options.max_entry_bytes));
  }
  auto received = shared->buffers.take(static_cast<std::size_t>(header.frame_bytes));
  const auto frame = received.u8();
  if (auto got = co_await read_encoded_chunks(connection, header, frame, options.read_timeout); !got) co_return got;
  const auto decode_started = std::chrono::steady_clock::now();
  auto decoded = codec::decode_frame_view(*options.codecs, frame, options.max_entry_bytes, shared->buffers);
  if (!decoded) co_return outcome::failure(decoded.error());
  const double decode_seconds =
      std::chrono::duration<double>(std::chrono::steady_clock::now() - decode_started).count();
  auto entry =
      kv_store::make_stored_entry(decoded.value().header.layout, std::as_bytes(decoded.value().kv), options.arena.get());
  if (!entry) co_return outcome::failure(entry.error());
  const auto& frame_header = decoded.value().header;
  const codec::CodecSpec pushed_codec = codec::frame_codec(*options.codecs, frame_header);
  // Pushed lossy KV is filed as lossy; the store keeps exact KV it already has under this key.
  entry.value()->fidelity =
      sender_records_fidelity ? codec::fidelity_of(pushed_codec) : Fidelity::lossy(std::string(kUnverifiedFidelity));
  if (auto put = shared->store->put(header.key, std::move(entry).value());
      !put && put.error().code != ErrorCode::kAlreadyExists) {
    co_return put;
  }
  if (options.on_kv_bytes) {
    // The spec the sender pushed ("int4+zstd"), so both sides count it under the same medium.
    const std::string spec = codec::spec_name(pushed_codec);
    options.on_kv_bytes(
        {"received", spec, header.frame_bytes, decoded.value().kv.size(), frame_header.layout.dtype, decode_seconds});
  }
  ByteWriter done;
  done.put(header.id);
  const auto committed_frame = encode_peer_frame(PeerMessage::kCommitted, done.bytes());
  co_return co_await send_frame(connection, committed_frame, options.read_timeout);
}

// Serves one connection until it closes; any error ends the session. (Temporaries are never
// passed into co_await expressions here: GCC 12 can destroy them twice.)
asio::awaitable<Status> session_body(const SharedPtr& shared, PeerConnection& connection) {
  const auto& options = shared->options;
  auto hello = co_await read_frame(connection, options.handshake_timeout, options.handshake_timeout);
  if (!hello) co_return outcome::failure(hello.error());
  if (hello.value().header.type != PeerMessage::kHello) co_return fail(ErrorCode::kProtocol, "expected hello");
  auto remote = decode_hello(hello.value().payload);
  if (!remote) co_return outcome::failure(remote.error());
  Hello mine;
  mine.node_id = options.node_id;
  mine.capabilities |= kCapRunningChecksums | kCapFidelity;
  if (!options.shm_socket.empty()) {
    mine.capabilities |= kCapSharedMemory;
    mine.shm_socket = options.shm_socket;
  }
  const auto hello_ok = encode_hello(PeerMessage::kHelloOk, mine);
  if (auto sent = co_await send_frame(connection, hello_ok, options.read_timeout); !sent) co_return sent;
  while (connection.socket.is_open()) {
    auto frame = co_await read_frame(connection, options.idle_timeout, options.read_timeout);
    if (!frame) {
      // A close between frames is how a session normally ends: nothing to report.
      if (frame.error().code == ErrorCode::kIo) co_return ok();
      co_return outcome::failure(frame.error());
    }
    const auto& payload = frame.value().payload;
    std::vector<std::byte> answer;
    switch (frame.value().header.type) {
      case PeerMessage::kPing:
        if (payload.size() > 64) co_return fail(ErrorCode::kProtocol, "oversized ping");
        answer = encode_peer_frame(PeerMessage::kPong, payload);
        break;
      case PeerMessage::kStats: {
        PeerServerStats snapshot;
        {
          std::lock_guard lock(shared->mutex);
          snapshot = shared->counters;
        }
        answer = encode_peer_stats(snapshot);
        break;
      }
      case PeerMessage::kFetch: {
        auto request = decode_fetch(payload);
        if (!request) co_return outcome::failure(request.error());
        auto served = co_await serve_fetch(shared, connection, request.value());
        if (!served) co_return served;
        continue;
      }
      case PeerMessage::kPushEncoded: {
        auto header = decode_push_encoded(payload);
        if (!header) co_return outcome::failure(header.error());
        const bool sender_records_fidelity = (remote.value().capabilities & kCapFidelity) != 0;
        auto received = co_await receive_pushed(shared, connection, header.value(), sender_records_fidelity);
        if (!received) co_return received;
        continue;
      }
      case PeerMessage::kSummary: {
        if (!payload.empty()) co_return fail(ErrorCode::kProtocol, "summary request with a payload");
        const auto keys = shared->store->recent_keys(kMaxSummaryKeys);
        answer = encode_summary(keys);
        break;
      }
      case PeerMessage::kBegin:
      case PeerMessage::kBeginRunning: {
        auto begin = decode_begin(payload, frame.value().header.type);
        if (!begin) co_return outcome::failure(begin.error());
        auto received = co_await receive_transfer(shared, connection, begin.value(),
                                                  (remote.value().capabilities & kCapCumulativeAcks) != 0);
        if (!received) co_return received;
        continue;
      }
      default:
        co_return fail(ErrorCode::kProtocol, "unexpected peer message");
    }
    if (auto sent = co_await send_frame(connection, answer, options.read_timeout); !sent) co_return sent;
  }
  co_return ok();
}

asio::awaitable<void> run_session(SharedPtr shared, std::shared_ptr<PeerConnection> connection) {
  const auto status = co_await session_body(shared, *connection);
  if (!status && connection->socket.is_open()) {
    spdlog::warn("peer session: {}", status.error().to_string());
    const auto report = encode_peer_error(status.error());
    const std::chrono::milliseconds grace(500);
    [[maybe_unused]] const auto sent = co_await send_frame(*connection, report, grace);
  } else if (!status) {
    spdlog::warn("peer session: {}", status.error().to_string());
  }
  connection->close();
}

asio::awaitable<void> accept_loop(SharedPtr shared, asio::io_context& io) {
  while (true) {
    tcp::socket socket(asio::make_strand(io));
    auto [ec] = co_await shared->acceptor->async_accept(socket, kNoThrow);
    if (ec) {
      if (ec == asio::error::operation_aborted || !shared->acceptor->is_open()) co_return;
      spdlog::warn("peer accept: {}", ec.message());
      continue;
    }
    tune_socket(socket);
    auto connection = std::make_shared<PeerConnection>(std::move(socket));
    {
      std::lock_guard lock(shared->mutex);
      if (shared->stopped) co_return;
      ++shared->counters.sessions;
      shared->sessions.insert(connection);
    }
    const auto executor = connection->socket.get_executor();
    asio::co_spawn(executor, watchdog(connection), asio::detached);
    asio::co_spawn(executor, run_session(shared, connection), [shared, connection](std::exception_ptr) {
      std::lock_guard lock(shared->mutex);
      shared->sessions.erase(connection);
    });
  }
}

}  // namespace

PeerServer::PeerServer(asio::io_context& io, PeerServerOptions options, std::shared_ptr<kv_store::EntryStore> store)
    : io_(io), shared_(std::make_shared<Shared>(std::move(options), std::move(store))) {}

PeerServer::~PeerServer() {
  stop();
}

Status PeerServer::listen(const HostPort& address) {
  boost::system::error_code ec;
  const auto ip = asio::ip::make_address(address.host, ec);
  if (ec)
    return fail(ErrorCode::kInvalidArgument, fmt::format("peer listen address '{}': {}", address.host, ec.message()));
  auto acceptor = std::make_unique<tcp::acceptor>(asio::make_strand(io_));
  const tcp::endpoint endpoint(ip, address.port);
  acceptor->open(endpoint.protocol(), ec);
  if (!ec) acceptor->set_option(asio::socket_base::reuse_address(true), ec);
  if (!ec) acceptor->bind(endpoint, ec);
  if (!ec) acceptor->listen(asio::socket_base::max_listen_connections, ec);
  if (ec) return fail(ErrorCode::kIo, fmt::format("peer listen {}: {}", address.to_string(), ec.message()));
  shared_->acceptor = std::move(acceptor);
  asio::co_spawn(shared_->acceptor->get_executor(), accept_loop(shared_, io_), asio::detached);
  return ok();
}

tcp::endpoint PeerServer::local_endpoint() const {
  boost::system::error_code ec;
  return shared_->acceptor ? shared_->acceptor->local_endpoint(ec) : tcp::endpoint{};
}

void PeerServer::stop() {
  std::vector<std::shared_ptr<PeerConnection>> open;
  {
    std::lock_guard lock(shared_->mutex);
    if (shared_->stopped) return;
    shared_->stopped = true;
    for (const auto& weak : shared_->sessions) {
      if (auto connection = weak.lock()) open.push_back(std::move(connection));
    }
  }
  if (shared_->acceptor) {
    asio::post(shared_->acceptor->get_executor(), [shared = shared_] {
      boost::system::error_code ignored;
      shared->acceptor->close(ignored);
    });
  }
  for (auto& connection : open) {
    asio::post(connection->socket.get_executor(), [connection] { connection->close(); });
  }
}

PeerServerStats PeerServer::stats() const {
  std::lock_guard lock(shared_->mutex);
  return shared_->counters;
}

}  // namespace kvrelay::peer
