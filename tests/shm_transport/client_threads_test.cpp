// The client library runs inside the inference engine's process: it starts no thread there
// unless the caller asks for one (MemoryStrategy::kPrefault, C++ or C ABI). The sidecar runs in a
// forked child, so every thread in /proc/self/task is the test's or the library's.

#include <catch2/catch.hpp>

#include <cstring>
#include <filesystem>
#include <fstream>
#include <string>

#include "kvrelay/kv_store/memory_strategy.h"
#include "kvrelay/shm_transport/kvrelay_client.h"

#include "shm_fixture.h"

namespace kvrelay::test {

namespace {

// Large enough that a paced prefault of the client's mapping outlasts the check after the
// allocation that started it by far.
constexpr std::uint64_t kThreadTestArenaBytes = 256ULL << 20;

std::size_t count_threads() {
  std::size_t count = 0;
  for ([[maybe_unused]] const auto& task : std::filesystem::directory_iterator("/proc/self/task"))
    ++count;
  return count;
}

std::size_t count_warmer_threads() {
  std::size_t count = 0;
  for (const auto& task : std::filesystem::directory_iterator("/proc/self/task")) {
    std::ifstream comm(task.path() / "comm");
    std::string name;
    if (std::getline(comm, name) && name == kv_store::kPageWarmerThreadName) ++count;
  }
  return count;
}

shm::ShmServerOptions arena_server_options() {
  shm::ShmServerOptions options;
  options.arena_bytes = kThreadTestArenaBytes;
  // The sidecar's own warmer runs in the child; it must not matter here.
  options.memory_strategy = MemoryStrategy::kPrefault;
  return options;
}

// Publishes, looks up (a hit and a miss) and sends a small message through the C++ client.
void exercise_client(shm::ShmClient& client, std::uint64_t context) {
  const auto bytes = pattern_bytes(1U << 20, context);
  const kv_store::EntryKey key{9, context};
  REQUIRE(client.publish(key, KvLayout{}, bytes).has_value());
  auto region = client.allocate(4096);
  REQUIRE(region.has_value());
  std::memset(region.value().bytes().data(), 1, 4096);
  REQUIRE(client.commit_written(std::move(region).value(), {9, context + 1}, KvLayout{}).has_value());
  {
    auto entry = client.lookup(key);
    REQUIRE(entry.has_value());
    CHECK(entry.value().in_arena());
  }
  CHECK(client.lookup({9, context + 2}).error().code == ErrorCode::kNotFound);
  std::byte answer[8];
  const std::byte ping[4] = {std::byte{1}, std::byte{2}, std::byte{3}, std::byte{4}};
  REQUIRE(client.ring_call(ping, answer).has_value());
  REQUIRE(client.release_leases().has_value());
}

// The same through the C ABI.
void exercise_client(kvrelay_client* client, std::uint64_t context) {
  const auto bytes = pattern_bytes(1U << 20, context);
  const kvrelay_key key{9, context};
  const kvrelay_layout opaque{0, 0, 0, 0, 0};
  REQUIRE(kvrelay_publish(client, &key, &opaque, bytes.data(), bytes.size()) == KVRELAY_OK);
  kvrelay_entry* entry = nullptr;
  REQUIRE(kvrelay_lookup(client, &key, &entry) == KVRELAY_OK);
  CHECK(kvrelay_entry_size(entry) == bytes.size());
  kvrelay_entry_release(entry);
  const kvrelay_key missing{9, context + 1};
  CHECK(kvrelay_lookup(client, &missing, &entry) == KVRELAY_E_NOT_FOUND);
  char answer[8];
  std::size_t answer_size = 0;
  REQUIRE(kvrelay_small_call(client, "ping", 4, answer, sizeof(answer), &answer_size) == KVRELAY_OK);
  REQUIRE(kvrelay_release_leases(client) == KVRELAY_OK);
}

}  // namespace

TEST_CASE("the client library starts no thread in the caller's process by default", "[shm][threads][c_abi]") {
  ServerProcess server(arena_server_options());
  const std::size_t before = count_threads();
  {
    auto client = server.connect();
    exercise_client(client, 100);
    CHECK(count_threads() == before);
    shm::ShmClientOptions options;  // the defaults, spelled out
    auto explicit_defaults = shm::ShmClient::connect(server.socket_path(), options);
    REQUIRE(explicit_defaults.has_value());
    exercise_client(explicit_defaults.value(), 200);
    CHECK(count_threads() == before);
  }
  kvrelay_client* plain = nullptr;
  REQUIRE(kvrelay_client_connect(server.socket_path().c_str(), &plain) == KVRELAY_OK);
  exercise_client(plain, 300);
  CHECK(count_threads() == before);
  kvrelay_client_close(plain);

  kvrelay_client_options portable;
  std::memset(&portable, 0, sizeof(portable));
  portable.struct_size = sizeof(portable);
  portable.memory_strategy = KVRELAY_MEMORY_PORTABLE;
  kvrelay_client* with_options = nullptr;
  REQUIRE(kvrelay_client_connect_with_options(server.socket_path().c_str(), &portable, &with_options) == KVRELAY_OK);
  exercise_client(with_options, 400);
  CHECK(count_threads() == before);
  kvrelay_client_close(with_options);
  kvrelay_client* null_options = nullptr;
  REQUIRE(kvrelay_client_connect_with_options(server.socket_path().c_str(), nullptr, &null_options) == KVRELAY_OK);
  exercise_client(null_options, 500);
  CHECK(count_threads() == before);
  kvrelay_client_close(null_options);
  CHECK(count_warmer_threads() == 0);
}

TEST_CASE("a client asked to prefault runs one warming thread for the arena it maps, joined on close",
          "[shm][threads]") {
  ServerProcess server(arena_server_options());
  const std::size_t before = count_threads();
  {
    shm::ShmClientOptions options;
    options.memory_strategy = MemoryStrategy::kPrefault;
    auto client = shm::ShmClient::connect(server.socket_path(), options);
    REQUIRE(client.has_value());
    CHECK(count_threads() == before);  // nothing mapped yet
    auto region = client.value().allocate(4096);
    REQUIRE(region.has_value());
    REQUIRE(region.value().in_arena());
    CHECK(count_warmer_threads() == 1);
    CHECK(count_threads() == before + 1);
    REQUIRE(client.value().abort(std::move(region).value()).has_value());
    exercise_client(client.value(), 600);  // the same arena: still one thread at most
    CHECK(count_warmer_threads() <= 1);
  }
  CHECK(count_threads() == before);
}

TEST_CASE("a C ABI client asked to prefault runs one warming thread, and bad options are refused",
          "[shm][threads][c_abi]") {
  ServerProcess server(arena_server_options());
  const std::size_t before = count_threads();
  kvrelay_client_options options;
  std::memset(&options, 0, sizeof(options));
  options.struct_size = sizeof(options);
  options.memory_strategy = KVRELAY_MEMORY_PREFAULT;
  kvrelay_client* client = nullptr;
  REQUIRE(kvrelay_client_connect_with_options(server.socket_path().c_str(), &options, &client) == KVRELAY_OK);
  CHECK(count_threads() == before);
  kvrelay_region* region = nullptr;
  REQUIRE(kvrelay_region_alloc(client, 4096, &region) == KVRELAY_OK);
  CHECK(count_warmer_threads() == 1);
  CHECK(count_threads() == before + 1);
  REQUIRE(kvrelay_region_abort(client, region) == KVRELAY_OK);
  kvrelay_client_close(client);
  CHECK(count_threads() == before);

  kvrelay_client* refused = nullptr;
  options.struct_size = sizeof(options) + 8;
  CHECK(kvrelay_client_connect_with_options(server.socket_path().c_str(), &options, &refused) ==
        KVRELAY_E_INVALID_ARGUMENT);
  options.struct_size = sizeof(options);
  options.memory_strategy = 7;
  CHECK(kvrelay_client_connect_with_options(server.socket_path().c_str(), &options, &refused) ==
        KVRELAY_E_INVALID_ARGUMENT);
  CHECK(refused == nullptr);
  CHECK(count_threads() == before);
}

TEST_CASE("the C ABI's error codes are kvrelay::ErrorCode's numbers", "[shm][c_abi]") {
  CHECK(kvrelay_abi_version() == KVRELAY_CLIENT_ABI_VERSION);
  CHECK(KVRELAY_E_INVALID_ARGUMENT == static_cast<int>(ErrorCode::kInvalidArgument));
  CHECK(KVRELAY_E_INTERNAL == static_cast<int>(ErrorCode::kInternal));
}

}  // namespace kvrelay::test
