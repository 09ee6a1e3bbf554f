#pragma once

// Idle keep-alive connections to upstream workers, reused across requests so a proxied request
// costs no connect (and no name resolution for IP literals). Bounded per upstream.

#include <boost/asio/ip/tcp.hpp>

#include <cstddef>
#include <map>
#include <mutex>
#include <optional>
#include <string>
#include <vector>

namespace kvrelay::proxy {

class UpstreamPool {
 public:
  explicit UpstreamPool(std::size_t max_idle_per_upstream = 64) : max_idle_(max_idle_per_upstream) {}

  // An idle connection to host:port that still looks open, if any.
  [[nodiscard]] std::optional<boost::asio::ip::tcp::socket> take(const std::string& host, std::uint16_t port);
  // Returns a connection whose last response completed with keep-alive.
  void give_back(const std::string& host, std::uint16_t port, boost::asio::ip::tcp::socket socket);

  [[nodiscard]] std::size_t idle_count() const;

 private:
  std::size_t max_idle_;
  mutable std::mutex mutex_;
  std::map<std::string, std::vector<boost::asio::ip::tcp::socket>> idle_;
};

}  // namespace kvrelay::proxy
