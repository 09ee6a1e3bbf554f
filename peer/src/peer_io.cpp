#include "peer_io.h"

// GCC 12 reports a false -Wmismatched-new-delete for Asio's coroutine frame allocator
// (awaitable_frame_base has matching class-level new/delete).
#pragma GCC diagnostic ignored "-Wmismatched-new-delete"

#include <netinet/in.h>
#include <netinet/tcp.h>
#include <sys/socket.h>

#include <boost/asio/post.hpp>
#include <boost/asio/read.hpp>
#include <boost/asio/ssl.hpp>
#include <boost/asio/write.hpp>
#include <fmt/format.h>

#include <algorithm>
#include <array>
#include <atomic>
#include <cerrno>
#include <cstring>
#include <limits>

#include "kvrelay/core/bulk_hash.h"

namespace kvrelay::peer::detail {

asio::awaitable<void> watchdog(std::shared_ptr<PeerConnection> connection) {
  while (!connection->closed) {
    connection->wake_at = connection->deadline;
    connection->timer.expires_at(connection->wake_at);
    [[maybe_unused]] auto [ec] = co_await connection->timer.async_wait(kNoThrow);
    if (connection->closed) break;
    if (connection->deadline <= std::chrono::steady_clock::now()) {
      connection->timed_out = true;
      connection->closed = true;
      boost::system::error_code ignored;
      connection->socket.close(ignored);
      break;
    }
  }
}

void tune_socket(tcp::socket& socket) {
  boost::system::error_code ignored;
  socket.set_option(tcp::no_delay(true), ignored);
  socket.set_option(asio::socket_base::keep_alive(true), ignored);
  const int fd = socket.native_handle();
  const int idle_s = 10;
  const int interval_s = 2;
  const int probes = 3;
  ::setsockopt(fd, IPPROTO_TCP, TCP_KEEPIDLE, &idle_s, sizeof(idle_s));
  ::setsockopt(fd, IPPROTO_TCP, TCP_KEEPINTVL, &interval_s, sizeof(interval_s));
  ::setsockopt(fd, IPPROTO_TCP, TCP_KEEPCNT, &probes, sizeof(probes));
}

Error io_error(const PeerConnection& connection, const boost::system::error_code& ec, const char* what) {
  if (connection.timed_out && connection.deadline_is_limit) {
    return Error{ErrorCode::kTimeout, fmt::format("{}: deadline exceeded", what)};
  }
  if (connection.timed_out) return Error{ErrorCode::kTimeout, fmt::format("{}: peer timed out", what)};
  if (ec == asio::error::eof || ec == asio::error::connection_reset || ec == asio::error::broken_pipe) {
    return Error{ErrorCode::kIo, fmt::format("{}: peer closed the connection ({})", what, ec.message())};
  }
  return Error{ErrorCode::kIo, fmt::format("{}: {}", what, ec.message())};
}

namespace {

// Asio's transfer_all hands the kernel at most 64 KiB per call (default_max_transfer_size), so a
// 1 MiB chunk cost 16 sendmsg or recvmsg calls with a reactor poll after each; a raw socket
// moves it in as few calls as the socket buffer allows. This lets each call take all that is
// left.
struct TransferAllAtOnce {
  std::size_t operator()(const boost::system::error_code& ec, std::size_t /*transferred*/) const noexcept {
    return ec ? 0 : std::numeric_limits<std::size_t>::max();
  }
};

}  // namespace

asio::awaitable<Status> start_tls(PeerConnection& connection, std::shared_ptr<asio::ssl::context> context, bool server,
                                  std::chrono::milliseconds timeout) {
  connection.tls_context = std::move(context);
  connection.tls.emplace(connection.socket, *connection.tls_context);
  connection.arm(timeout);
  const auto role = server ? asio::ssl::stream_base::server : asio::ssl::stream_base::client;
  auto [ec] = co_await connection.tls->async_handshake(role, kNoThrow);
  if (ec) co_return outcome::failure(io_error(connection, ec, "TLS handshake"));
  co_return ok();
}

PeerCertificate remote_certificate(PeerConnection& connection) {
  if (!connection.tls) return {};
  return certificate_of(connection.tls->native_handle());
}

namespace {

// Plaintext straight to the socket; TLS through its stream. Two statements, never a conditional
// of two co_awaits (GCC 12 destroys its result twice).
template <class Buffers>
asio::awaitable<Status> read_buffers(PeerConnection& connection, const Buffers& buffers,
                                     std::chrono::milliseconds timeout) {
  connection.arm(timeout);
  if (connection.tls) {
    auto [ec, transferred] = co_await asio::async_read(*connection.tls, buffers, TransferAllAtOnce{}, kNoThrow);
    if (ec) co_return outcome::failure(io_error(connection, ec, "read"));
    co_return ok();
  }
  auto [ec, transferred] = co_await asio::async_read(connection.socket, buffers, TransferAllAtOnce{}, kNoThrow);
  if (ec) co_return outcome::failure(io_error(connection, ec, "read"));
  co_return ok();
}

}  // namespace

asio::awaitable<Status> read_exact(PeerConnection& connection, asio::mutable_buffer buffer,
                                   std::chrono::milliseconds timeout) {
  co_return co_await read_buffers(connection, buffer, timeout);
}

asio::awaitable<Status> read_exact(PeerConnection& connection, asio::mutable_buffer first, asio::mutable_buffer second,
                                   std::chrono::milliseconds timeout) {
  const std::array<asio::mutable_buffer, 2> buffers{first, second};
  co_return co_await read_buffers(connection, buffers, timeout);
}

std::uint64_t running_checksum(BulkHashStream& running, std::span<const std::byte> chunk, std::byte* copy_to) {
  // The copy and the hash in one pass: each 64-byte stripe is hashed as soon as it is stored.
  if (copy_to != nullptr)
    running.update_copy(copy_to, chunk.data(), chunk.size());
  else
    running.update(chunk.data(), chunk.size());
  return running.digest();
}

namespace {

template <std::size_t N>
asio::awaitable<Status> write_buffers(PeerConnection& connection, std::array<asio::const_buffer, N> buffers,
                                      std::chrono::milliseconds timeout) {
  connection.arm(timeout);
  if (connection.tls) {
    auto [ec, transferred] = co_await asio::async_write(*connection.tls, buffers, TransferAllAtOnce{}, kNoThrow);
    if (ec) co_return outcome::failure(io_error(connection, ec, "write"));
    co_return ok();
  }
  auto [ec, transferred] = co_await asio::async_write(connection.socket, buffers, TransferAllAtOnce{}, kNoThrow);
  if (ec) co_return outcome::failure(io_error(connection, ec, "write"));
  co_return ok();
}

}  // namespace

asio::awaitable<Status> write_all(PeerConnection& connection, asio::const_buffer first, asio::const_buffer second,
                                  std::chrono::milliseconds timeout) {
  const std::array<asio::const_buffer, 2> buffers{first, second};  // not braced inside co_await (GCC 12)
  co_return co_await write_buffers(connection, buffers, timeout);
}

asio::awaitable<Status> write_all(PeerConnection& connection, asio::const_buffer first, asio::const_buffer second,
                                  asio::const_buffer third, std::chrono::milliseconds timeout) {
  const std::array<asio::const_buffer, 3> buffers{first, second, third};
  co_return co_await write_buffers(connection, buffers, timeout);
}

asio::awaitable<Result<PeerFrame>> read_frame(PeerConnection& connection, std::chrono::milliseconds first_byte_timeout,
                                              std::chrono::milliseconds timeout, bool at_hello) {
  std::array<std::byte, kPeerHeaderBytes> header_bytes{};
  connection.arm(first_byte_timeout);
  // Whatever of the header has arrived (usually all of it: one system call), never past it.
  std::size_t got = 0;
  if (connection.tls) {
    auto [ec, n] = co_await connection.tls->async_read_some(asio::buffer(header_bytes), kNoThrow);
    if (ec) co_return outcome::failure(io_error(connection, ec, "read"));
    got = n;
  } else {
    auto [ec, n] = co_await connection.socket.async_read_some(asio::buffer(header_bytes), kNoThrow);
    if (ec) co_return outcome::failure(io_error(connection, ec, "read"));
    got = n;
  }
  if (got < kPeerHeaderBytes) {
    auto rest =
        co_await read_exact(connection, asio::buffer(header_bytes.data() + got, kPeerHeaderBytes - got), timeout);
    if (!rest) co_return outcome::failure(rest.error());
  }
  auto header = at_hello ? decode_hello_header(header_bytes) : decode_peer_header(header_bytes);
  if (!header) co_return outcome::failure(header.error());
  PeerFrame frame;
  frame.header = header.value();
  if (frame.header.type != PeerMessage::kChunk && frame.header.length > 0) {
    frame.payload.resize(frame.header.length);
    auto body = co_await read_exact(connection, asio::buffer(frame.payload), timeout);
    if (!body) co_return outcome::failure(body.error());
  }
  co_return frame;
}

namespace {

void encode_chunk_prefix(ChunkPrefix& prefix, std::uint64_t id, std::uint64_t index, std::size_t length,
                         std::uint64_t checksum) {
  encode_peer_header(std::span<std::byte, kPeerHeaderBytes>(prefix.data(), kPeerHeaderBytes), PeerMessage::kChunk,
                     static_cast<std::uint32_t>(kChunkHeaderBytes + length));
  encode_chunk_header(std::span<std::byte, kChunkHeaderBytes>(prefix.data() + kPeerHeaderBytes, kChunkHeaderBytes),
                      ChunkHeader{id, static_cast<std::uint32_t>(index), checksum});
}

// The receiver's next acknowledgement: every chunk up to its index, which must be one sent and
// not yet acknowledged.
asio::awaitable<Result<std::uint64_t>> read_ack(PeerConnection& connection, const EncodedEntryHeader& header,
                                                std::uint64_t acked, std::uint64_t sent,
                                                std::chrono::milliseconds timeout) {
  auto frame = co_await read_frame(connection, timeout, timeout);
  if (!frame) co_return outcome::failure(frame.error());
  if (frame.value().header.type == PeerMessage::kError) {
    co_return outcome::failure(decode_peer_error(frame.value().payload));
  }
  if (frame.value().header.type != PeerMessage::kChunkAck) {
    co_return fail(ErrorCode::kProtocol, fmt::format("expected a chunk acknowledgement, got peer message {}",
                                                     static_cast<int>(frame.value().header.type)));
  }
  auto ack = decode_chunk_ack(frame.value().payload);
  if (!ack) co_return outcome::failure(ack.error());
  if (ack.value().id != header.id || ack.value().index < acked || ack.value().index >= sent) {
    co_return fail(ErrorCode::kProtocol, fmt::format("acknowledgement of chunk {} of stream {}, expected {}..{} of {}",
                                                     ack.value().index, ack.value().id, acked, sent - 1, header.id));
  }
  co_return std::uint64_t{ack.value().index} + 1;
}

// Bytes of the stream's first `chunks` chunks.
std::uint64_t bytes_through(const EncodedEntryHeader& header, std::uint64_t chunks) {
  return std::min<std::uint64_t>(chunks * header.chunk_bytes, header.frame_bytes);
}

}  // namespace

bool input_pending(PeerConnection& connection) {
  if (connection.tls && SSL_pending(connection.tls->native_handle()) > 0) return true;
  boost::system::error_code ec;
  return connection.socket.available(ec) > 0 && !ec;
}

namespace {

// The state one grant wait shares with the gate's callback, which may run on any thread: it sets
// the flag and posts the timer's cancel to the connection's executor (a strand on the server).
struct GrantWait {
  explicit GrantWait(const tcp::socket::executor_type& executor) : timer(executor) {}
  asio::steady_timer timer;
  std::atomic<bool> granted{false};
};

// A lost wake-up (the cancel ran before the wait was armed) costs at most this.
constexpr auto kGrantRecheck = std::chrono::milliseconds(2);

// Reads the next acknowledgement and reports it to the gate and the progress callback.
asio::awaitable<Status> take_ack(PeerConnection& connection, const EncodedEntryHeader& header,
                                 const ChunkStreamOptions& options, ChunkAckProgress& progress,
                                 std::chrono::milliseconds timeout) {
  auto ack = co_await read_ack(connection, header, progress.acked, progress.sent, timeout);
  if (!ack) co_return outcome::failure(ack.error());
  const std::uint64_t before = bytes_through(header, progress.acked);
  progress.acked = ack.value();
  const std::uint64_t through = bytes_through(header, progress.acked);
  if (options.gate != nullptr && options.ticket != 0) options.gate->acknowledged(options.ticket, through - before);
  if (options.on_progress) options.on_progress(through, header.frame_bytes);
  co_return ok();
}

// Waits until the gate grants the next `bytes`. While it waits it reads the acknowledgements that
// arrive, so a paused stream with chunks in flight still gives the link's window back (two paused
// streams could otherwise hold it for ever). Bounded by `timeout` and the exchange's limit: the
// gate's stall guard grants a waiting stream well before a receiver would time it out.
asio::awaitable<Status> await_grant(PeerConnection& connection, const EncodedEntryHeader& header,
                                    const ChunkStreamOptions& options, std::uint64_t bytes, ChunkAckProgress& progress,
                                    std::chrono::milliseconds timeout) {
  const auto started = std::chrono::steady_clock::now();
  const auto give_up = std::min(connection.limit, started + timeout);
  auto wait = std::make_shared<GrantWait>(connection.socket.get_executor());
  options.gate->request(options.ticket, bytes, [wait] {
    wait->granted.store(true, std::memory_order_release);
    asio::post(wait->timer.get_executor(), [wait] { wait->timer.cancel(); });
  });
  while (!wait->granted.load(std::memory_order_acquire)) {
    if (progress.acked < progress.sent && input_pending(connection)) {
      auto took = co_await take_ack(connection, header, options, progress, timeout);
      if (!took) co_return took;
      continue;
    }
    const auto now = std::chrono::steady_clock::now();
    if (now >= give_up || connection.closed) {
      co_return fail(ErrorCode::kTimeout,
                     fmt::format("stream {}: the link scheduler granted no chunk within {} ms", header.id,
                                 std::chrono::duration_cast<std::chrono::milliseconds>(now - started).count()));
    }
    wait->timer.expires_at(std::min(give_up, now + kGrantRecheck));
    [[maybe_unused]] auto [ec] = co_await wait->timer.async_wait(kNoThrow);
  }
  if (options.grant_wait != nullptr) *options.grant_wait += std::chrono::steady_clock::now() - started;
  co_return ok();
}

}  // namespace

namespace {

// Chunks in kChunk frames on the socket itself. A chunk is written before send() returns, so
// its body may be staged through one reused buffer, and nothing is left to flush or abandon.
class TcpChunks final : public ChunkTransport {
 public:
  [[nodiscard]] std::string_view name() const noexcept override { return "tcp"; }
  [[nodiscard]] bool stages() const noexcept override { return true; }
  asio::awaitable<Status> send(PeerConnection& connection, std::span<const std::byte> announce,
                               const ChunkPrefix& prefix, std::span<const std::byte> body,
                               std::chrono::milliseconds timeout) const override {
    const asio::const_buffer data(body.data(), body.size());
    // Two statements, not a conditional of two co_awaits: GCC 12 destroys the Status of such a
    // conditional twice when it holds an error (ASan: heap-use-after-free in run_session).
    if (announce.empty()) co_return co_await write_all(connection, asio::buffer(prefix), data, timeout);
    co_return co_await write_all(connection, asio::buffer(announce.data(), announce.size()), asio::buffer(prefix), data,
                                 timeout);
  }
  asio::awaitable<Status> flush(PeerConnection& /*connection*/, std::chrono::milliseconds /*timeout*/) const override {
    co_return ok();
  }
  asio::awaitable<Status> receive(PeerConnection& connection, std::array<std::byte, kChunkHeaderBytes>& chunk_header,
                                  std::span<std::uint8_t> body, std::uint64_t index,
                                  std::chrono::milliseconds timeout) const override {
    auto next = co_await read_frame(connection, timeout, timeout);
    if (!next) co_return outcome::failure(next.error());
    if (next.value().header.type == PeerMessage::kError) {
      co_return outcome::failure(decode_peer_error(next.value().payload));
    }
    if (next.value().header.type != PeerMessage::kChunk) co_return fail(ErrorCode::kProtocol, "expected a chunk");
    if (next.value().header.length != kChunkHeaderBytes + body.size()) {
      co_return fail(ErrorCode::kProtocol, fmt::format("chunk {} has {} bytes, expected {}", index,
                                                       next.value().header.length - kChunkHeaderBytes, body.size()));
    }
    co_return co_await read_exact(connection, asio::buffer(chunk_header), asio::buffer(body.data(), body.size()),
                                  timeout);
  }
  void abandon(PeerConnection& /*connection*/) const noexcept override {}
};

const TcpChunks kTcpChunks;

}  // namespace

const ChunkTransport& chunk_transport(const PeerConnection& connection) noexcept {
  return connection.ucx ? ucx_chunks() : static_cast<const ChunkTransport&>(kTcpChunks);
}

asio::awaitable<Status> send_chunk_stream(PeerConnection& connection, std::span<const std::byte> announce,
                                          const EncodedEntryHeader& header, std::span<const std::uint8_t> frame,
                                          const ChunkStreamOptions& options, std::chrono::milliseconds timeout) {
  if (frame.size() != header.frame_bytes || header.chunk_bytes == 0 || header.window_chunks == 0) {
    co_return fail(ErrorCode::kInternal, "chunk stream header does not describe its frame");
  }
  BulkHashStream running;
  if (!running.valid()) co_return fail(ErrorCode::kResourceExhausted, "XXH3_createState");
  const auto stream_header = stream_header_bytes(header);
  running.update(stream_header.data(), stream_header.size());
  const std::uint64_t chunks = header.chunk_count();
  std::byte* staging = nullptr;
  const ChunkTransport& transport = chunk_transport(connection);
  AbandonUnlessDone abandon(connection);
  if (options.staging != nullptr && transport.stages()) {
    const auto chunk_size = static_cast<std::size_t>(std::min<std::uint64_t>(header.chunk_bytes, frame.size()));
    if (options.staging->size() < chunk_size) options.staging->resize(chunk_size);
    staging = options.staging->data();  // one write completes before the next chunk is staged
  }
  const auto started = std::chrono::steady_clock::now();
  asio::steady_timer pacing(connection.socket.get_executor());
  ChunkPrefix prefix{};
  bool announced = false;
  const bool gated = options.gate != nullptr && options.ticket != 0;
  ChunkAckProgress progress;
  std::uint64_t& next = progress.sent;
  const std::uint64_t& acked = progress.acked;
  while (acked < chunks) {
    while (next < chunks && next - acked < header.window_chunks) {
      const std::uint64_t offset = next * header.chunk_bytes;
      const auto length = static_cast<std::size_t>(std::min<std::uint64_t>(header.chunk_bytes, frame.size() - offset));
      if (gated) {
        auto granted = co_await await_grant(connection, header, options, length, progress, timeout);
        if (!granted) co_return granted;
      }
      const auto chunk = std::as_bytes(frame.subspan(static_cast<std::size_t>(offset), length));
      const std::uint64_t checksum = running_checksum(running, chunk, staging);
      encode_chunk_prefix(prefix, header.id, next, length, checksum);
      const auto body = staging != nullptr ? std::span<const std::byte>(staging, length) : chunk;
      const auto first = announced ? std::span<const std::byte>{} : announce;
      auto sent = co_await transport.send(connection, first, prefix, body, timeout);
      if (!sent) co_return sent;
      announced = true;
      ++next;
      if (options.rate_limit_bytes_per_s > 0) {
        const double seconds =
            static_cast<double>(offset + length) / static_cast<double>(options.rate_limit_bytes_per_s);
        pacing.expires_at(started + std::chrono::microseconds(static_cast<std::int64_t>(seconds * 1e6)));
        [[maybe_unused]] auto [ec] = co_await pacing.async_wait(kNoThrow);
      }
    }
    auto took = co_await take_ack(connection, header, options, progress, timeout);
    if (!took) co_return took;
  }
  auto flushed = co_await transport.flush(connection, timeout);
  if (!flushed) co_return flushed;
  abandon.dismiss();
  co_return ok();
}

asio::awaitable<Status> receive_chunk_stream(PeerConnection& connection, const EncodedEntryHeader& header,
                                             std::span<std::uint8_t> frame, bool acknowledge_last,
                                             std::chrono::milliseconds timeout,
                                             const std::function<void(std::uint64_t, std::uint64_t)>* on_progress) {
  if (frame.size() != header.frame_bytes) {
    co_return fail(ErrorCode::kInternal,
                   fmt::format("receive buffer of {} bytes for a {}-byte frame", frame.size(), header.frame_bytes));
  }
  BulkHashStream running;
  if (!running.valid()) co_return fail(ErrorCode::kResourceExhausted, "XXH3_createState");
  const auto stream_header = stream_header_bytes(header);
  running.update(stream_header.data(), stream_header.size());
  std::array<std::byte, kChunkHeaderBytes> chunk_header_bytes{};
  const std::uint64_t chunks = header.chunk_count();
  const std::uint64_t ack_every = header.ack_every();
  const ChunkTransport& transport = chunk_transport(connection);
  AbandonUnlessDone abandon(connection);
  for (std::uint64_t index = 0; index < chunks; ++index) {
    const std::uint64_t offset = index * header.chunk_bytes;
    const std::uint64_t expected = std::min<std::uint64_t>(header.chunk_bytes, header.frame_bytes - offset);
    std::uint8_t* destination = frame.data() + offset;
    const std::span<std::uint8_t> body(destination, static_cast<std::size_t>(expected));
    auto got = co_await transport.receive(connection, chunk_header_bytes, body, index, timeout);
    if (!got) co_return got;
    const auto chunk = decode_chunk_header(chunk_header_bytes);
    if (chunk.transfer_id != header.id || chunk.index != index) {
      co_return fail(ErrorCode::kProtocol, fmt::format("chunk {} of stream {} out of order (expected {} of {})",
                                                       chunk.index, chunk.transfer_id, index, header.id));
    }
    const auto received = std::as_bytes(std::span(destination, static_cast<std::size_t>(expected)));
    if (running_checksum(running, received, nullptr) != chunk.checksum) {
      co_return fail(ErrorCode::kChecksumMismatch,
                     fmt::format("chunk {} of stream {}: checksum mismatch", index, header.id));
    }
    if (on_progress != nullptr && *on_progress) (*on_progress)(offset + expected, header.frame_bytes);
    const bool last = index + 1 == chunks;
    if (last ? !acknowledge_last : (index + 1) % ack_every != 0) continue;
    const auto ack = encode_chunk_ack(header.id, static_cast<std::uint32_t>(index));
    if (auto sent = co_await write_all(connection, asio::buffer(ack), asio::const_buffer{}, timeout); !sent)
      co_return sent;
  }
  abandon.dismiss();
  co_return ok();
}

}  // namespace kvrelay::peer::detail
