// The shared-memory arena end to end: a real sidecar process, real clients, real shared memory.
// Entries committed into the arena are read in place by other clients under leases; a block
// is reused only once no entry and no lease holds it; older clients get sealed copies.

#include <sys/mman.h>

#include <catch2/catch.hpp>

#include <cstring>

#include "kvrelay/core/byte_io.h"
#include "kvrelay/shm_transport/fd_passing.h"

#include "shm_fixture.h"
#include "support/child_process.h"

namespace kvrelay::test {

namespace {

constexpr std::uint64_t kArenaBytes = 256ULL << 20;

shm::ShmServerOptions arena_options(std::uint64_t arena_bytes = kArenaBytes) {
  shm::ShmServerOptions options;
  options.arena_bytes = arena_bytes;
  return options;
}

bool arena_bytes_equal(std::span<const std::byte> left, std::span<const std::byte> right) {
  return left.size() == right.size() && (left.empty() || std::memcmp(left.data(), right.data(), left.size()) == 0);
}

std::uint64_t granules(std::uint64_t bytes) {
  const std::uint64_t granule = kv_store::ShmArena::kGranule;
  return (std::max<std::uint64_t>(bytes, 1) + granule - 1) / granule * granule;
}

}  // namespace

TEST_CASE("shm arena: publish and lookup round-trip 0 B, 1 B, 1 MiB + 1 and 64 MiB in place", "[shm][arena]") {
  ServerProcess server(arena_options());
  auto publisher = server.connect();
  auto reader = server.connect();
  REQUIRE(publisher.server_version() == shm::kDataPlaneVersion);
  const std::size_t sizes[] = {0, 1, (1U << 20) + 1, 64U << 20};
  std::uint64_t context = 1;
  std::uint64_t reserved = 0;
  for (const std::size_t size : sizes) {
    INFO("size " << size);
    const auto bytes = pattern_bytes(size, context);
    const kv_store::EntryKey key{42, context++};
    REQUIRE(publisher.publish(key, KvLayout{}, bytes).has_value());
    reserved += granules(size);
    auto entry = reader.lookup(key);
    REQUIRE(entry.has_value());
    CHECK(entry.value().in_arena());
    CHECK_FALSE(entry.value().fd);
    CHECK(entry.value().info.checksum == shm::checksum_bytes(bytes));
    CHECK(arena_bytes_equal(entry.value().bytes(), bytes));
    std::vector<std::byte> tail(std::min<std::size_t>(size, 100));
    REQUIRE(entry.value().read(size - tail.size(), tail).has_value());
    CHECK(arena_bytes_equal(tail, std::span(bytes).last(tail.size())));
    CHECK(entry.value().read(size, std::span(tail.data(), 1)).error().code == ErrorCode::kOutOfRange);
  }
  const auto stats = reader.stats().value();
  CHECK(stats.entries == 4);
  CHECK(stats.arena_bytes == kArenaBytes);
  CHECK(stats.arena_bytes_in_use == reserved);
  CHECK(stats.pending_regions == 0);
  // Nothing went through per-entry segments.
  CHECK(count_memfds(server.pid(), "kvrelay-region") == 0);
  CHECK(count_memfds(server.pid(), "kvrelay-entry") == 0);
}

TEST_CASE("shm arena: a lease keeps a replaced entry's bytes until the reader gives it back", "[shm][arena]") {
  ServerProcess server(arena_options(4ULL << 20));  // room for exactly four 1 MiB entries
  auto publisher = server.connect();
  auto reader = server.connect();
  const kv_store::EntryKey key{7, 1};
  const auto old_bytes = pattern_bytes(1U << 20, 1);
  REQUIRE(publisher.publish(key, KvLayout{}, old_bytes).has_value());
  auto held = reader.lookup(key);
  REQUIRE(held.has_value());
  REQUIRE(held.value().in_arena());
  CHECK(reader.stats().value().leases == 1);

  // Replaced in the store: only the lease holds the old block now, so no publish may reuse it.
  for (std::uint64_t round = 2; round <= 4; ++round) {
    REQUIRE(publisher.publish(key, KvLayout{}, pattern_bytes(1U << 20, round)).has_value());
  }
  CHECK(arena_bytes_equal(held.value().bytes(), old_bytes));
  auto current = publisher.lookup(key);
  REQUIRE(current.has_value());
  CHECK(arena_bytes_equal(current.value().bytes(), pattern_bytes(1U << 20, 4)));
  current = Result<shm::ReadOnlyEntry>(fail(ErrorCode::kNotFound, "dropped"));
  REQUIRE(publisher.release_leases().has_value());  // leases are per client: give that one back too
  auto stats = reader.stats().value();
  CHECK(stats.leases == 1);
  CHECK(stats.arena_bytes_in_use == 2 * (1ULL << 20));  // the current entry and the leased one

  // Dropped: given back with the reader's next call, after which the block is free again.
  held = Result<shm::ReadOnlyEntry>(fail(ErrorCode::kNotFound, "dropped"));
  stats = reader.stats().value();
  CHECK(stats.leases == 0);
  CHECK(stats.arena_bytes_in_use == 1ULL << 20);
}

TEST_CASE("shm arena: leases outlive their client object and end when the last entry goes", "[shm][arena]") {
  ServerProcess server(arena_options(8ULL << 20));
  auto publisher = server.connect();
  const auto bytes = pattern_bytes(3U << 20, 9);
  REQUIRE(publisher.publish({1, 1}, KvLayout{}, bytes).has_value());
  std::optional<shm::ReadOnlyEntry> kept;
  {
    auto reader = server.connect();
    auto entry = reader.lookup({1, 1});
    REQUIRE(entry.has_value());
    kept = std::move(entry).value();
  }  // the client is gone, its entry is not: the connection (and the lease) stay
  REQUIRE(publisher.release_leases().has_value());
  CHECK(publisher.stats().value().leases == 1);
  CHECK(publisher.stats().value().connections == 2);
  CHECK(arena_bytes_equal(kept->bytes(), bytes));
  kept.reset();
  CHECK(wait_until([&] { return publisher.stats().value().leases == 0; }, std::chrono::seconds(5)));
  CHECK(publisher.stats().value().connections == 1);
}

TEST_CASE("shm arena: a full arena evicts its least recently used entries, never a leased block", "[shm][arena]") {
  ServerProcess server(arena_options(4ULL << 20));
  auto publisher = server.connect();
  auto reader = server.connect();
  for (std::uint64_t context = 1; context <= 4; ++context) {
    REQUIRE(publisher.publish({8, context}, KvLayout{}, pattern_bytes(1U << 20, context)).has_value());
  }
  CHECK(reader.stats().value().arena_bytes_in_use == 4ULL << 20);
  // Full: the fifth entry takes the place of the least recently used one.
  REQUIRE(publisher.publish({8, 5}, KvLayout{}, pattern_bytes(1U << 20, 5)).has_value());
  CHECK(reader.lookup({8, 1}).error().code == ErrorCode::kNotFound);
  auto fifth = reader.lookup({8, 5});
  REQUIRE(fifth.has_value());
  CHECK(fifth.value().in_arena());
  fifth = Result<shm::ReadOnlyEntry>(fail(ErrorCode::kNotFound, "dropped"));

  // A reader holds entry 2, which then becomes the least recently used: dropping it would free
  // nothing, so it stays and entry 3, the next least recently used, makes the room.
  auto held = reader.lookup({8, 2});
  REQUIRE(held.has_value());
  for (std::uint64_t context = 3; context <= 5; ++context)
    REQUIRE(publisher.lookup({8, context}).has_value());
  REQUIRE(publisher.publish({8, 6}, KvLayout{}, pattern_bytes(1U << 20, 6)).has_value());
  CHECK(reader.lookup({8, 3}).error().code == ErrorCode::kNotFound);
  auto sixth = reader.lookup({8, 6});
  REQUIRE(sixth.has_value());
  CHECK(sixth.value().in_arena());
  CHECK(arena_bytes_equal(held.value().bytes(), pattern_bytes(1U << 20, 2)));
  CHECK(reader.lookup({8, 2}).has_value());
}

TEST_CASE("shm arena: an older client gets a sealed copy it cannot write", "[shm][arena]") {
  ServerProcess server(arena_options());
  auto publisher = server.connect();
  auto old_reader = shm::ShmClient::connect(server.socket_path(), 2);
  REQUIRE(old_reader.has_value());
  const auto bytes = pattern_bytes((1U << 20) + 3, 5);
  REQUIRE(publisher.publish({3, 3}, KvLayout{}, bytes).has_value());
  auto entry = old_reader.value().lookup({3, 3});
  REQUIRE(entry.has_value());
  CHECK_FALSE(entry.value().in_arena());
  REQUIRE(entry.value().fd);
  CHECK((kv_store::get_seals(entry.value().fd.get()).value() & 0x0008U) != 0);  // F_SEAL_WRITE
  CHECK(::mmap(nullptr, bytes.size(), PROT_READ | PROT_WRITE, MAP_SHARED, entry.value().fd.get(), 0) == MAP_FAILED);
  CHECK(arena_bytes_equal(entry.value().bytes(), bytes));
  CHECK(old_reader.value().stats().value().leases == 0);
  // An older client also publishes into segments of its own, never the arena.
  const auto before = publisher.stats().value().arena_bytes_in_use;
  REQUIRE(old_reader.value().publish({3, 4}, KvLayout{}, bytes).has_value());
  CHECK(publisher.stats().value().arena_bytes_in_use == before);
  CHECK(count_memfds(server.pid(), "kvrelay-region") == 1);
}

TEST_CASE("shm arena: a full arena falls back to sealed segments, a bad commit frees its block", "[shm][arena]") {
  ServerProcess server(arena_options(1ULL << 20));
  auto client = server.connect();
  const auto big = pattern_bytes(2U << 20, 11);
  REQUIRE(client.publish({5, 1}, KvLayout{}, big).has_value());
  auto entry = client.lookup({5, 1});
  REQUIRE(entry.has_value());
  CHECK_FALSE(entry.value().in_arena());
  CHECK(arena_bytes_equal(entry.value().bytes(), big));
  REQUIRE(client.stats().has_value());  // the lookup's reply descriptor is closed by now
  CHECK(count_memfds(server.pid(), "kvrelay-region") == 1);

  auto region = client.allocate(1U << 20);
  REQUIRE(region.has_value());
  REQUIRE(region.value().in_arena());
  std::memset(region.value().bytes().data(), 0x5A, region.value().size);
  CHECK(client.stats().value().arena_bytes_in_use == 1ULL << 20);
  const auto committed = client.commit(std::move(region).value(), {5, 2}, KvLayout{}, 12345);
  REQUIRE_FALSE(committed.has_value());
  CHECK(committed.error().code == ErrorCode::kChecksumMismatch);
  CHECK(client.lookup({5, 2}).error().code == ErrorCode::kNotFound);
  const auto stats = client.stats().value();
  CHECK(stats.arena_bytes_in_use == 0);
  CHECK(stats.pending_regions == 0);
}

TEST_CASE("shm arena: malformed lease releases are refused, unknown ids are harmless", "[shm][arena]") {
  ServerProcess server(arena_options(1ULL << 20));
  auto client = server.connect();
  auto exchange = [&](const std::vector<std::byte>& datagram) {
    REQUIRE(shm::send_message(client.socket_fd(), datagram).has_value());
    auto reply = shm::receive_message(client.socket_fd());
    REQUIRE(reply.has_value());
    auto frame = shm::decode_frame(reply.value().bytes);
    REQUIRE(frame.has_value());
    return std::make_pair(frame.value().type,
                          std::vector<std::byte>(frame.value().payload.begin(), frame.value().payload.end()));
  };
  ByteWriter claims_two;  // says 2 ids, carries 1
  claims_two.put(std::uint32_t{2}).put(std::uint64_t{1});
  auto [type, payload] = exchange(shm::encode_frame(shm::MessageType::kReleaseLeases, 1, claims_two.bytes()));
  CHECK(type == shm::MessageType::kError);
  CHECK(shm::decode_error(payload).code == ErrorCode::kProtocol);

  ByteWriter unknown;
  unknown.put(std::uint32_t{1}).put(std::uint64_t{999});
  std::tie(type, payload) = exchange(shm::encode_frame(shm::MessageType::kReleaseLeases, 2, unknown.bytes()));
  REQUIRE(type == shm::MessageType::kLeasesReleased);
  ByteReader released(payload);
  CHECK(released.get<std::uint32_t>() == 0U);

  // The connection still serves, and nothing leaked.
  REQUIRE(client.publish({1, 1}, KvLayout{}, pattern_bytes(100, 1)).has_value());
  CHECK(client.stats().value().arena_bytes_in_use == kv_store::ShmArena::kGranule);
}

TEST_CASE("shm arena: progress reports let the sidecar check a region while it is written", "[shm][arena]") {
  ServerProcess server(arena_options(64ULL << 20));
  auto client = server.connect();
  auto send_progress = [&](std::uint64_t region_id, std::uint64_t written) {
    ByteWriter progress;
    progress.put(region_id).put(written);
    REQUIRE(shm::send_message(client.socket_fd(),
                              shm::encode_frame(shm::MessageType::kRegionProgress, 77, progress.bytes()))
                .has_value());
  };
  const auto bytes = pattern_bytes(16U << 20, 21);
  const auto checksum = shm::checksum_bytes(bytes);
  const auto rejected_before = client.stats().value().rejected_messages;

  SECTION("in order, out of order, past the end and for regions that are not there") {
    auto region = client.allocate(bytes.size());
    REQUIRE(region.has_value());
    REQUIRE(region.value().in_arena());
    std::memcpy(region.value().bytes().data(), bytes.data(), bytes.size() / 2);
    send_progress(region.value().id, bytes.size() / 2);
    send_progress(region.value().id, bytes.size() / 4);  // behind: nothing to do
    std::memcpy(region.value().bytes().data() + bytes.size() / 2, bytes.data() + bytes.size() / 2, bytes.size() / 2);
    send_progress(region.value().id, 1ULL << 40);  // past the end: clamped to the region
    send_progress(999, 4096);                      // no such region: counted, not answered
    // One-way messages get no reply: the next answer on the socket is the ping's.
    const std::byte hello[] = {std::byte{4}, std::byte{2}};
    auto pong = client.ping(hello);
    REQUIRE(pong.has_value());
    CHECK(pong.value().size() == 2);
    REQUIRE(client.commit(std::move(region).value(), {9, 1}, KvLayout{}, checksum).has_value());
    auto entry = client.lookup({9, 1});
    REQUIRE(entry.has_value());
    CHECK(arena_bytes_equal(entry.value().bytes(), bytes));
    CHECK(client.stats().value().rejected_messages == rejected_before + 1);
  }
  SECTION("a region checked halfway still fails a wrong checksum, and an aborted one is freed") {
    auto region = client.allocate(bytes.size());
    REQUIRE(region.has_value());
    std::memcpy(region.value().bytes().data(), bytes.data(), bytes.size());
    send_progress(region.value().id, bytes.size() / 2);
    auto refused = client.commit(std::move(region).value(), {9, 2}, KvLayout{}, checksum ^ 1);
    REQUIRE_FALSE(refused.has_value());
    CHECK(refused.error().code == ErrorCode::kChecksumMismatch);

    auto aborted = client.allocate(bytes.size());
    REQUIRE(aborted.has_value());
    send_progress(aborted.value().id, bytes.size());
    REQUIRE(client.abort(std::move(aborted).value()).has_value());
    CHECK(wait_until([&] { return client.stats().value().arena_bytes_in_use == 0; }, std::chrono::seconds(5)));
  }
  SECTION("a region written in place is hashed with progress reports by commit_written") {
    auto region = client.allocate(bytes.size());
    REQUIRE(region.has_value());
    REQUIRE(region.value().in_arena());
    std::memcpy(region.value().bytes().data(), bytes.data(), bytes.size());
    REQUIRE(client.commit_written(std::move(region).value(), {9, 4}, KvLayout{}).has_value());
    auto entry = client.lookup({9, 4});
    REQUIRE(entry.has_value());
    CHECK(entry.value().info.checksum == checksum);
    CHECK(arena_bytes_equal(entry.value().bytes(), bytes));
    // Its reports were well formed (a bad one is counted here), and a small region needs none.
    CHECK(client.stats().value().rejected_messages == rejected_before);
    auto small = client.allocate(4096);
    REQUIRE(small.has_value());
    std::memcpy(small.value().bytes().data(), bytes.data(), 4096);
    REQUIRE(client.commit_written(std::move(small).value(), {9, 5}, KvLayout{}).has_value());
    auto small_entry = client.lookup({9, 5});
    REQUIRE(small_entry.has_value());
    CHECK(small_entry.value().info.checksum == shm::checksum_bytes(std::span(bytes).first(4096)));
  }
  SECTION("the copying publish reports progress itself") {
    REQUIRE(client.publish({9, 3}, KvLayout{}, bytes).has_value());
    auto entry = client.lookup({9, 3});
    REQUIRE(entry.has_value());
    CHECK(entry.value().in_arena());
    CHECK(arena_bytes_equal(entry.value().bytes(), bytes));
    CHECK(client.stats().value().rejected_messages == rejected_before);
  }
}

}  // namespace kvrelay::test
