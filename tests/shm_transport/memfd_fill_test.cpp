// Segments filled through the kernel (create_sealed_memfd_to_fill, write_memfd,
// checksum_memfd): what the peer receiver and ShmClient::publish use instead of new mappings.
// The size seals must hold from creation, the bytes must land exactly, and the checksum read
// back through the fd must match the one over the source.
#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <catch2/catch.hpp>

#include <cstring>
#include <vector>

#include "kvrelay/shm_transport/client.h"
#include "kvrelay/kv_store/memfd.h"

using namespace kvrelay;
using namespace kvrelay::shm;
using namespace kvrelay::kv_store;

namespace {

std::vector<std::byte> pattern(std::size_t size) {
  std::vector<std::byte> bytes(size);
  for (std::size_t index = 0; index < size; ++index)
    bytes[index] = static_cast<std::byte>((index * 131 + 7) & 0xFF);
  return bytes;
}

}  // namespace

TEST_CASE("a segment filled with write_memfd holds the bytes, stays size-sealed and seals", "[shm][memfd]") {
  // Sizes around the 256 KiB piece checksum_memfd reads with, and an empty segment.
  for (const std::size_t size : {std::size_t{0}, std::size_t{1}, std::size_t{256 * 1024}, std::size_t{(1 << 20) + 1}}) {
    INFO("size " << size);
    const auto bytes = pattern(size);
    auto memfd = create_sealed_memfd_to_fill("fill-test", size);
    REQUIRE(memfd);
    const int fd = memfd.value().get();
    // Sealed against size changes before a byte is written: a receiver of the fd can trust it.
    CHECK(check_sealed_memfd(fd, 0).value() == size);
    // Written in two uneven pieces, the way chunks arrive.
    const std::size_t split = size / 3;
    REQUIRE(write_memfd(fd, 0, std::span(bytes.data(), split)));
    REQUIRE(write_memfd(fd, split, std::span(bytes.data() + split, size - split)));
    const auto checksum = checksum_memfd(fd, size);
    REQUIRE(checksum);
    CHECK(checksum.value() == checksum_bytes(bytes));
    std::vector<std::byte> back(size);
    CHECK(::pread(fd, back.data(), size, 0) == static_cast<ssize_t>(size));
    CHECK(back == bytes);
    // Nothing maps it, so sealing the contents succeeds right away.
    REQUIRE(seal_contents(fd));
    const std::byte one{1};
    CHECK_FALSE(write_memfd(fd, 0, std::span(&one, 1)));
  }
}

TEST_CASE("write_memfd cannot grow a segment and checksum_memfd refuses to read past its end", "[shm][memfd]") {
  auto memfd = create_sealed_memfd_to_fill("fill-test", 4096);
  REQUIRE(memfd);
  const auto bytes = pattern(8192);
  const auto grown = write_memfd(memfd.value().get(), 0, bytes);
  REQUIRE_FALSE(grown);
  CHECK(grown.error().message.find("offset 4096") != std::string::npos);
  struct stat info {};
  REQUIRE(::fstat(memfd.value().get(), &info) == 0);
  CHECK(info.st_size == 4096);
  const auto past_end = checksum_memfd(memfd.value().get(), 4097);
  REQUIRE_FALSE(past_end);
  CHECK(past_end.error().code == ErrorCode::kTruncated);
}

TEST_CASE("read_memfd reads any range back through the kernel and refuses to read past the end", "[shm][memfd]") {
  const std::size_t size = (1 << 20) + 3;
  const auto bytes = pattern(size);
  auto memfd = create_sealed_memfd_to_fill("read-test", size);
  REQUIRE(memfd);
  const int fd = memfd.value().get();
  REQUIRE(write_memfd(fd, 0, bytes));
  REQUIRE(seal_contents(fd));
  std::vector<std::byte> whole(size);
  REQUIRE(read_memfd(fd, 0, whole));
  CHECK(whole == bytes);
  std::vector<std::byte> middle(1000);
  REQUIRE(read_memfd(fd, 4095, middle));
  CHECK(std::memcmp(middle.data(), bytes.data() + 4095, middle.size()) == 0);
  std::vector<std::byte> past_end(4);
  const auto refused = read_memfd(fd, size - 2, past_end);
  REQUIRE_FALSE(refused);
  CHECK(refused.error().code == ErrorCode::kTruncated);
}
