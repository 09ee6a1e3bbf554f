#pragma once

// A hostile peer for KV-path tests: a TCP relay in front of a real sidecar's peer listener. It
// splits both directions into peer frames using nothing but the 12-byte frame header (magic,
// version, type, length) and, after a Chunk header, the 20-byte chunk header (transfer id,
// index, checksum): it knows no payload layout, so every message it does not inject on passes
// through unchanged, in both directions, whatever the messages are. On top it can
//
// - stall: hold back the next frame of one kind the sidecar sends (the hello answer, the fetch
//   reply, or a chunk of the KV after it) and let it out in three pieces a `step` apart: the
//   first header byte, the rest of the header, then the payload. Each piece meets its own read
//   in time, so only a deadline over the whole exchange ends the wait; once let out, everything
//   flows, so a client without one gets the KV late instead of missing;
// - inject one fault (one at a time, on whichever connection the matching frame comes):
//   flip one bit of the next frame of a type, cut the stream in the middle of the next frame of
//   a type (or once a number of chunk-body bytes has passed) and close, optionally running an
//   action at the cut (kill a sidecar), or fall silent from the next frame of a type on;
// - accept connections and never answer them at all (a silent peer);
// - change the shared-memory offer or the capabilities in the sidecar's hello (the one place
//   it reads a payload, and only when asked to).
//
// A stream that does not start with the peer magic is relayed as raw bytes.

#include <arpa/inet.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <unistd.h>

#include <array>
#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <cstring>
#include <functional>
#include <memory>
#include <mutex>
#include <optional>
#include <span>
#include <stdexcept>
#include <string>
#include <thread>
#include <vector>

#include "kvrelay/peer/peer_protocol.h"

namespace kvrelay::test {

class StallingRelay {
 public:
  enum class Stall { kNothing, kHello, kFetchReply, kTransfer };
  // kToSidecar: what the connecting client sends to the sidecar behind the relay (a Fetch, a
  // PushEncoded and its chunks); kToClient: what that sidecar answers (FetchReply and its chunks,
  // Committed).
  enum class Direction { kToSidecar = 0, kToClient = 1 };

  // `upstream_port` 0: set it with set_upstream() before the first connection arrives.
  explicit StallingRelay(std::uint16_t upstream_port, std::chrono::milliseconds step = std::chrono::milliseconds(250))
      : upstream_port_(upstream_port), step_(step) {
    listener_ = ::socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
    sockaddr_in address = loopback(0);
    socklen_t length = sizeof(address);
    if (listener_ < 0 || ::bind(listener_, reinterpret_cast<sockaddr*>(&address), length) != 0 ||
        ::listen(listener_, 64) != 0 || ::getsockname(listener_, reinterpret_cast<sockaddr*>(&address), &length) != 0) {
      throw std::runtime_error("stalling relay: cannot listen on loopback");
    }
    port_ = ntohs(address.sin_port);
    acceptor_ = std::thread([this] { accept_loop(); });
  }
  ~StallingRelay() {
    stopping_ = true;
    ::shutdown(listener_, SHUT_RDWR);
    acceptor_.join();
    ::close(listener_);
    std::unique_lock lock(mutex_);
    for (const auto& weak : connections_open_) {
      if (const auto connection = weak.lock()) connection->shut();
    }
    pumps_done_.wait(lock, [this] { return live_pumps_ == 0; });
  }
  StallingRelay(const StallingRelay&) = delete;
  StallingRelay& operator=(const StallingRelay&) = delete;

  [[nodiscard]] std::uint16_t port() const { return port_; }
  // Where connections accepted from now on go (a restarted sidecar listens on a new port).
  void set_upstream(std::uint16_t port) { upstream_port_ = port; }
  // Holds back the next frame of that kind, on whichever connection it comes.
  void stall(Stall stall) {
    std::lock_guard lock(stall_mutex_);
    stall_ = stall;
  }
  // The sidecar's hello answer reaches clients offering `socket_path` as its data plane instead
  // of its own, or no shared memory at all for ""; applies to connections accepted from now on.
  void offer_shared_memory(std::string socket_path) {
    std::lock_guard lock(mutex_);
    offered_socket_ = std::move(socket_path);
  }
  // The sidecar's hello answer reaches clients without these capability bits (an older
  // sidecar, as far as they can tell).
  void strip_capabilities(std::uint64_t bits) { stripped_capabilities_ = bits; }
  // Connections accepted from now on are never connected upstream nor answered: what the
  // client sends is read and dropped, and the connection stays open until the client closes it.
  void silent_accepts(bool silent) { silent_accepts_ = silent; }
  // Paces what goes `direction` to `bytes_per_s` from now on (0: as fast as it comes): a peer
  // whose link slowed down. A frame leaves once the time its bytes take at that rate has passed.
  void pace(Direction direction, double bytes_per_s) {
    pace_bytes_per_s_[static_cast<std::size_t>(direction)] = bytes_per_s;
  }

  // Faults: one is armed at a time (arming replaces one not yet applied); it applies once, to
  // the first frame that matches it in its direction, on whichever connection.
  //
  // Flips bit `bit` (0..7) of byte `byte` of the next frame of `type`, counted from the frame's
  // first header byte (0..11: the frame header; 12..31 of a Chunk: the chunk header). The
  // relay keeps its own framing, so the stream after the frame is what the sidecar sent.
  // `after`: only on the connection where a frame of that type comes next (say, the chunk of the
  // next fetch reply, never a straggler of an exchange already given up).
  void flip_bit(Direction direction, peer::PeerMessage type, std::size_t byte, unsigned bit,
                std::optional<peer::PeerMessage> after = std::nullopt) {
    arm({Fault::kFlip, direction, static_cast<std::uint16_t>(type), byte, bit, 0, {}, after_type(after), 0});
  }
  // Passes the first `keep_bytes` bytes of the next frame of `type` (header included), then
  // closes the connection both ways. `after`: as for flip_bit.
  void cut_frame(Direction direction, peer::PeerMessage type, std::size_t keep_bytes,
                 std::optional<peer::PeerMessage> after = std::nullopt) {
    arm({Fault::kCut, direction, static_cast<std::uint16_t>(type), keep_bytes, 0, 0, {}, after_type(after), 0});
  }
  // Counts the bytes of chunk bodies (a Chunk's payload after its 20-byte header) from now on;
  // once `body_bytes` of them have passed, runs `at_cut` (on the relay's thread, with the rest
  // held back) and closes the connection both ways. What the sidecar at the far end saw is
  // exactly those bytes and then the connection ending, as if its peer died there.
  void cut_after_chunk_bytes(Direction direction, std::uint64_t body_bytes, std::function<void()> at_cut = {}) {
    arm({Fault::kCutAfterChunkBytes, direction, 0, 0, 0, body_bytes, std::move(at_cut), std::nullopt, 0});
  }
  // From the next frame of `type` on, nothing more goes that way on its connection (what comes
  // is read and dropped), and the connection stays open: a peer that stopped answering.
  void silence_from(Direction direction, peer::PeerMessage type) {
    arm({Fault::kSilence, direction, static_cast<std::uint16_t>(type), 0, 0, 0, {}, std::nullopt, 0});
  }
  // Drops an armed fault that has not applied.
  void disarm() {
    std::lock_guard lock(fault_mutex_);
    fault_.reset();
  }
  [[nodiscard]] bool fault_pending() const {
    std::lock_guard lock(fault_mutex_);
    return fault_.has_value();
  }
  // Faults applied so far (an at_cut action has returned by the time it counts).
  [[nodiscard]] int faults_applied() const { return faults_applied_; }

  // TCP connections accepted so far.
  [[nodiscard]] int connections() const { return connections_; }
  // Frames of `type` relayed (or injected on) that way so far, and the payload length of the
  // last one.
  [[nodiscard]] std::uint64_t frames(Direction direction, peer::PeerMessage type) const {
    return counter(frames_, direction, type).load();
  }
  [[nodiscard]] std::uint32_t last_payload_length(Direction direction, peer::PeerMessage type) const {
    return static_cast<std::uint32_t>(counter(last_lengths_, direction, type).load());
  }
  // Bytes of chunk bodies relayed that way so far (a cut one: what was passed of it).
  [[nodiscard]] std::uint64_t chunk_body_bytes(Direction direction) const {
    return chunk_body_bytes_[static_cast<std::size_t>(direction)];
  }

 private:
  static constexpr std::size_t kCountedTypes = 64;
  using Counters = std::array<std::array<std::atomic<std::uint64_t>, kCountedTypes>, 2>;

  struct Fault {
    enum Kind { kFlip, kCut, kCutAfterChunkBytes, kSilence } kind;
    Direction direction;
    std::uint16_t type;
    std::size_t byte;  // kFlip: the byte; kCut: bytes kept
    unsigned bit;
    std::uint64_t chunk_bytes;  // kCutAfterChunkBytes: the budget left
    std::function<void()> at_cut;
    std::optional<std::uint16_t> after;  // a frame of this type binds the fault to its connection
    std::uint64_t connection;            // 0: not bound yet
  };
  // The frame header, read as bytes (little-endian): nothing validated but the magic.
  struct RawHeader {
    std::uint32_t magic = 0;
    std::uint16_t type = 0;
    std::uint32_t length = 0;
  };
  // One relayed connection; its sockets close when both pumps are done with it.
  struct Connection {
    int client = -1;
    int upstream = -1;  // -1: a silent accept
    std::uint64_t id = 0;
    Connection(int client_fd, int upstream_fd, std::uint64_t number)
        : client(client_fd), upstream(upstream_fd), id(number) {}
    ~Connection() {
      ::close(client);
      if (upstream >= 0) ::close(upstream);
    }
    Connection(const Connection&) = delete;
    Connection& operator=(const Connection&) = delete;
    void shut() const {
      ::shutdown(client, SHUT_RDWR);
      if (upstream >= 0) ::shutdown(upstream, SHUT_RDWR);
    }
  };
  using ConnectionPtr = std::shared_ptr<Connection>;

  static sockaddr_in loopback(std::uint16_t port) {
    sockaddr_in address{};
    address.sin_family = AF_INET;
    address.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    address.sin_port = htons(port);
    return address;
  }
  static bool read_exact(int fd, std::span<std::byte> out) {
    std::size_t got = 0;
    while (got < out.size()) {
      const auto n = ::recv(fd, out.data() + got, out.size() - got, 0);
      if (n <= 0) return false;
      got += static_cast<std::size_t>(n);
    }
    return true;
  }
  static bool write_all(int fd, std::span<const std::byte> bytes) {
    std::size_t sent = 0;
    while (sent < bytes.size()) {
      const auto n = ::send(fd, bytes.data() + sent, bytes.size() - sent, MSG_NOSIGNAL);
      if (n <= 0) return false;
      sent += static_cast<std::size_t>(n);
    }
    return true;
  }
  static RawHeader raw_header(std::span<const std::byte> bytes) {
    RawHeader header;
    std::memcpy(&header.magic, bytes.data(), 4);
    std::memcpy(&header.type, bytes.data() + 6, 2);
    std::memcpy(&header.length, bytes.data() + 8, 4);
    return header;
  }
  static bool held_back(Stall stall, std::uint16_t type) {
    using peer::PeerMessage;
    return (stall == Stall::kHello && type == static_cast<std::uint16_t>(PeerMessage::kHelloOk)) ||
           (stall == Stall::kFetchReply && type == static_cast<std::uint16_t>(PeerMessage::kFetchReply)) ||
           (stall == Stall::kTransfer && type == static_cast<std::uint16_t>(PeerMessage::kChunk));
  }
  static std::atomic<std::uint64_t>& counter(Counters& counters, Direction direction, std::uint16_t type) {
    return counters[static_cast<std::size_t>(direction)][type < kCountedTypes ? type : 0];
  }
  static const std::atomic<std::uint64_t>& counter(const Counters& counters, Direction direction,
                                                   peer::PeerMessage type) {
    const auto index = static_cast<std::uint16_t>(type);
    return counters[static_cast<std::size_t>(direction)][index < kCountedTypes ? index : 0];
  }

  static std::optional<std::uint16_t> after_type(std::optional<peer::PeerMessage> type) {
    if (!type) return std::nullopt;
    return static_cast<std::uint16_t>(*type);
  }
  void arm(Fault fault) {
    std::lock_guard lock(fault_mutex_);
    fault_ = std::move(fault);
  }

  void accept_loop() {
    while (!stopping_) {
      const int client = ::accept4(listener_, nullptr, nullptr, SOCK_CLOEXEC);
      if (client < 0) return;
      int upstream = -1;
      if (!silent_accepts_) {
        upstream = ::socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
        const sockaddr_in address = loopback(upstream_port_);
        if (upstream < 0 || ::connect(upstream, reinterpret_cast<const sockaddr*>(&address), sizeof(address)) != 0) {
          ::close(client);
          if (upstream >= 0) ::close(upstream);
          continue;
        }
      }
      ++connections_;
      const auto connection = std::make_shared<Connection>(client, upstream, static_cast<std::uint64_t>(connections_));
      std::lock_guard lock(mutex_);
      std::erase_if(connections_open_, [](const auto& weak) { return weak.expired(); });
      connections_open_.push_back(connection);
      if (upstream < 0) {
        start_pump([connection] { swallow(connection->client); });
        continue;
      }
      start_pump([this, connection] { pump(connection, Direction::kToSidecar, std::nullopt); });
      start_pump([this, connection, offer = offered_socket_] { pump(connection, Direction::kToClient, offer); });
    }
  }
  // Under mutex_. Pumps are detached; the destructor waits for the last one.
  template <class Body>
  void start_pump(Body body) {
    ++live_pumps_;
    std::thread([this, body = std::move(body)]() mutable {
      body();
      std::lock_guard lock(mutex_);
      --live_pumps_;
      pumps_done_.notify_all();
    }).detach();
  }
  // A silent accept: everything the client sends is dropped until it closes.
  static void swallow(int fd) {
    std::array<std::byte, 64 * 1024> sink{};
    while (::recv(fd, sink.data(), sink.size(), 0) > 0) {
    }
  }
  static void pass_raw(int from, int to) {
    std::array<std::byte, 64 * 1024> buffer{};
    while (true) {
      const auto n = ::recv(from, buffer.data(), buffer.size(), 0);
      if (n <= 0 || !write_all(to, std::span(buffer.data(), static_cast<std::size_t>(n)))) break;
    }
  }
  // Whether to hold back this frame: once per stall(). Only what the sidecar answers stalls.
  bool take_stall(Direction direction, std::uint16_t type) {
    if (direction != Direction::kToClient) return false;
    std::lock_guard lock(stall_mutex_);
    if (!held_back(stall_, type)) return false;
    stall_ = Stall::kNothing;
    return true;
  }
  // The armed fault, when this frame is where it applies (taken: it applies once).
  std::optional<Fault> take_fault(Direction direction, std::uint16_t type, std::uint64_t chunk_body,
                                  std::uint64_t connection) {
    std::lock_guard lock(fault_mutex_);
    if (!fault_ || fault_->direction != direction) return std::nullopt;
    if (fault_->after) {
      if (fault_->connection == 0) {
        if (type == *fault_->after) fault_->connection = connection;
        return std::nullopt;
      }
      if (fault_->connection != connection) return std::nullopt;
    }
    if (fault_->kind == Fault::kCutAfterChunkBytes) {
      if (type != static_cast<std::uint16_t>(peer::PeerMessage::kChunk)) return std::nullopt;
      // A chunk that ends before the budget does passes whole; the one it ends in is cut, its
      // first (budget left) bytes kept.
      if (chunk_body < fault_->chunk_bytes) {
        fault_->chunk_bytes -= chunk_body;
        return std::nullopt;
      }
    } else if (fault_->type != type) {
      return std::nullopt;
    }
    auto taken = std::move(fault_);
    fault_.reset();
    return taken;
  }
  void applied() { ++faults_applied_; }

  // One direction of a connection, frame by frame.
  void pump(const ConnectionPtr& connection, Direction direction, const std::optional<std::string>& offered_socket) {
    const int from = direction == Direction::kToSidecar ? connection->client : connection->upstream;
    const int to = direction == Direction::kToSidecar ? connection->upstream : connection->client;
    constexpr std::size_t kHeader = peer::kPeerHeaderBytes;
    constexpr std::size_t kChunkHeader = peer::kChunkHeaderBytes;
    constexpr auto kChunkType = static_cast<std::uint16_t>(peer::PeerMessage::kChunk);
    std::vector<std::byte> frame;
    while (true) {
      frame.resize(kHeader);
      if (!read_exact(from, frame)) break;
      const RawHeader header = raw_header(frame);
      if (header.magic != peer::kPeerMagic || header.length > peer::kMaxChunkBytes + kChunkHeader) {
        // Not peer frames (or not ones we can hold): bytes as they come.
        if (!write_all(to, frame)) break;
        pass_raw(from, to);
        break;
      }
      frame.resize(kHeader + header.length);
      if (!read_exact(from, std::span(frame).subspan(kHeader))) break;
      const bool chunk = header.type == kChunkType && header.length >= kChunkHeader;
      const std::uint64_t chunk_body = chunk ? header.length - kChunkHeader : 0;
      ++counter(frames_, direction, header.type);
      counter(last_lengths_, direction, header.type) = header.length;

      const std::uint64_t stripped = stripped_capabilities_;
      if (direction == Direction::kToClient && (offered_socket || stripped != 0) &&
          header.type == static_cast<std::uint16_t>(peer::PeerMessage::kHelloOk)) {
        auto hello = peer::decode_hello(std::span(frame).subspan(kHeader));
        if (!hello) break;
        if (offered_socket) {
          hello.value().capabilities &= ~peer::kCapSharedMemory;
          if (!offered_socket->empty()) hello.value().capabilities |= peer::kCapSharedMemory;
          hello.value().shm_socket = *offered_socket;
        }
        hello.value().capabilities &= ~stripped;
        frame = peer::encode_hello(peer::PeerMessage::kHelloOk, hello.value());
      }

      if (auto fault = take_fault(direction, header.type, chunk_body, connection->id)) {
        switch (fault->kind) {
          case Fault::kFlip:
            if (fault->byte < frame.size()) {
              frame[fault->byte] ^= static_cast<std::byte>(1U << (fault->bit & 7U));
              applied();
            }
            break;  // the frame goes on, flipped
          case Fault::kCut:
            write_all(to, std::span(frame).first(std::min(fault->byte, frame.size())));
            applied();
            connection->shut();
            return;
          case Fault::kCutAfterChunkBytes: {
            const auto kept = static_cast<std::size_t>(fault->chunk_bytes);  // what is left of the budget
            write_all(to, std::span(frame).first(kHeader + kChunkHeader + kept));
            chunk_body_bytes_[static_cast<std::size_t>(direction)] += kept;
            if (fault->at_cut) fault->at_cut();
            applied();
            connection->shut();
            return;
          }
          case Fault::kSilence:
            applied();
            swallow(from);  // until the sidecar closes (or the relay shuts the connection)
            connection->shut();
            return;
        }
      }
      chunk_body_bytes_[static_cast<std::size_t>(direction)] += chunk_body;

      bool sent = true;
      if (take_stall(direction, header.type)) {
        const std::span<const std::byte> bytes(frame);
        for (const auto piece : {bytes.first(1), bytes.subspan(1, kHeader - 1), bytes.subspan(kHeader)}) {
          std::this_thread::sleep_for(step_);
          sent = sent && write_all(to, piece);
        }
      } else {
        const double rate = pace_bytes_per_s_[static_cast<std::size_t>(direction)];
        if (rate > 0.0)
          std::this_thread::sleep_for(std::chrono::duration<double>(static_cast<double>(frame.size()) / rate));
        sent = write_all(to, frame);
      }
      if (!sent) break;
    }
    connection->shut();
  }

  std::atomic<std::uint16_t> upstream_port_;
  std::chrono::milliseconds step_;
  int listener_ = -1;
  std::uint16_t port_ = 0;
  std::atomic<bool> stopping_{false};
  std::atomic<bool> silent_accepts_{false};
  std::array<std::atomic<double>, 2> pace_bytes_per_s_{};
  std::mutex stall_mutex_;
  Stall stall_ = Stall::kNothing;
  mutable std::mutex fault_mutex_;
  std::optional<Fault> fault_;
  std::atomic<int> faults_applied_{0};
  std::optional<std::string> offered_socket_;  // guarded by mutex_; nullopt: the sidecar's own offer
  std::atomic<int> connections_{0};
  std::atomic<std::uint64_t> stripped_capabilities_{0};
  Counters frames_{};
  Counters last_lengths_{};
  std::array<std::atomic<std::uint64_t>, 2> chunk_body_bytes_{};
  std::mutex mutex_;
  std::condition_variable pumps_done_;
  int live_pumps_ = 0;                                       // guarded by mutex_
  std::vector<std::weak_ptr<Connection>> connections_open_;  // guarded by mutex_
  std::thread acceptor_;
};

}  // namespace kvrelay::test
