// The arena's block allocator: granule-aligned blocks, lowest free range first (warm memory is
// reused), coalescing on release, and a clear error when full.

#include "kvrelay/kv_store/arena.h"

#include <catch2/catch.hpp>

#include <algorithm>
#include <atomic>
#include <cstring>
#include <span>
#include <vector>

#include "kvrelay/core/bulk_hash.h"
#include "kvrelay/kv_store/entry.h"
#include "kvrelay/kv_store/memfd.h"

namespace kvrelay::test {

namespace {

constexpr std::uint64_t kGranule = kv_store::ShmArena::kGranule;

}  // namespace

TEST_CASE("arena blocks are granule-aligned, disjoint and reused lowest first", "[shm][arena]") {
  auto created = kv_store::ShmArena::create(10 * kGranule);
  REQUIRE(created);
  auto arena = created.value();
  CHECK(arena->capacity() == 10 * kGranule);
  CHECK(kv_store::check_sealed_memfd(arena->fd(), 10 * kGranule).value() == 10 * kGranule);

  auto first = arena->allocate(1);
  auto second = arena->allocate(kGranule + 1);  // two granules
  auto third = arena->allocate(kGranule);
  REQUIRE(first);
  REQUIRE(second);
  REQUIRE(third);
  CHECK(first.value()->offset() == 0);
  CHECK(second.value()->offset() == kGranule);
  CHECK(third.value()->offset() == 3 * kGranule);
  CHECK(second.value()->size() == kGranule + 1);
  CHECK(arena->stats().in_use == 4 * kGranule);
  CHECK(arena->stats().blocks == 3);

  // Writes through one block never show in another.
  std::memset(first.value()->bytes().data(), 0xA1, first.value()->size());
  std::memset(second.value()->bytes().data(), 0xB2, second.value()->size());
  CHECK(first.value()->bytes()[0] == std::byte{0xA1});
  CHECK(third.value()->bytes()[0] == std::byte{0});

  // Freeing the first two coalesces them: a three-granule block fits at offset 0 again.
  first.value().reset();
  second.value().reset();
  auto merged = arena->allocate(3 * kGranule);
  REQUIRE(merged);
  CHECK(merged.value()->offset() == 0);
  // And a later free merges with both neighbours back into one range covering everything.
  third.value().reset();
  merged.value().reset();
  CHECK(arena->stats().in_use == 0);
  auto everything = arena->allocate(10 * kGranule);
  REQUIRE(everything);
  CHECK(everything.value()->offset() == 0);
}

TEST_CASE("prefaulting an arena touches every page without changing a byte, and can be stopped", "[shm][arena]") {
  auto arena = kv_store::ShmArena::create(8 * kGranule).value();
  auto block = arena->allocate(2 * kGranule);
  REQUIRE(block);
  std::memset(block.value()->bytes().data(), 0x7E, block.value()->size());
  std::atomic<bool> stop{true};
  CHECK(arena->warm(&stop) == 0);
  CHECK(arena->warm() == 8 * kGranule);
  const auto kept = block.value()->bytes();
  CHECK(std::all_of(kept.begin(), kept.end(), [](std::byte value) { return value == std::byte{0x7E}; }));
  CHECK(arena->stats().in_use == 2 * kGranule);
  auto rest = arena->allocate(6 * kGranule);
  REQUIRE(rest);
  CHECK(rest.value()->offset() == 2 * kGranule);
}

TEST_CASE("a full arena says so, and blocks keep their arena alive", "[shm][arena]") {
  auto arena = kv_store::ShmArena::create(4 * kGranule).value();
  auto big = arena->allocate(3 * kGranule);
  REQUIRE(big);
  auto too_big = arena->allocate(2 * kGranule);
  REQUIRE_FALSE(too_big);
  CHECK(too_big.error().code == ErrorCode::kResourceExhausted);
  CHECK_THAT(too_big.error().message, Catch::Contains("no free range"));
  CHECK(arena->stats().allocation_failures == 1);
  CHECK_FALSE(arena->allocate(1ULL << 40));
  auto last = arena->allocate(kGranule);
  REQUIRE(last);

  // The block outlives the last outside reference to its arena, and can still be written.
  std::weak_ptr<kv_store::ShmArena> watch = arena;
  arena.reset();
  CHECK_FALSE(watch.expired());
  std::memset(last.value()->bytes().data(), 1, kGranule);
  big.value().reset();
  last.value().reset();
  CHECK(watch.expired());
}

TEST_CASE("an arena refuses a zero size and cannot be sealed against writes by anyone", "[shm][arena]") {
  CHECK(kv_store::ShmArena::create(0).error().code == ErrorCode::kInvalidArgument);
  auto arena = kv_store::ShmArena::create(1).value();  // rounded up to one granule
  CHECK(arena->capacity() == kGranule);
  const auto seals = kv_store::get_seals(arena->fd());
  REQUIRE(seals);
  CHECK((seals.value() & kv_store::kSizeSeals) == kv_store::kSizeSeals);
  // F_SEAL_SEAL is on: no process given the fd can freeze the arena under the sidecar.
  CHECK((seals.value() & 0x0001U) != 0);
  CHECK((seals.value() & 0x0008U) == 0);
}

TEST_CASE("entries the sidecar makes hold a copy of the bytes and their checksum, in the arena or not",
          "[shm][arena]") {
  auto created = kv_store::ShmArena::create(64 * kGranule);
  REQUIRE(created);
  std::vector<std::byte> bytes((1U << 20) + 3);
  for (std::size_t at = 0; at < bytes.size(); ++at)
    bytes[at] = static_cast<std::byte>((at * 131) ^ (at >> 9));
  for (const std::size_t size : {std::size_t{0}, std::size_t{1}, std::size_t{300}, bytes.size()}) {
    const auto source = std::span<const std::byte>(bytes).first(size);
    for (kv_store::ShmArena* arena : {created.value().get(), static_cast<kv_store::ShmArena*>(nullptr)}) {
      INFO("size " << size << (arena != nullptr ? ", in the arena" : ", in a sealed memfd"));
      auto entry = kv_store::make_stored_entry(KvLayout{}, source, arena);
      REQUIRE(entry);
      CHECK(entry.value()->in_arena() == (arena != nullptr));
      CHECK(entry.value()->info.bytes == size);
      CHECK(entry.value()->info.checksum == bulk_hash64(source.data(), source.size()));
      auto view = kv_store::view_entry(*entry.value());
      REQUIRE(view);
      REQUIRE(view.value().bytes().size() == size);
      CHECK(std::equal(source.begin(), source.end(), view.value().bytes().begin()));
    }
  }
}

}  // namespace kvrelay::test
