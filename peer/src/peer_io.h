#pragma once

// Deadline-guarded reads and writes on one peer connection, shared by both ends of the peer
// protocol. A watchdog coroutine closes the socket when the current deadline passes, which
// fails the pending operation; errors come back as values (as_tuple), never as exceptions.
// A TLS connection (issue #25) reads and writes through its ssl::stream once the handshake is
// done; a plaintext one goes straight to the socket, as before.

#include <boost/asio/as_tuple.hpp>
#include <boost/asio/awaitable.hpp>
#include <boost/asio/ip/tcp.hpp>
#include <boost/asio/ssl/stream.hpp>
#include <boost/asio/steady_timer.hpp>
#include <boost/asio/use_awaitable.hpp>

#include <chrono>
#include <deque>
#include <functional>
#include <memory>
#include <optional>
#include <span>
#include <vector>

#include "kvrelay/core/bulk_hash.h"
#include "kvrelay/core/result.h"
#include "kvrelay/peer/link_gate.h"
#include "kvrelay/peer/peer_protocol.h"
#include "kvrelay/peer/peer_tls.h"
#include "kvrelay/peer/ucx_transport.h"

namespace kvrelay::peer::detail {

namespace asio = boost::asio;
using tcp = asio::ip::tcp;
inline constexpr auto kNoThrow = asio::as_tuple(asio::use_awaitable);
// Over the connection's own socket, which the watchdog closes on a deadline as for plaintext.
using TlsStream = asio::ssl::stream<tcp::socket&>;

struct PeerConnection {
  explicit PeerConnection(tcp::socket connected) : socket(std::move(connected)), timer(socket.get_executor()) {}
  tcp::socket socket;
  asio::steady_timer timer;
  // Set by start_tls; the context lives as long as the stream made from it.
  std::shared_ptr<asio::ssl::context> tls_context;
  std::optional<TlsStream> tls;
  std::chrono::steady_clock::time_point deadline = std::chrono::steady_clock::time_point::max();
  bool timed_out = false;
  // Set by close() (or the watchdog on a timeout); the watchdog runs until then. Not "socket
  // closed": a client's socket is not open yet when its watchdog starts.
  bool closed = false;

  // When the watchdog's timer is due. A deadline later than this needs no wake-up: the watchdog
  // reads `deadline` when the timer fires and sleeps again. Cancelling the timer on every read
  // cost a timer update and a handler run per socket operation (a third of a 1 MiB transfer's
  // system calls).
  std::chrono::steady_clock::time_point wake_at = std::chrono::steady_clock::time_point::max();

  // An absolute bound over a whole exchange (a lookup's deadline): every wait armed while it is
  // set ends at the sooner of its own timeout and this. max(): none.
  std::chrono::steady_clock::time_point limit = std::chrono::steady_clock::time_point::max();
  // The armed deadline is `limit`: a timeout then means the exchange ran out of time.
  bool deadline_is_limit = false;

  // Issue #29. Set: chunk streams on this connection travel over this UCX endpoint; every other
  // frame (announcements, acknowledgements, errors) stays on the socket. Chunks that arrived
  // while the connection's coroutine waited for something else queue here.
  std::shared_ptr<UcxLink> ucx;
  std::deque<std::shared_ptr<UcxArrival>> ucx_arrivals;
  bool ucx_received = false;  // the body receive last posted on `ucx` completed

  void arm(std::chrono::milliseconds timeout) {
    deadline = std::chrono::steady_clock::now() + timeout;
    deadline_is_limit = limit < deadline;
    if (deadline_is_limit) deadline = limit;
    if (deadline < wake_at) timer.cancel();  // sooner than planned: the watchdog re-arms
  }
  void close() {
    closed = true;
    boost::system::error_code ignored;
    socket.shutdown(tcp::socket::shutdown_both, ignored);
    socket.close(ignored);
    timer.cancel();
    if (ucx) ucx->close();
  }
};

// Runs the TLS handshake (server or client side) within `timeout`; every read and write after it
// goes through connection.tls. Nothing of kvrelay's is read before it completes.
asio::awaitable<Status> start_tls(PeerConnection& connection, std::shared_ptr<asio::ssl::context> context, bool server,
                                  std::chrono::milliseconds timeout);
// What the handshake verified of the other side's certificate (empty on a plaintext connection).
[[nodiscard]] PeerCertificate remote_certificate(PeerConnection& connection);
[[nodiscard]] PeerCertificate certificate_of(const SSL* session);

// Runs until close(); closes the socket when a deadline passes.
asio::awaitable<void> watchdog(std::shared_ptr<PeerConnection> connection);

// TCP_NODELAY (acks and pings are tiny) and kernel keep-alive probes on idle links.
void tune_socket(tcp::socket& socket);

[[nodiscard]] Error io_error(const PeerConnection& connection, const boost::system::error_code& ec, const char* what);

asio::awaitable<Status> read_exact(PeerConnection& connection, asio::mutable_buffer buffer,
                                   std::chrono::milliseconds timeout);
// A chunk's header and its body in one read (a scatter read: no system call for the 20 header
// bytes alone); the caller validates the header after both arrived.
asio::awaitable<Status> read_exact(PeerConnection& connection, asio::mutable_buffer first, asio::mutable_buffer second,
                                   std::chrono::milliseconds timeout);

// Staged chunks: the kernel copies chunk data to and from one small reused buffer, and the
// checksum pass moves it between that buffer and the entry in user space. On hosts that build
// page tables lazily (shadow paging) a kernel copy into or out of a large, rarely touched
// mapping such as the arena faults again and again (raw loopback into 768 MiB measured a
// 2.5 GB/s median with a quarter of its runs at 0.7 GB/s, against 3.8 GB/s through a 1 MiB
// buffer); user-space copies into the same memory do not. Elsewhere it costs one copy of a
// chunk that is in cache.

// Two buffers (header + body) so chunk data goes out without being copied. (No initializer
// lists here: GCC 12 miscompiles braced lists inside co_await expressions.)
asio::awaitable<Status> write_all(PeerConnection& connection, asio::const_buffer first, asio::const_buffer second,
                                  std::chrono::milliseconds timeout);
// Three buffers: an announcement, then the first chunk's header and body, in one system call.
asio::awaitable<Status> write_all(PeerConnection& connection, asio::const_buffer first, asio::const_buffer second,
                                  asio::const_buffer third, std::chrono::milliseconds timeout);

// Where a chunk stream's chunks travel (issue #29): the socket itself, in kChunk frames (TCP), or
// the connection's UCX link, as active messages. Both carry the same 20-byte chunk header with
// its running checksum; announcements, acknowledgements and errors stay on the socket.
using ChunkPrefix = std::array<std::byte, kPeerHeaderBytes + kChunkHeaderBytes>;
class ChunkTransport {
 public:
  virtual ~ChunkTransport() = default;
  [[nodiscard]] virtual std::string_view name() const noexcept = 0;
  // Whether a chunk may be staged through a reused buffer: send() is done with it on return.
  [[nodiscard]] virtual bool stages() const noexcept = 0;
  // Sends `announce` (when not empty), then one chunk: `prefix` (frame and chunk headers) and
  // `body`, which stays the caller's until flush().
  virtual asio::awaitable<Status> send(PeerConnection& connection, std::span<const std::byte> announce,
                                       const ChunkPrefix& prefix, std::span<const std::byte> body,
                                       std::chrono::milliseconds timeout) const = 0;
  // After the last acknowledgement: every body handed to send() may be reused.
  virtual asio::awaitable<Status> flush(PeerConnection& connection, std::chrono::milliseconds timeout) const = 0;
  // Chunk `index`: its header into `chunk_header` and its body into `body` (exactly the size the
  // stream says it has); the sender's error report instead ends it with that error.
  virtual asio::awaitable<Status> receive(PeerConnection& connection,
                                          std::array<std::byte, kChunkHeaderBytes>& chunk_header,
                                          std::span<std::uint8_t> body, std::uint64_t index,
                                          std::chrono::milliseconds timeout) const = 0;
  // A stream that ended early: nothing may read from or write into its frame afterwards.
  virtual void abandon(PeerConnection& connection) const noexcept = 0;
};
// TCP, or the connection's UCX link when it has one.
[[nodiscard]] const ChunkTransport& chunk_transport(const PeerConnection& connection) noexcept;
[[nodiscard]] const ChunkTransport& ucx_chunks() noexcept;
[[nodiscard]] inline std::string_view transport_name(const PeerConnection& connection) noexcept {
  return chunk_transport(connection).name();
}
// A stream that ends early abandons its chunks in flight: the caller frees the frame next. (Not
// in an anonymous namespace: coroutine frames hold one, GCC's -Wsubobject-linkage.)
class AbandonUnlessDone {
 public:
  explicit AbandonUnlessDone(PeerConnection& connection) : connection_(connection) {}
  ~AbandonUnlessDone() {
    if (armed_) chunk_transport(connection_).abandon(connection_);
  }
  AbandonUnlessDone(const AbandonUnlessDone&) = delete;
  AbandonUnlessDone& operator=(const AbandonUnlessDone&) = delete;
  void dismiss() noexcept { armed_ = false; }

 private:
  PeerConnection& connection_;
  bool armed_ = true;
};

// Whether a frame from the other side is waiting: readable bytes on the socket, or (TLS) bytes
// the TLS stream has already decrypted.
[[nodiscard]] bool input_pending(PeerConnection& connection);

// What a UCX wait waits for.
enum class UcxUntil : std::uint8_t {
  kArrival,   // a chunk has arrived (connection.ucx_arrivals)
  kReceived,  // the body receive last posted completed
  kSent,      // every send posted has completed
  kReady,     // the peer answered our token
};
// Takes the UCX link's events (queueing arrivals) until `until` holds, within `timeout` and the
// exchange's limit. `socket_may_speak`: the other side sends nothing on the socket meanwhile, so
// a frame there (an error report) or its close ends the wait at once, as a dead peer's does.
asio::awaitable<Status> await_ucx(PeerConnection& connection, UcxUntil until, std::chrono::milliseconds timeout,
                                  const char* what, bool socket_may_speak);

struct PeerFrame {
  PeerHeader header;
  std::vector<std::byte> payload;  // empty for kChunk: its body is read by the caller
};
// Reads one header (waiting up to `first_byte_timeout`), then the payload of any non-chunk
// frame (within `timeout`). `at_hello`: a hello, hello reply or error of another wire version
// is read too (frame.header.version says which), so the caller can refuse it clearly.
asio::awaitable<Result<PeerFrame>> read_frame(PeerConnection& connection, std::chrono::milliseconds first_byte_timeout,
                                              std::chrono::milliseconds timeout, bool at_hello = false);

// The sending end of a chunk stream (EncodedEntryHeader in peer_protocol.h).
struct ChunkStreamOptions {
  // Staged chunks (above): each chunk is copied here by its checksum pass and written from here.
  // nullptr: written straight from the frame.
  std::vector<std::byte>* staging = nullptr;
  std::uint64_t rate_limit_bytes_per_s = 0;  // 0: unlimited
  // After each acknowledgement: (bytes acknowledged, total bytes).
  std::function<void(std::uint64_t, std::uint64_t)> on_progress;
  // Issue #27: with a gate and its ticket, every chunk waits for the gate's grant and every
  // acknowledgement is reported to it. The caller opens and closes the ticket.
  LinkGate* gate = nullptr;
  std::uint64_t ticket = 0;
  // Gated streams only: time spent waiting for grants, so that a link estimate can be fed busy
  // time (wall time minus waits) rather than time spent queued behind other transfers.
  std::chrono::nanoseconds* grant_wait = nullptr;
};

// The window a gated stream announces: the receiver then acknowledges every chunk, so the link's
// window of granted, unacknowledged chunks drains chunk by chunk (plan §5, window deadlock).
inline constexpr std::uint32_t kGatedWindowChunks = 2;

// One stream's ticket with a link gate, closed when the sender is done with it, however its
// coroutine ends: a stream that failed half way gives its share of the link back.
class GateTicket {
 public:
  GateTicket() = default;
  GateTicket(LinkGate* gate, const TransferTag& tag) : gate_(gate), id_(gate != nullptr ? gate->open(tag) : 0) {}
  ~GateTicket() {
    if (id_ != 0) gate_->close(id_, completed_);
  }
  GateTicket(const GateTicket&) = delete;
  GateTicket& operator=(const GateTicket&) = delete;
  [[nodiscard]] bool gated() const noexcept { return id_ != 0; }
  [[nodiscard]] std::uint64_t id() const noexcept { return id_; }
  // The stream and everything after it went through (a push: committed).
  void complete() noexcept { completed_ = true; }
  // Gated streams use the gate's chunk size and announce kGatedWindowChunks; others `ungated`.
  [[nodiscard]] std::uint32_t chunk_bytes(std::uint32_t ungated) const {
    return id_ != 0 ? gate_->chunk_bytes() : ungated;
  }
  [[nodiscard]] std::uint32_t window_chunks(std::uint32_t ungated) const noexcept {
    return id_ != 0 ? kGatedWindowChunks : ungated;
  }
  void apply(ChunkStreamOptions& stream) const noexcept {
    stream.gate = id_ != 0 ? gate_ : nullptr;
    stream.ticket = id_;
  }

 private:
  LinkGate* gate_ = nullptr;
  std::uint64_t id_ = 0;
  bool completed_ = false;
};

// Where a chunk stream's sender stands. Not in an anonymous namespace: send_chunk_stream's
// coroutine frame holds one (GCC's -Wsubobject-linkage in unity builds).
struct ChunkAckProgress {
  std::uint64_t acked = 0;  // chunks acknowledged
  std::uint64_t sent = 0;   // chunks written
};

// Writes `announce` (the FetchReply or PushEncoded that describes the stream; it goes out with
// the first chunk in one system call), then `frame` as header's chunk stream, never more than
// header.window_chunks ahead of the receiver's acknowledgements, and returns once the last chunk
// is acknowledged. A kError from the receiver ends it with that error.
asio::awaitable<Status> send_chunk_stream(PeerConnection& connection, std::span<const std::byte> announce,
                                          const EncodedEntryHeader& header, std::span<const std::uint8_t> frame,
                                          const ChunkStreamOptions& options, std::chrono::milliseconds timeout);

// Receives header's chunk stream into `frame` (exactly header.frame_bytes long: the caller sizes
// it from the announcement, in memory it keeps warm), checking order, sizes and every running
// checksum, and acknowledging every header.ack_every() chunks. The last chunk is acknowledged
// here when `acknowledge_last`; otherwise the caller does (with Committed, in one write).
// `on_progress`: after each chunk checked, (bytes received, total bytes).
asio::awaitable<Status> receive_chunk_stream(
    PeerConnection& connection, const EncodedEntryHeader& header, std::span<std::uint8_t> frame, bool acknowledge_last,
    std::chrono::milliseconds timeout, const std::function<void(std::uint64_t, std::uint64_t)>* on_progress = nullptr);

}  // namespace kvrelay::peer::detail
