#pragma once

// A real sidecar data plane in a forked child process, so tests talk to it over a real Unix
// socket and real shared memory, can count its fds, and can kill their own client processes
// without taking the server down.

#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <catch2/catch.hpp>

#include <cstdint>
#include <filesystem>
#include <string>
#include <vector>

#include "kvrelay/shm_transport/client.h"
#include "kvrelay/shm_transport/server.h"

#include "support/test_paths.h"

namespace kvrelay::test {

inline std::size_t count_fds(pid_t pid) {
  std::size_t count = 0;
  for ([[maybe_unused]] const auto& entry :
       std::filesystem::directory_iterator("/proc/" + std::to_string(pid) + "/fd")) {
    ++count;
  }
  return count;
}

// Counts the fds of `pid` that are memfds named like `name` (e.g. "kvrelay-region").
inline std::size_t count_memfds(pid_t pid, const std::string& name) {
  std::size_t count = 0;
  for (const auto& entry : std::filesystem::directory_iterator("/proc/" + std::to_string(pid) + "/fd")) {
    std::error_code ec;
    const auto target = std::filesystem::read_symlink(entry.path(), ec).string();
    if (!ec && target.find("memfd:" + name) != std::string::npos) ++count;
  }
  return count;
}

class ServerProcess {
 public:
  explicit ServerProcess(shm::ShmServerOptions options = {}, std::uint64_t store_bytes = 1ULL << 30) {
    if (options.socket_path.empty()) options.socket_path = (dir_ / "kvrelay.sock").string();
    socket_path_ = options.socket_path;
    int ready[2];
    REQUIRE(::pipe(ready) == 0);
    pid_ = ::fork();
    REQUIRE(pid_ >= 0);
    if (pid_ == 0) {
      ::close(ready[0]);
      auto server = shm::ShmServer::listen(options, std::make_shared<kv_store::InMemoryEntryStore>(store_bytes));
      const char status = server ? 'y' : 'n';
      [[maybe_unused]] auto written = ::write(ready[1], &status, 1);
      ::close(ready[1]);
      if (server) server.value()->run();
      ::_exit(server ? 0 : 1);
    }
    ::close(ready[1]);
    char status = 'n';
    const auto got = ::read(ready[0], &status, 1);
    ::close(ready[0]);
    REQUIRE(got == 1);
    REQUIRE(status == 'y');
  }
  ~ServerProcess() {
    ::kill(pid_, SIGKILL);
    int status = 0;
    ::waitpid(pid_, &status, 0);
  }
  ServerProcess(const ServerProcess&) = delete;
  ServerProcess& operator=(const ServerProcess&) = delete;

  [[nodiscard]] pid_t pid() const { return pid_; }
  [[nodiscard]] const std::string& socket_path() const { return socket_path_; }
  [[nodiscard]] shm::ShmClient connect() const {
    auto client = shm::ShmClient::connect(socket_path_);
    if (!client) FAIL("connect: " << client.error().to_string());
    return std::move(client).value();
  }

 private:
  TempDir dir_;
  std::string socket_path_;
  pid_t pid_ = -1;
};

// Deterministic test bytes: a cheap LCG stream, different per seed.
inline std::vector<std::byte> pattern_bytes(std::size_t size, std::uint64_t seed) {
  std::vector<std::byte> bytes(size);
  std::uint64_t state = seed * 6364136223846793005ULL + 1442695040888963407ULL;
  for (std::size_t index = 0; index < size; ++index) {
    state = state * 6364136223846793005ULL + 1442695040888963407ULL;
    bytes[index] = static_cast<std::byte>(state >> 56);
  }
  return bytes;
}

}  // namespace kvrelay::test
