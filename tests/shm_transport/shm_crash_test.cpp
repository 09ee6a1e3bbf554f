#include <catch2/catch.hpp>

#include <random>

#include "shm_fixture.h"
#include "support/child_process.h"

namespace kvrelay::test {

namespace {

constexpr std::size_t kPieces = 64;
constexpr std::size_t kPieceBytes = 64 * 1024;

std::byte piece_value(std::uint64_t context, std::size_t piece) {
  return static_cast<std::byte>((context * 31 + piece) & 0xFFU);
}

// Child body: publish kPieces pieces in place, then commit. Killed at an arbitrary point.
[[noreturn]] void write_and_commit(const std::string& socket_path, std::uint64_t context) {
  auto client = shm::ShmClient::connect(socket_path);
  if (!client) ::_exit(3);
  auto region = client.value().allocate(kPieces * kPieceBytes);
  if (!region) ::_exit(4);
  for (std::size_t piece = 0; piece < kPieces; ++piece) {
    std::memset(region.value().bytes().data() + piece * kPieceBytes, static_cast<int>(piece_value(context, piece)),
                kPieceBytes);
  }
  const auto checksum = shm::checksum_bytes(region.value().bytes());
  const auto committed = client.value().commit(std::move(region).value(), {1, context}, KvLayout{}, checksum);
  ::_exit(committed ? 0 : 5);
}

}  // namespace

TEST_CASE("shm writers SIGKILLed at random points leave nothing partial and no memory behind", "[shm][crash][fault]") {
  // Without an arena every region is a memfd of its own; with one, regions are arena blocks.
  const std::uint64_t arena_bytes = GENERATE(std::uint64_t{0}, std::uint64_t{128} << 20);
  INFO("arena bytes " << arena_bytes);
  shm::ShmServerOptions options;
  options.arena_bytes = arena_bytes;
  ServerProcess server(options);
  auto observer = server.connect();
  const std::size_t baseline_fds = count_fds(server.pid());
  std::mt19937_64 random(20261129);
  int visible = 0;
  for (std::uint64_t context = 1; context <= 100; ++context) {
    const pid_t child = ::fork();
    REQUIRE(child >= 0);
    if (child == 0) write_and_commit(server.socket_path(), context);
    // Spread the kill over connect, allocate, the writes and the commit.
    std::uniform_int_distribution<long> delay_us(0, 6000);
    const timespec pause{0, delay_us(random) * 1000};
    nanosleep(&pause, nullptr);
    ::kill(child, SIGKILL);
    int status = 0;
    REQUIRE(::waitpid(child, &status, 0) == child);
    if (WIFEXITED(status)) REQUIRE(WEXITSTATUS(status) == 0);

    auto entry = observer.lookup({1, context});
    if (!entry) {
      REQUIRE(entry.error().code == ErrorCode::kNotFound);
      continue;
    }
    ++visible;
    // Anything visible is complete: every piece holds its final value.
    REQUIRE(entry.value().info.bytes == kPieces * kPieceBytes);
    for (std::size_t piece = 0; piece < kPieces; ++piece) {
      const auto* data = entry.value().bytes().data() + piece * kPieceBytes;
      const std::byte expected = piece_value(context, piece);
      REQUIRE(std::all_of(data, data + kPieceBytes, [&](std::byte value) { return value == expected; }));
    }
  }
  INFO(visible << " of 100 writers committed before being killed");
  // The server notices the hang-ups asynchronously; then only committed entries hold memory.
  REQUIRE(wait_until(
      [&] {
        const auto stats = observer.stats().value();
        return stats.connections == 1 && stats.pending_regions == 0 && stats.pending_bytes == 0;
      },
      std::chrono::seconds(10)));
  // A commit sent just before its writer was killed can land after that writer's lookup above:
  // count what is visible once the server has settled (each entry complete, as checked above).
  int settled = 0;
  for (std::uint64_t context = 1; context <= 100; ++context) {
    if (auto entry = observer.lookup({1, context})) {
      ++settled;
      REQUIRE(entry.value().info.bytes == kPieces * kPieceBytes);
    }
  }
  // Without an arena nothing is evicted, so every entry seen above is still held; a full arena
  // evicts its least recently used ones (a slow, loaded run commits more writers than it holds).
  if (arena_bytes == 0) CHECK(settled >= visible);
  visible = settled;
  const auto stats = observer.stats().value();
  // Without an arena every committed entry stays; a full arena evicts its least recently used
  // entries to make room (as a full store would), so with one some may be gone.
  if (arena_bytes == 0) CHECK(stats.entries == static_cast<std::uint64_t>(visible));
  CHECK(stats.entries <= static_cast<std::uint64_t>(visible));
  CHECK(stats.entry_bytes == stats.entries * kPieces * kPieceBytes);
  // Committed entries hold a memfd each or an arena block each; nothing else holds memory.
  const auto in_memfds = count_memfds(server.pid(), "kvrelay-region");
  const auto in_arena = stats.arena_bytes_in_use / (kPieces * kPieceBytes);
  CHECK(stats.arena_bytes_in_use % (kPieces * kPieceBytes) == 0);
  CHECK(in_memfds + in_arena == stats.entries);
  if (arena_bytes == 0) CHECK(in_arena == 0);
  CHECK(stats.leases == 0);
  CHECK(count_fds(server.pid()) == baseline_fds + in_memfds);
}

}  // namespace kvrelay::test
