#pragma once

// TLS 1.3 with mutual authentication for the peer plane (issue #25): this node's certificate
// and key, the CA bundle that says who may connect, and what a handshake learnt of the other
// side's certificate. The context is rebuilt when its files change (SIGHUP, or a changed mtime,
// size or inode: Kubernetes swaps a Secret's symlink); a bad file keeps the context in use.

#include <chrono>
#include <memory>
#include <mutex>
#include <string>
#include <string_view>
#include <vector>

#include "kvrelay/core/policy.h"
#include "kvrelay/core/result.h"

namespace boost::asio::ssl {
class context;
}  // namespace boost::asio::ssl

namespace kvrelay::peer {

// What a handshake verified of the other side's certificate.
struct PeerCertificate {
  std::vector<std::string> names;  // its DNS, URI (SPIFFE IDs) and IP subject alternative names
  std::chrono::system_clock::time_point not_after{};
};
// True when the certificate names `identity` (an exact SAN match).
[[nodiscard]] bool names_identity(const PeerCertificate& certificate, std::string_view identity);
// Seconds from now until `when` (negative once past).
[[nodiscard]] double seconds_until(std::chrono::system_clock::time_point when);

class PeerTls {
 public:
  using Context = boost::asio::ssl::context;
  // Loads `files`. A certificate and key of "" make a context that presents none: the policy
  // never allows it (peer_tls sets all three files); tests use it to play a peer without one.
  [[nodiscard]] static Result<std::shared_ptr<PeerTls>> load(const PeerTlsPolicy& files);

  // The context new connections use; connections keep the one they started with.
  [[nodiscard]] std::shared_ptr<Context> context() const;
  // Rebuilds the context from the files; on failure the old one stays and the error says why.
  [[nodiscard]] Status reload();
  // reload() when a file changed since the last attempt; true when it reloaded.
  [[nodiscard]] Result<bool> reload_if_changed();
  // This node's certificate's notAfter.
  [[nodiscard]] std::chrono::system_clock::time_point not_after() const;

 private:
  explicit PeerTls(PeerTlsPolicy files) : files_(std::move(files)) {}
  [[nodiscard]] std::string stamp() const;  // mtime, size and inode of each file

  const PeerTlsPolicy files_;
  mutable std::mutex mutex_;
  std::shared_ptr<Context> context_;
  std::chrono::system_clock::time_point not_after_{};
  std::string stamp_;
};

}  // namespace kvrelay::peer
