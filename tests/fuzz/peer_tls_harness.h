#pragma once

// fuzz_peer_tls_session's fixture: a real PeerServer with mutual TLS 1.3 in this process (made
// once: certificates by scripts/make-dev-certs.sh into a temporary directory, node-a's policy,
// an in-memory store holding one KV entry, the built-in codecs), and a TLS client that connects
// as node-b. Any failure to set it up aborts: a fuzz target has no other way to report one.

#include <boost/asio/io_context.hpp>
#include <boost/asio/ip/tcp.hpp>
#include <boost/asio/ssl/stream.hpp>

#include <chrono>
#include <cstddef>
#include <filesystem>
#include <memory>
#include <span>
#include <thread>
#include <vector>

#include "kvrelay/kv_store/entry_store.h"
#include "kvrelay/peer/peer_server.h"
#include "kvrelay/peer/peer_tls.h"

namespace kvrelay::fuzz {

class TlsSessionServer {
 public:
  // The process's server, started on first use and stopped at exit.
  static TlsSessionServer& instance();
  ~TlsSessionServer();
  TlsSessionServer(const TlsSessionServer&) = delete;
  TlsSessionServer& operator=(const TlsSessionServer&) = delete;

  [[nodiscard]] boost::asio::ip::tcp::endpoint endpoint() const { return server_->local_endpoint(); }
  // node-b's TLS, which the server accepts.
  [[nodiscard]] std::shared_ptr<peer::PeerTls::Context> client_context() const { return client_tls_->context(); }
  [[nodiscard]] peer::PeerServerStats stats() const { return server_->stats(); }
  // Back to the held entry alone, so that no input depends on what an earlier one filed.
  void reset_store();

 private:
  TlsSessionServer();

  std::filesystem::path cert_dir_;
  std::shared_ptr<peer::PeerTls> client_tls_;
  std::shared_ptr<kv_store::InMemoryEntryStore> store_;
  std::shared_ptr<const kv_store::StoredEntry> held_;
  boost::asio::io_context io_;
  std::unique_ptr<peer::PeerServer> server_;
  std::thread thread_;
};

// One TLS connection to the server, driven from the calling thread; every wait is bounded.
class TlsSessionClient {
 public:
  explicit TlsSessionClient(const TlsSessionServer& server);
  // Connects and completes the TLS handshake within `limit`.
  [[nodiscard]] bool handshake(std::chrono::milliseconds limit);
  // Writes `bytes` and then ends the TCP stream's sending half, reading what the server sends
  // meanwhile; returns once the server closed, or false when `limit` passed first.
  [[nodiscard]] bool exchange(std::span<const std::byte> bytes, std::chrono::milliseconds limit);
  [[nodiscard]] const std::vector<std::byte>& received() const { return received_; }

 private:
  void read_more();

  boost::asio::io_context io_;
  boost::asio::ip::tcp::endpoint endpoint_;
  std::shared_ptr<peer::PeerTls::Context> context_;
  boost::asio::ssl::stream<boost::asio::ip::tcp::socket> stream_;
  std::vector<std::byte> received_;
  std::vector<std::byte> buffer_ = std::vector<std::byte>(16 << 10);
  bool closed_ = false;
};

}  // namespace kvrelay::fuzz
