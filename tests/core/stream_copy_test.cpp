#include "kvrelay/core/stream_copy.h"

#include <catch2/catch.hpp>

#include <cstdint>
#include <cstring>
#include <vector>

namespace kvrelay::test {

TEST_CASE("copy_streaming copies exactly what memcpy does, at any size and alignment", "[core][copy]") {
  std::vector<std::byte> source(300 * 1024 + 77);
  std::uint64_t state = 0x2545F4914F6CDD1DULL;
  for (auto& value : source) {
    state ^= state << 13;
    state ^= state >> 7;
    state ^= state << 17;
    value = static_cast<std::byte>(state);
  }
  // Sizes around the streaming threshold (64 KiB) and the 128-byte loop, with every
  // destination misalignment the head copy has to handle.
  for (const std::size_t size : {std::size_t{0}, std::size_t{1}, std::size_t{65535}, std::size_t{65536},
                                 std::size_t{65536 + 127}, std::size_t{300 * 1024}}) {
    for (const std::size_t shift : {std::size_t{0}, std::size_t{1}, std::size_t{31}, std::size_t{33}}) {
      INFO("size " << size << " shift " << shift);
      std::vector<std::byte> destination(size + 128, std::byte{0xEE});
      copy_streaming(destination.data() + shift, source.data() + 5, size);
      CHECK(std::memcmp(destination.data() + shift, source.data() + 5, size) == 0);
      // Nothing outside the destination range was touched.
      for (std::size_t index = 0; index < shift; ++index)
        REQUIRE(destination[index] == std::byte{0xEE});
      for (std::size_t index = shift + size; index < destination.size(); ++index) {
        REQUIRE(destination[index] == std::byte{0xEE});
      }
    }
  }
}

}  // namespace kvrelay::test
