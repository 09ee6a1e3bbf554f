// kvrelay_client_options.reply_timeout_ms (ABI 6): a sidecar that stops answering without dying
// (SIGSTOP here, a real sidecar process) costs each call that long, the connect handshake's
// included, and the client then takes no further calls.
#include <signal.h>

#include <catch2/catch.hpp>

#include <chrono>
#include <cstring>
#include <fstream>
#include <string>
#include <thread>
#include <vector>

#include "kvrelay/shm_transport/kvrelay_client.h"

#include "shm_fixture.h"

using namespace kvrelay;
using namespace kvrelay::test;

namespace {

kvrelay_client_options timeout_options(std::uint32_t reply_timeout_ms) {
  kvrelay_client_options options{};
  options.struct_size = sizeof(options);
  options.memory_strategy = KVRELAY_MEMORY_PORTABLE;
  options.reply_timeout_ms = reply_timeout_ms;
  return options;
}

// The state letter of /proc/<pid>/stat ('T' once stopped).
char process_state(pid_t pid) {
  std::ifstream stat("/proc/" + std::to_string(pid) + "/stat");
  std::string line;
  std::getline(stat, line);
  const auto paren = line.rfind(')');
  return paren == std::string::npos || paren + 2 >= line.size() ? '?' : line[paren + 2];
}

// Stops the sidecar for the scope (and waits until it is stopped: kill only queues the signal),
// so a failing check cannot leave it stopped for the next one.
class StoppedSidecar {
 public:
  explicit StoppedSidecar(pid_t pid) : pid_(pid) {
    REQUIRE(::kill(pid_, SIGSTOP) == 0);
    const auto give_up = std::chrono::steady_clock::now() + std::chrono::seconds(10);
    while (process_state(pid_) != 'T' && std::chrono::steady_clock::now() < give_up)
      std::this_thread::sleep_for(std::chrono::milliseconds(1));
    REQUIRE(process_state(pid_) == 'T');
  }
  ~StoppedSidecar() { ::kill(pid_, SIGCONT); }
  StoppedSidecar(const StoppedSidecar&) = delete;
  StoppedSidecar& operator=(const StoppedSidecar&) = delete;

 private:
  pid_t pid_;
};

}  // namespace

TEST_CASE("A stopped sidecar costs a connect reply_timeout_ms and a timeout code, not a minute", "[shm][c_abi]") {
  ServerProcess server;
  const auto options = timeout_options(200);
  kvrelay_client* client = nullptr;
  {
    StoppedSidecar stopped(server.pid());
    CHECK(kvrelay_client_connect_with_options(server.socket_path().c_str(), &options, &client) == KVRELAY_E_TIMEOUT);
    CHECK(client == nullptr);
  }
  // Running again: the same options connect, and so do the version-3 struct and the default.
  REQUIRE(kvrelay_client_connect_with_options(server.socket_path().c_str(), &options, &client) == KVRELAY_OK);
  kvrelay_client_close(client);
  kvrelay_client_options old{};
  old.struct_size = KVRELAY_CLIENT_OPTIONS_SIZE_V3;
  old.memory_strategy = KVRELAY_MEMORY_PORTABLE;
  old.reply_timeout_ms = 0xDEADBEEF;  // past the old struct's end: never read
  REQUIRE(kvrelay_client_connect_with_options(server.socket_path().c_str(), &old, &client) == KVRELAY_OK);
  kvrelay_client_close(client);
  const auto zero = timeout_options(0);
  REQUIRE(kvrelay_client_connect_with_options(server.socket_path().c_str(), &zero, &client) == KVRELAY_OK);
  kvrelay_client_close(client);
  auto odd = timeout_options(200);
  odd.struct_size = 10;
  CHECK(kvrelay_client_connect_with_options(server.socket_path().c_str(), &odd, &client) == KVRELAY_E_INVALID_ARGUMENT);
}

TEST_CASE("Alloc, commit and resolve to a sidecar stopped after connect time out, then the client refuses calls",
          "[shm][c_abi]") {
  const std::uint64_t arena_bytes = GENERATE(std::uint64_t{0}, std::uint64_t{16} << 20);
  INFO("arena bytes " << arena_bytes);
  shm::ShmServerOptions server_options;
  server_options.arena_bytes = arena_bytes;
  ServerProcess server(server_options);
  // Long enough that a sidecar slowed by a loaded machine still answers the calls made while it
  // runs (200 ms failed the setup's connects under a parallel ctest), short enough to wait out.
  const auto options = timeout_options(1000);
  kvrelay_client* allocating = nullptr;
  kvrelay_client* committing = nullptr;
  kvrelay_client* resolving = nullptr;
  REQUIRE(kvrelay_client_connect_with_options(server.socket_path().c_str(), &options, &allocating) == KVRELAY_OK);
  REQUIRE(kvrelay_client_connect_with_options(server.socket_path().c_str(), &options, &committing) == KVRELAY_OK);
  REQUIRE(kvrelay_client_connect_with_options(server.socket_path().c_str(), &options, &resolving) == KVRELAY_OK);
  const kvrelay_layout layout{1, 1, 8, KVRELAY_DTYPE_FP16, 4};  // 64 bytes
  kvrelay_region* written = nullptr;
  REQUIRE(kvrelay_region_alloc(committing, 64, &written) == KVRELAY_OK);
  std::memset(kvrelay_region_data(written), 7, 64);
  {
    StoppedSidecar stopped(server.pid());
    kvrelay_region* region = nullptr;
    CHECK(kvrelay_region_alloc(allocating, 64, &region) == KVRELAY_E_TIMEOUT);
    CHECK(region == nullptr);
    CHECK(kvrelay_region_alloc(allocating, 64, &region) == KVRELAY_E_IO);  // no further calls: reconnect

    const kvrelay_key key{3, 4};
    CHECK(kvrelay_region_commit(committing, written, &key, &layout) == KVRELAY_E_TIMEOUT);
    const std::vector<std::byte> bytes(64);
    CHECK(kvrelay_publish(committing, &key, &layout, bytes.data(), bytes.size()) == KVRELAY_E_IO);

    // timeout_ms 0: the client's reply_timeout_ms bounds the resolve too.
    const std::vector<std::uint32_t> ids(32, 9);
    kvrelay_resolve_request request{};
    request.struct_size = sizeof(request);
    request.block_tokens = 16;
    request.model_id = 3;
    request.root = KVRELAY_ROOT_BLOCK_HASH;
    request.tokens = ids.data();
    request.count = ids.size();
    kvrelay_resolved resolved{};
    resolved.struct_size = sizeof(resolved);
    kvrelay_entry* entry = nullptr;
    CHECK(kvrelay_resolve(resolving, &request, &resolved, &entry) == KVRELAY_E_TIMEOUT);
  }
  kvrelay_client_close(resolving);
  kvrelay_client_close(committing);
  kvrelay_client_close(allocating);
  // The sidecar itself is fine: a fresh client works.
  kvrelay_client* fresh = nullptr;
  REQUIRE(kvrelay_client_connect_with_options(server.socket_path().c_str(), &options, &fresh) == KVRELAY_OK);
  kvrelay_region* region = nullptr;
  CHECK(kvrelay_region_alloc(fresh, 64, &region) == KVRELAY_OK);
  CHECK(kvrelay_region_abort(fresh, region) == KVRELAY_OK);
  kvrelay_client_close(fresh);
}
