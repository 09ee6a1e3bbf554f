// Issue #29: chunk streams over UCX, both ends in one process (the peer library's own send and
// receive code), on real loopback sockets for the control connection and real UCP workers for
// the chunks: byte-exact from 0 bytes up, bit flips detected, and an endpoint without the
// connection's token refused. Each case runs with UCX_TLS=tcp and with UCX_TLS=posix.

#include <xxhash.h>

#include <boost/asio/co_spawn.hpp>
#include <boost/asio/detached.hpp>
#include <boost/asio/io_context.hpp>
#include <boost/asio/ip/tcp.hpp>
#include <boost/asio/strand.hpp>
#include <catch2/catch.hpp>

#include <algorithm>
#include <chrono>
#include <cstring>
#include <optional>
#include <vector>

#include "kvrelay/core/bulk_hash.h"
#include "kvrelay/peer/ucx_transport.h"

#include "peer_io.h"
#include "support/skip.h"

namespace {

namespace asio = boost::asio;
using kvrelay::ErrorCode;
using kvrelay::Status;
using kvrelay::peer::EncodedEntryHeader;
using kvrelay::peer::UcxContext;
using kvrelay::peer::UcxLink;
using kvrelay::peer::UcxThreading;
using kvrelay::peer::UcxWorker;
using kvrelay::peer::detail::PeerConnection;
using tcp = asio::ip::tcp;
using namespace std::chrono_literals;

std::vector<std::uint8_t> pattern(std::size_t size, std::uint64_t seed) {
  std::vector<std::uint8_t> bytes(size);
  std::uint64_t state = seed * 0x9E3779B97F4A7C15ULL + 1;
  for (auto& byte : bytes) {
    state ^= state << 13;
    state ^= state >> 7;
    state ^= state << 17;
    byte = static_cast<std::uint8_t>(state);
  }
  return bytes;
}

// Runs `task` on `io` until it finishes (the workers' progress coroutines stay suspended).
template <class T>
T run_until_done(asio::io_context& io, asio::awaitable<T> task) {
  std::optional<T> result;
  asio::co_spawn(
      io, [&]() -> asio::awaitable<void> { result.emplace(co_await std::move(task)); }, asio::detached);
  while (!result && io.run_one() > 0) {
  }
  REQUIRE(result.has_value());
  return std::move(*result);
}

// Two connected peer connections (sender side, receiver side) and a UCX link between them made
// as the peer plane makes it: the receiver's worker issues a token, the sender dials its address
// and presents the token, the receiver's worker answers it.
struct UcxPair {
  explicit UcxPair(const std::string& tls) {
    kvrelay::UcxPolicy settings;
    settings.tls = tls;
    auto made = UcxContext::create(settings);
    REQUIRE(made.has_value());
    context = made.value();
    tcp::acceptor acceptor(io, tcp::endpoint(asio::ip::make_address("127.0.0.1"), 0));
    tcp::socket client(io);
    client.connect(acceptor.local_endpoint());
    sender = std::make_shared<PeerConnection>(std::move(client));
    receiver = std::make_shared<PeerConnection>(acceptor.accept());
    auto serving = UcxWorker::create(context, asio::make_strand(io), UcxThreading::kManyThreads);
    auto dialling = UcxWorker::create(context, io.get_executor(), UcxThreading::kOneThread);
    REQUIRE(serving.has_value());
    REQUIRE(dialling.has_value());
    server_worker = serving.value();
    client_worker = dialling.value();
    auto expected = server_worker->expect_link(client_worker->address());
    REQUIRE(expected.has_value());
    receiver->ucx = expected.value();
    auto dialled = client_worker->dial(server_worker->address(), receiver->ucx->token());
    REQUIRE(dialled.has_value());
    sender->ucx = dialled.value();
    auto ready = run_until_done(io, kvrelay::peer::detail::await_ucx(*sender, kvrelay::peer::detail::UcxUntil::kReady,
                                                                     5'000ms, "token answer", true));
    REQUIRE(ready.has_value());
  }
  ~UcxPair() {
    sender->close();
    receiver->close();
    client_worker->stop();
    server_worker->stop();
    io.restart();
    io.run_for(2s);
  }
  UcxPair(const UcxPair&) = delete;
  UcxPair& operator=(const UcxPair&) = delete;

  // Sends `frame` from the sender with the library's chunk stream while the receiver receives it.
  std::pair<Status, Status> stream(const EncodedEntryHeader& header, std::span<const std::uint8_t> frame,
                                   std::span<std::uint8_t> into) {
    std::optional<Status> sent;
    std::optional<Status> received;
    const std::vector<std::byte> announce;  // none: the receiver knows the header already
    kvrelay::peer::detail::ChunkStreamOptions options;
    asio::co_spawn(
        io,
        [&]() -> asio::awaitable<void> {
          sent.emplace(
              co_await kvrelay::peer::detail::send_chunk_stream(*sender, announce, header, frame, options, 5'000ms));
        },
        asio::detached);
    asio::co_spawn(
        io,
        [&]() -> asio::awaitable<void> {
          received.emplace(
              co_await kvrelay::peer::detail::receive_chunk_stream(*receiver, header, into, true, 5'000ms));
        },
        asio::detached);
    while ((!sent || !received) && io.run_one() > 0) {
    }
    REQUIRE(sent.has_value());
    REQUIRE(received.has_value());
    return {*sent, *received};
  }

  asio::io_context io;
  std::shared_ptr<UcxContext> context;
  std::shared_ptr<UcxWorker> server_worker;
  std::shared_ptr<UcxWorker> client_worker;
  std::shared_ptr<PeerConnection> sender;
  std::shared_ptr<PeerConnection> receiver;
};

EncodedEntryHeader header_for(std::uint64_t id, std::size_t bytes, std::uint32_t chunk_bytes) {
  EncodedEntryHeader header;
  header.id = id;
  header.key = {7, id};
  header.frame_bytes = bytes;
  header.chunk_bytes = chunk_bytes;
  header.window_chunks = 8;
  return header;
}

}  // namespace

TEST_CASE("ucx chunk streams of 0 bytes to 16 MiB arrive byte for byte over tcp and posix", "[ucx][unit]") {
  if (!kvrelay::peer::ucx_built()) KVRELAY_SKIP("built without UCX (libucx-dev)");
  for (const std::string tls : {"tcp", "posix"}) {
    INFO("UCX_TLS=" << tls);
    UcxPair pair(tls);
    const auto lanes = pair.sender->ucx->lanes();
    REQUIRE_FALSE(lanes.empty());
    for (const auto& lane : lanes)
      UNSCOPED_INFO("lane " << lane);
    CHECK(std::any_of(lanes.begin(), lanes.end(),
                      [&](const std::string& lane) { return lane.find(tls) != std::string::npos; }));
    std::uint64_t id = 1;
    for (const std::size_t size :
         {std::size_t{0}, std::size_t{1}, std::size_t{4097}, std::size_t{(1U << 20) + 1}, std::size_t{16U << 20}}) {
      INFO("size " << size);
      const auto frame = pattern(size, id);
      std::vector<std::uint8_t> into(size, 0);
      const auto [sent, received] = pair.stream(header_for(id, size, 256U << 10), frame, into);
      REQUIRE(sent.has_value());
      REQUIRE(received.has_value());
      CHECK(into == frame);
      CHECK(pair.sender->ucx->sends_in_flight() == 0);
      ++id;
    }
  }
}

TEST_CASE("ucx a chunk with a flipped bit fails the stream with a checksum mismatch", "[ucx][unit]") {
  if (!kvrelay::peer::ucx_built()) KVRELAY_SKIP("built without UCX (libucx-dev)");
  for (const std::string tls : {"tcp", "posix"}) {
    INFO("UCX_TLS=" << tls);
    UcxPair pair(tls);
    constexpr std::uint32_t kChunkBytes = 64U << 10;
    const auto frame = pattern(3 * kChunkBytes, 5);
    const auto header = header_for(42, frame.size(), kChunkBytes);
    // The sender's chunks by hand: running checksums of the true bytes, the third body flipped.
    kvrelay::BulkHashStream running;
    const auto stream_header = kvrelay::peer::stream_header_bytes(header);
    running.update(stream_header.data(), stream_header.size());
    std::vector<std::vector<std::byte>> bodies;
    for (std::uint32_t index = 0; index < 3; ++index) {
      const auto* chunk = reinterpret_cast<const std::byte*>(frame.data()) + std::size_t{index} * kChunkBytes;
      running.update(chunk, kChunkBytes);
      std::array<std::byte, kvrelay::peer::kChunkHeaderBytes> chunk_header{};
      kvrelay::peer::encode_chunk_header(chunk_header, {header.id, index, running.digest()});
      bodies.emplace_back(chunk, chunk + kChunkBytes);
      if (index == 2) bodies.back()[999] ^= std::byte{0x01};
      REQUIRE(pair.sender->ucx->post_chunk(chunk_header, bodies.back()).has_value());
    }
    std::vector<std::uint8_t> into(frame.size());
    auto received = run_until_done(
        pair.io, kvrelay::peer::detail::receive_chunk_stream(*pair.receiver, header, into, true, 5'000ms));
    REQUIRE_FALSE(received.has_value());
    CHECK(received.error().code == ErrorCode::kChecksumMismatch);
    CHECK(received.error().message.find("chunk 2") != std::string::npos);
  }
}

TEST_CASE("ucx an endpoint that presents no token or a wrong one is refused and its chunks go nowhere", "[ucx][unit]") {
  if (!kvrelay::peer::ucx_built()) KVRELAY_SKIP("built without UCX (libucx-dev)");
  UcxPair pair("tcp");
  // A second dialler with a token the server never issued.
  auto intruder_worker = UcxWorker::create(pair.context, pair.io.get_executor(), UcxThreading::kOneThread);
  REQUIRE(intruder_worker.has_value());
  kvrelay::peer::UcxToken forged{};
  forged.fill(std::byte{0x5A});
  auto intruder = intruder_worker.value()->dial(pair.server_worker->address(), forged);
  REQUIRE(intruder.has_value());
  // The token it presents is refused; it is never answered.
  const auto deadline = std::chrono::steady_clock::now() + 5s;
  while (pair.server_worker->refused_endpoints() < 1 && std::chrono::steady_clock::now() < deadline)
    pair.io.run_for(20ms);
  CHECK(pair.server_worker->refused_endpoints() == 1);
  CHECK_FALSE(intruder.value()->ready());
  // The genuine link still carries a stream.
  const auto frame = pattern(100'000, 9);
  std::vector<std::uint8_t> into(frame.size());
  const auto [sent, received] = pair.stream(header_for(3, frame.size(), 32U << 10), frame, into);
  CHECK(sent.has_value());
  CHECK(received.has_value());
  CHECK(into == frame);
  intruder.value()->close();
  intruder_worker.value()->stop();
}
