#include "kvrelay/core/bulk_hash.h"

#include <xxhash.h>  // the library's own portable XXH3_64bits, the reference

#include <catch2/catch.hpp>

#include <cstdint>
#include <cstring>
#include <random>
#include <vector>

namespace {

// The library's one-shot hash, whatever build bulk_hash.h would route XXH3_64bits to.
std::uint64_t reference_hash(const std::vector<std::uint8_t>& bytes, std::size_t size) {
  return XXH3_64bits(bytes.data(), size);
}

}  // namespace

TEST_CASE("bulk_hash64 and BulkHashStream give the library's XXH3-64 values", "[core][hash]") {
  std::mt19937 random(3);
  std::vector<std::uint8_t> bytes(300000);
  for (auto& byte : bytes)
    byte = static_cast<std::uint8_t>(random());
  // Every XXH3 size class: empty, 1-3, 4-8, 9-16, 17-128, 129-240, then whole and partial
  // 1 KiB blocks and stripes.
  for (std::size_t size : {0UL, 1UL, 3UL, 4UL, 8UL, 9UL, 16UL, 17UL, 128UL, 129UL, 240UL, 241UL, 1024UL, 1025UL, 4096UL,
                           65537UL, 300000UL}) {
    INFO("size " << size);
    CHECK(kvrelay::bulk_hash64(bytes.data(), size) == reference_hash(bytes, size));
    // Pieces of uneven sizes, as a streamed encoder reports them.
    kvrelay::BulkHashStream stream;
    REQUIRE(stream.valid());
    std::size_t done = 0;
    for (std::size_t piece = 1; done < size; piece = piece * 3 + 7) {
      const std::size_t take = piece < size - done ? piece : size - done;
      stream.update(bytes.data() + done, take);
      done += take;
    }
    CHECK(stream.digest() == reference_hash(bytes, size));
  }
}

TEST_CASE("BulkHashStream::update_copy copies and hashes like a copy followed by update", "[core][hash]") {
  std::mt19937 random(5);
  constexpr std::size_t kGuard = 67;  // an odd offset: the destination is unaligned
  std::vector<std::uint8_t> bytes(300000);
  for (auto& byte : bytes)
    byte = static_cast<std::uint8_t>(random());
  for (std::size_t size : {0UL, 1UL, 63UL, 64UL, 255UL, 256UL, 257UL, 512UL, 768UL, 1000UL, 1023UL, 1024UL, 1025UL,
                           4096UL, 65537UL, 300000UL}) {
    // Piece patterns: one call, uneven pieces (so the internal buffer is part full at every
    // offset), and update_copy interleaved with plain update of already-copied bytes.
    for (int pattern = 0; pattern < 3; ++pattern) {
      INFO("size " << size << ", pattern " << pattern);
      std::vector<std::uint8_t> copy(size + 2 * kGuard, 0xA5);
      std::uint8_t* destination = copy.data() + kGuard;
      kvrelay::BulkHashStream stream;
      REQUIRE(stream.valid());
      std::size_t done = 0;
      for (std::size_t piece = pattern == 0 ? size : 1; done < size; piece = piece * 3 + 7) {
        const std::size_t take = piece < size - done ? piece : size - done;
        if (pattern == 2 && (piece % 2) == 0) {
          std::memcpy(destination + done, bytes.data() + done, take);
          stream.update(destination + done, take);
        } else {
          stream.update_copy(destination + done, bytes.data() + done, take);
        }
        done += take;
      }
      CHECK(stream.digest() == reference_hash(bytes, size));
      CHECK(std::memcmp(destination, bytes.data(), size) == 0);
      // Nothing outside the destination is written.
      for (std::size_t at = 0; at < kGuard; ++at) {
        CHECK(copy[at] == 0xA5);
        CHECK(copy[kGuard + size + at] == 0xA5);
      }
    }
  }
}
