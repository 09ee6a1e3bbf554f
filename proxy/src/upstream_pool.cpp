#include "kvrelay/proxy/upstream_pool.h"

#include <sys/socket.h>

#include <fmt/format.h>

namespace kvrelay::proxy {

namespace {

// A connection the upstream closed while idle reads as EOF (or has stray bytes): either way it
// must not carry the next request.
bool looks_reusable(boost::asio::ip::tcp::socket& socket) {
  char byte = 0;
  const auto received = ::recv(socket.native_handle(), &byte, 1, MSG_PEEK | MSG_DONTWAIT);
  return received < 0 && (errno == EAGAIN || errno == EWOULDBLOCK);
}

}  // namespace

std::optional<boost::asio::ip::tcp::socket> UpstreamPool::take(const std::string& host, std::uint16_t port) {
  const std::lock_guard lock(mutex_);
  auto found = idle_.find(fmt::format("{}:{}", host, port));
  if (found == idle_.end()) return std::nullopt;
  auto& sockets = found->second;
  while (!sockets.empty()) {
    auto socket = std::move(sockets.back());
    sockets.pop_back();
    if (looks_reusable(socket)) return socket;
    boost::system::error_code ignored;
    socket.close(ignored);
  }
  return std::nullopt;
}

void UpstreamPool::give_back(const std::string& host, std::uint16_t port, boost::asio::ip::tcp::socket socket) {
  const std::lock_guard lock(mutex_);
  auto& sockets = idle_[fmt::format("{}:{}", host, port)];
  if (sockets.size() >= max_idle_) return;  // dropping it closes it
  sockets.push_back(std::move(socket));
}

std::size_t UpstreamPool::idle_count() const {
  const std::lock_guard lock(mutex_);
  std::size_t count = 0;
  for (const auto& [key, sockets] : idle_)
    count += sockets.size();
  return count;
}

}  // namespace kvrelay::proxy
