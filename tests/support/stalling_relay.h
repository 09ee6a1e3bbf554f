#pragma once

// A hostile peer for lookup-deadline tests: a TCP relay in front of a real sidecar's peer
// listener that holds back the next frame of one kind the sidecar sends (the hello answer, the
// fetch reply, or a chunk of the KV after it) and lets it out in three pieces a `step` apart: the first
// header byte, the rest of the header, then the payload. Each piece meets its own read in time,
// so only a deadline over the whole exchange ends the wait; once let out, everything flows, so
// a client without one gets the KV late instead of missing. Every other byte passes through,
// except that it can also change the shared-memory offer in the sidecar's hello.

#include <arpa/inet.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <unistd.h>

#include <array>
#include <atomic>
#include <chrono>
#include <cstdint>
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

  StallingRelay(std::uint16_t upstream_port, std::chrono::milliseconds step)
      : upstream_port_(upstream_port), step_(step) {
    listener_ = ::socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
    sockaddr_in address = loopback(0);
    socklen_t length = sizeof(address);
    if (listener_ < 0 || ::bind(listener_, reinterpret_cast<sockaddr*>(&address), length) != 0 ||
        ::listen(listener_, 16) != 0 || ::getsockname(listener_, reinterpret_cast<sockaddr*>(&address), &length) != 0) {
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
    std::lock_guard lock(mutex_);
    for (const int fd : sockets_)
      ::shutdown(fd, SHUT_RDWR);
    for (auto& thread : pumps_)
      thread.join();
    for (const int fd : sockets_)
      ::close(fd);
  }
  StallingRelay(const StallingRelay&) = delete;
  StallingRelay& operator=(const StallingRelay&) = delete;

  [[nodiscard]] std::uint16_t port() const { return port_; }
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
  // TCP connections accepted so far.
  [[nodiscard]] int connections() const { return connections_; }

 private:
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
  static bool held_back(Stall stall, peer::PeerMessage type) {
    using peer::PeerMessage;
    return (stall == Stall::kHello && type == PeerMessage::kHelloOk) ||
           (stall == Stall::kFetchReply && type == PeerMessage::kFetchReply) ||
           (stall == Stall::kTransfer && type == PeerMessage::kChunk);
  }

  void accept_loop() {
    while (!stopping_) {
      const int client = ::accept4(listener_, nullptr, nullptr, SOCK_CLOEXEC);
      if (client < 0) return;
      const int upstream = ::socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
      const sockaddr_in address = loopback(upstream_port_);
      if (upstream < 0 || ::connect(upstream, reinterpret_cast<const sockaddr*>(&address), sizeof(address)) != 0) {
        ::close(client);
        if (upstream >= 0) ::close(upstream);
        continue;
      }
      ++connections_;
      std::lock_guard lock(mutex_);
      sockets_.insert(sockets_.end(), {client, upstream});
      pumps_.emplace_back([client, upstream] { pass_through(client, upstream); });
      pumps_.emplace_back([this, client, upstream, offer = offered_socket_] { answer(upstream, client, offer); });
    }
  }
  // What the client sends goes to the sidecar as it comes.
  static void pass_through(int from, int to) {
    std::array<std::byte, 64 * 1024> buffer{};
    while (true) {
      const auto n = ::recv(from, buffer.data(), buffer.size(), 0);
      if (n <= 0 || !write_all(to, std::span(buffer.data(), static_cast<std::size_t>(n)))) break;
    }
    ::shutdown(to, SHUT_RDWR);
    ::shutdown(from, SHUT_RDWR);
  }
  // Whether to hold back this frame: once per stall().
  bool take_stall(peer::PeerMessage type) {
    std::lock_guard lock(stall_mutex_);
    if (!held_back(stall_, type)) return false;
    stall_ = Stall::kNothing;
    return true;
  }
  // The sidecar's frames go to the client whole, except one that stall() asked for.
  void answer(int from, int to, const std::optional<std::string>& offered_socket) {
    std::vector<std::byte> frame;
    while (true) {
      frame.resize(peer::kPeerHeaderBytes);
      if (!read_exact(from, frame)) break;
      const auto header = peer::decode_peer_header(
          std::span<const std::byte, peer::kPeerHeaderBytes>(frame.data(), peer::kPeerHeaderBytes));
      if (!header) break;
      frame.resize(peer::kPeerHeaderBytes + header.value().length);
      if (!read_exact(from, std::span(frame).subspan(peer::kPeerHeaderBytes))) break;
      const std::uint64_t stripped = stripped_capabilities_;
      if ((offered_socket || stripped != 0) && header.value().type == peer::PeerMessage::kHelloOk) {
        auto hello = peer::decode_hello(std::span(frame).subspan(peer::kPeerHeaderBytes));
        if (!hello) break;
        if (offered_socket) {
          hello.value().capabilities &= ~peer::kCapSharedMemory;
          if (!offered_socket->empty()) hello.value().capabilities |= peer::kCapSharedMemory;
          hello.value().shm_socket = *offered_socket;
        }
        hello.value().capabilities &= ~stripped;
        frame = peer::encode_hello(peer::PeerMessage::kHelloOk, hello.value());
      }
      bool sent = true;
      if (take_stall(header.value().type)) {
        const std::span<const std::byte> bytes(frame);
        for (const auto piece : {bytes.first(1), bytes.subspan(1, peer::kPeerHeaderBytes - 1),
                                 bytes.subspan(peer::kPeerHeaderBytes)}) {
          std::this_thread::sleep_for(step_);
          sent = sent && write_all(to, piece);
        }
      } else {
        sent = write_all(to, frame);
      }
      if (!sent) break;
    }
    ::shutdown(to, SHUT_RDWR);
    ::shutdown(from, SHUT_RDWR);
  }

  std::uint16_t upstream_port_;
  std::chrono::milliseconds step_;
  int listener_ = -1;
  std::uint16_t port_ = 0;
  std::atomic<bool> stopping_{false};
  std::mutex stall_mutex_;
  Stall stall_ = Stall::kNothing;
  std::optional<std::string> offered_socket_;  // guarded by mutex_; nullopt: the sidecar's own offer
  std::atomic<int> connections_{0};
  std::atomic<std::uint64_t> stripped_capabilities_{0};
  std::mutex mutex_;
  std::vector<int> sockets_;
  std::vector<std::thread> pumps_;
  std::thread acceptor_;
};

}  // namespace kvrelay::test
