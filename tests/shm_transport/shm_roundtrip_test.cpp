#include <catch2/catch.hpp>

#include <algorithm>
#include <cstring>

#include "kvrelay/shm_transport/kvrelay_client.h"

#include "shm_fixture.h"

namespace kvrelay::test {

namespace {

bool same_bytes(std::span<const std::byte> left, std::span<const std::byte> right) {
  return left.size() == right.size() && (left.empty() || std::memcmp(left.data(), right.data(), left.size()) == 0);
}

}  // namespace

TEST_CASE("shm publish and lookup round-trip 0 B, 1 B, 1 MiB + 1 and 256 MiB byte for byte", "[shm]") {
  ServerProcess server;
  auto publisher = server.connect();
  auto reader = server.connect();
  const std::size_t sizes[] = {0, 1, (1U << 20) + 1, 256U << 20};
  std::uint64_t context = 1;
  for (const std::size_t size : sizes) {
    INFO("size " << size);
    const auto bytes = pattern_bytes(size, context);
    const kv_store::EntryKey key{42, context++};
    REQUIRE(reader.lookup(key).error().code == ErrorCode::kNotFound);
    const auto published = publisher.publish(key, KvLayout{}, bytes);
    REQUIRE(published.has_value());
    auto entry = reader.lookup(key);
    REQUIRE(entry.has_value());
    CHECK(entry.value().info.bytes == size);
    CHECK(entry.value().info.checksum == shm::checksum_bytes(bytes));
    CHECK(same_bytes(entry.value().bytes(), bytes));
  }
  const auto stats = reader.stats();
  REQUIRE(stats.has_value());
  CHECK(stats.value().entries == 4);
  CHECK(stats.value().pending_regions == 0);
  CHECK(stats.value().entry_bytes == 1 + (1U << 20) + 1 + (256U << 20));
}

TEST_CASE("shm KV entries carry their layout, and a layout that does not fit is refused", "[shm]") {
  ServerProcess server;
  auto client = server.connect();
  const KvLayout layout{5, 4, 8, DType::kFloat16, 33};
  const auto total = layout.total_bytes().value();
  const auto bytes = pattern_bytes(total, 7);
  REQUIRE(client.publish({1, 2}, layout, bytes).has_value());
  auto entry = client.lookup({1, 2});
  REQUIRE(entry.has_value());
  CHECK(entry.value().info.layout == layout);

  const auto short_by_one = pattern_bytes(total - 1, 7);
  const auto refused = client.publish({1, 3}, layout, short_by_one);
  REQUIRE_FALSE(refused.has_value());
  CHECK(refused.error().code == ErrorCode::kLayoutMismatch);
  CHECK(client.lookup({1, 3}).error().code == ErrorCode::kNotFound);
  CHECK(client.stats().value().pending_regions == 0);
}

TEST_CASE("shm commit with a wrong checksum is refused and nothing becomes visible", "[shm]") {
  ServerProcess server;
  auto client = server.connect();
  auto region = client.allocate(4096);
  REQUIRE(region.has_value());
  std::memset(region.value().mapping.data(), 0x5A, 4096);
  const auto expected = shm::checksum_bytes(region.value().bytes());
  const auto committed = client.commit(std::move(region).value(), {9, 9}, KvLayout{}, expected ^ 1U);
  REQUIRE_FALSE(committed.has_value());
  CHECK(committed.error().code == ErrorCode::kChecksumMismatch);
  CHECK(client.lookup({9, 9}).error().code == ErrorCode::kNotFound);
  const auto stats = client.stats().value();
  CHECK(stats.pending_regions == 0);
  CHECK(stats.entries == 0);
}

TEST_CASE("shm lookup hands out a mapping that cannot be written", "[shm]") {
  ServerProcess server;
  auto client = server.connect();
  const auto bytes = pattern_bytes(8192, 3);
  REQUIRE(client.publish({5, 5}, KvLayout{}, bytes).has_value());
  auto entry = client.lookup({5, 5});
  REQUIRE(entry.has_value());
  // The memfd is sealed against writes: neither a writable mapping nor write() is possible.
  CHECK_FALSE(kv_store::Mapping::map(entry.value().fd.get(), 8192, true).has_value());
  const char junk = 'x';
  CHECK(::pwrite(entry.value().fd.get(), &junk, 1, 0) < 0);
  auto again = client.lookup({5, 5});
  REQUIRE(again.has_value());
  CHECK(same_bytes(again.value().bytes(), bytes));
}

TEST_CASE("shm abort frees the region and a client-created sealed memfd can be attached", "[shm]") {
  ServerProcess server;
  auto client = server.connect();
  auto region = client.allocate(1 << 20);
  REQUIRE(region.has_value());
  CHECK(client.stats().value().pending_bytes == (1U << 20));
  REQUIRE(client.abort(std::move(region).value()).has_value());
  CHECK(client.stats().value().pending_bytes == 0);

  auto memfd = kv_store::create_sealed_memfd("client-made", 1000);
  REQUIRE(memfd.has_value());
  auto attached = client.attach(std::move(memfd).value());
  REQUIRE(attached.has_value());
  const auto bytes = pattern_bytes(1000, 11);
  std::memcpy(attached.value().mapping.data(), bytes.data(), bytes.size());
  REQUIRE(client.commit(std::move(attached).value(), {8, 8}, KvLayout{}, shm::checksum_bytes(bytes)).has_value());
  auto entry = client.lookup({8, 8});
  REQUIRE(entry.has_value());
  CHECK(same_bytes(entry.value().bytes(), bytes));
}

TEST_CASE("shm commit is refused while the writer still maps the region writable", "[shm]") {
  ServerProcess server;
  auto client = server.connect();
  auto region = client.allocate(4096);
  REQUIRE(region.has_value());
  // A second writable mapping the client "forgot": the sidecar must not accept mutable bytes.
  auto stray = kv_store::Mapping::map(region.value().fd.get(), 4096, true);
  REQUIRE(stray.has_value());
  const auto committed =
      client.commit(std::move(region).value(), {3, 3}, KvLayout{}, shm::checksum_bytes(stray.value().bytes()));
  REQUIRE_FALSE(committed.has_value());
  CHECK(committed.error().code == ErrorCode::kPermissionDenied);
  CHECK(client.lookup({3, 3}).error().code == ErrorCode::kNotFound);
}

TEST_CASE("shm small messages round-trip over the shared-memory ring", "[shm]") {
  ServerProcess server;
  auto client = server.connect();
  std::vector<std::byte> answer(1024);
  for (std::size_t size : {std::size_t{0}, std::size_t{1}, std::size_t{64}, std::size_t{252}}) {
    for (int repeat = 0; repeat < 200; ++repeat) {
      const auto message = pattern_bytes(size, static_cast<std::uint64_t>(repeat) + size);
      auto length = client.ring_call(message, answer);
      REQUIRE(length.has_value());
      REQUIRE(same_bytes(std::span(answer.data(), length.value()), message));
    }
  }
  const auto too_big = pattern_bytes(253, 1);
  CHECK(client.ring_call(too_big, answer).error().code == ErrorCode::kInvalidArgument);
  CHECK(client.stats().value().open_rings == 1);
}

TEST_CASE("shm C ABI publishes, looks up and reports errors by code", "[shm][c_abi]") {
  // The same calls with one sealed memfd per entry and with the sidecar's arena.
  const std::uint64_t arena_bytes = GENERATE(std::uint64_t{0}, std::uint64_t{16} << 20);
  INFO("arena bytes " << arena_bytes);
  shm::ShmServerOptions options;
  options.arena_bytes = arena_bytes;
  ServerProcess server(options);
  auto observer = server.connect();
  kvrelay_client* client = nullptr;
  REQUIRE(kvrelay_client_connect(server.socket_path().c_str(), &client) == KVRELAY_OK);
  const kvrelay_key key{77, 78};
  const kvrelay_layout layout{2, 2, 4, 1, 3};  // 2 layers x K,V x 3 tokens x 2 heads x 4 dims x fp32 = 384 B
  kvrelay_region* region = nullptr;
  REQUIRE(kvrelay_region_alloc(client, 384, &region) == KVRELAY_OK);
  REQUIRE(kvrelay_region_size(region) == 384);
  const auto bytes = pattern_bytes(384, 5);
  std::memcpy(kvrelay_region_data(region), bytes.data(), 384);
  REQUIRE(kvrelay_region_commit(client, region, &key, &layout) == KVRELAY_OK);

  kvrelay_entry* entry = nullptr;
  REQUIRE(kvrelay_lookup(client, &key, &entry) == KVRELAY_OK);
  REQUIRE(kvrelay_entry_size(entry) == 384);
  CHECK(std::memcmp(kvrelay_entry_data(entry), bytes.data(), 384) == 0);
  kvrelay_layout got{};
  kvrelay_entry_layout(entry, &got);
  CHECK(got.layers == 2);
  CHECK(got.tokens == 3);
  CHECK(got.dtype == 1);
  CHECK(observer.stats().value().leases == (arena_bytes > 0 ? 1U : 0U));
  kvrelay_entry_release(entry);
  REQUIRE(kvrelay_release_leases(client) == KVRELAY_OK);
  CHECK(observer.stats().value().leases == 0);
  CHECK(observer.stats().value().arena_bytes_in_use == (arena_bytes > 0 ? kv_store::ShmArena::kGranule : 0U));

  const kvrelay_key missing{77, 79};
  CHECK(kvrelay_lookup(client, &missing, &entry) == KVRELAY_E_NOT_FOUND);
  CHECK(std::string(kvrelay_last_error(client)).find("not_found") != std::string::npos);
  const kvrelay_layout wrong{2, 2, 4, 1, 4};
  CHECK(kvrelay_publish(client, &key, &wrong, bytes.data(), 384) == KVRELAY_E_LAYOUT_MISMATCH);

  char answer[64];
  std::size_t answer_size = 0;
  REQUIRE(kvrelay_small_call(client, "ping", 4, answer, sizeof(answer), &answer_size) == KVRELAY_OK);
  CHECK(std::string(answer, answer_size) == "ping");
  kvrelay_client_close(client);
}

}  // namespace kvrelay::test
