#include "peer_io.h"

// GCC 12 reports a false -Wmismatched-new-delete for Asio's coroutine frame allocator
// (awaitable_frame_base has matching class-level new/delete).
#pragma GCC diagnostic ignored "-Wmismatched-new-delete"

// Chunk streams over a connection's UCX link (issue #29): chunks as active messages, waits that
// end as soon as the link reports, the socket speaks or closes, or the connection's deadline
// passes.

#include <sys/socket.h>

#include <boost/asio/experimental/awaitable_operators.hpp>
#include <fmt/format.h>

#include <cerrno>

namespace kvrelay::peer::detail {

namespace {

// A frame on the socket during a UCX wait: the other side's error report, or its close.
asio::awaitable<Status> socket_interrupt(PeerConnection& connection, std::chrono::milliseconds timeout,
                                         const char* what) {
  auto frame = co_await read_frame(connection, timeout, timeout);
  if (!frame) co_return outcome::failure(Error{frame.error().code, fmt::format("{}: {}", what, frame.error().message)});
  if (frame.value().header.type == PeerMessage::kError)
    co_return outcome::failure(decode_peer_error(frame.value().payload));
  co_return fail(ErrorCode::kProtocol, fmt::format("{}: peer message {} on the socket during a UCX chunk stream", what,
                                                   static_cast<int>(frame.value().header.type)));
}

// Applies one event; a failure ends the wait.
Status take_ucx_event(PeerConnection& connection, Result<UcxEvent>& event, const char* what) {
  if (!event) return fail(ErrorCode::kIo, fmt::format("{}: {}", what, event.error().message));
  switch (event.value().kind) {
    case UcxEvent::Kind::kArrival:
      connection.ucx_arrivals.push_back(std::move(event.value().arrival));
      break;
    case UcxEvent::Kind::kReceiveDone:
      connection.ucx_received = true;
      break;
    case UcxEvent::Kind::kFailed:
      return fail(ErrorCode::kIo, fmt::format("{}: {}", what, event.value().message));
    case UcxEvent::Kind::kReady:
    case UcxEvent::Kind::kSendsDone:
      break;
  }
  return ok();
}

}  // namespace

namespace {

bool ucx_wait_over(const PeerConnection& connection, UcxUntil until) {
  switch (until) {
    case UcxUntil::kArrival:
      return !connection.ucx_arrivals.empty();
    case UcxUntil::kReceived:
      return connection.ucx_received;
    case UcxUntil::kSent:
      return connection.ucx->sends_in_flight() == 0;
    case UcxUntil::kReady:
      return connection.ucx->ready();
  }
  return true;
}

// The peer closed (or reset) the socket: a read would end at once with nothing.
bool peer_closed(PeerConnection& connection) {
  std::byte probe{};
  const auto got = ::recv(connection.socket.native_handle(), &probe, 1, MSG_PEEK | MSG_DONTWAIT);
  return got == 0 || (got < 0 && errno != EAGAIN && errno != EWOULDBLOCK && errno != EINTR);
}

}  // namespace

asio::awaitable<Status> await_ucx(PeerConnection& connection, UcxUntil until, std::chrono::milliseconds timeout,
                                  const char* what, bool socket_may_speak) {
  using namespace asio::experimental::awaitable_operators;
  if (!connection.ucx) co_return fail(ErrorCode::kInternal, "no UCX link on this connection");
  connection.arm(timeout);
  asio::steady_timer expiry(connection.socket.get_executor());
  while (!ucx_wait_over(connection, until)) {
    if (connection.closed) co_return outcome::failure(io_error(connection, asio::error::operation_aborted, what));
    if (socket_may_speak) {
      if (input_pending(connection)) co_return co_await socket_interrupt(connection, timeout, what);
      auto event_wait = connection.ucx->next_event();
      auto socket_wait = connection.socket.async_wait(tcp::socket::wait_read, kNoThrow);
      auto either = co_await (std::move(event_wait) || std::move(socket_wait));
      if (either.index() == 1) {
        const auto [ec] = std::get<1>(either);
        if (ec) co_return outcome::failure(io_error(connection, ec, what));
        // A wait may end with nothing to read (the reactor reports readiness it saw earlier):
        // only bytes or the peer's close end the UCX wait.
        if (!input_pending(connection) && !peer_closed(connection)) continue;
        co_return co_await socket_interrupt(connection, timeout, what);
      }
      auto taken = take_ucx_event(connection, std::get<0>(either), what);
      if (!taken) co_return taken;
      continue;
    }
    // Only UCX can answer: the connection's deadline, enforced here, ends the wait.
    expiry.expires_at(connection.deadline);
    auto event_wait = connection.ucx->next_event();
    auto expiry_wait = expiry.async_wait(kNoThrow);
    auto either = co_await (std::move(event_wait) || std::move(expiry_wait));
    if (either.index() == 1) {
      connection.timed_out = true;
      co_return outcome::failure(io_error(connection, asio::error::timed_out, what));
    }
    auto taken = take_ucx_event(connection, std::get<0>(either), what);
    if (!taken) co_return taken;
  }
  co_return ok();
}

namespace {

// Chunks as active messages on the connection's UCX link, straight from and into the frame (a
// staging buffer would be reused before UCX is done with it); the announcement goes on the socket.
class UcxChunks final : public ChunkTransport {
 public:
  [[nodiscard]] std::string_view name() const noexcept override { return "ucx"; }
  [[nodiscard]] bool stages() const noexcept override { return false; }
  asio::awaitable<Status> send(PeerConnection& connection, std::span<const std::byte> announce,
                               const ChunkPrefix& prefix, std::span<const std::byte> body,
                               std::chrono::milliseconds timeout) const override {
    if (!announce.empty()) {
      auto sent =
          co_await write_all(connection, asio::buffer(announce.data(), announce.size()), asio::const_buffer{}, timeout);
      if (!sent) co_return sent;
    }
    const std::span<const std::byte, kChunkHeaderBytes> chunk_header(prefix.data() + kPeerHeaderBytes,
                                                                     kChunkHeaderBytes);
    co_return connection.ucx->post_chunk(chunk_header, body);
  }
  // Called once every chunk is acknowledged: UCX's own completions, which free the frame, follow.
  asio::awaitable<Status> flush(PeerConnection& connection, std::chrono::milliseconds timeout) const override {
    co_return co_await await_ucx(connection, UcxUntil::kSent, timeout, "UCX send", false);
  }
  asio::awaitable<Status> receive(PeerConnection& connection, std::array<std::byte, kChunkHeaderBytes>& chunk_header,
                                  std::span<std::uint8_t> body, std::uint64_t index,
                                  std::chrono::milliseconds timeout) const override {
    auto arrived = co_await await_ucx(connection, UcxUntil::kArrival, timeout, "UCX chunk", true);
    if (!arrived) co_return arrived;
    const auto arrival = std::move(connection.ucx_arrivals.front());
    connection.ucx_arrivals.pop_front();
    if (arrival->length != body.size()) {
      co_return fail(ErrorCode::kProtocol,
                     fmt::format("chunk {} has {} bytes, expected {}", index, arrival->length, body.size()));
    }
    chunk_header = arrival->header;
    connection.ucx_received = false;
    auto received = connection.ucx->receive(*arrival, body);
    if (!received) co_return outcome::failure(received.error());
    if (received.value()) co_return ok();
    co_return co_await await_ucx(connection, UcxUntil::kReceived, timeout, "UCX chunk body", true);
  }
  // Closes the link at once: its operations still in flight read from or write into the frame.
  void abandon(PeerConnection& connection) const noexcept override {
    if (connection.ucx) connection.ucx->close();
  }
};

const UcxChunks kUcxChunks;

}  // namespace

const ChunkTransport& ucx_chunks() noexcept {
  return kUcxChunks;
}

}  // namespace kvrelay::peer::detail
