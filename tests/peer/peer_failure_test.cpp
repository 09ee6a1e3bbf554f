#include <xxhash.h>

#include <boost/asio/connect.hpp>
#include <boost/asio/io_context.hpp>
#include <boost/asio/ip/tcp.hpp>
#include <boost/asio/read.hpp>
#include <boost/asio/write.hpp>
#include <catch2/catch.hpp>
#include <fmt/format.h>

#include <algorithm>
#include <atomic>
#include <csignal>
#include <cstring>
#include <sstream>
#include <thread>
#include <vector>

#include "kvrelay/core/byte_io.h"

#include "support/peer_fixture.h"

namespace kvrelay::test {

namespace {

namespace asio = boost::asio;
using asio::ip::tcp;

constexpr std::size_t kFrameBytes = 16U << 20;
constexpr std::uint32_t kChunkBytes = 256U << 10;

// One spinning thread per core until stop().
class CpuHogs {
 public:
  CpuHogs() {
    for (unsigned core = 0; core < std::max(1U, std::thread::hardware_concurrency()); ++core) {
      threads_.emplace_back([this] {
        while (!stop_.load(std::memory_order_relaxed)) {
        }
      });
    }
  }
  CpuHogs(const CpuHogs&) = delete;
  CpuHogs& operator=(const CpuHogs&) = delete;
  ~CpuHogs() { stop(); }
  void stop() {
    stop_ = true;
    for (auto& thread : threads_) {
      if (thread.joinable()) thread.join();
    }
  }

 private:
  std::atomic<bool> stop_{false};
  std::vector<std::thread> threads_;
};

// `kvrelay peer send` of `file` to `daemon` in kChunkBytes chunks.
std::vector<std::string> send_argv(const PeerDaemon& daemon, std::uint64_t transfer_id,
                                   const std::filesystem::path& file, const KvFrame& frame, bool paced) {
  return peer_send_argv(daemon, transfer_id, file, frame, kChunkBytes, paced);
}

// A hand-driven peer connection for sending frames the real client never would.
class RawPeer {
 public:
  explicit RawPeer(const PeerDaemon& daemon) : socket_(io_) {
    socket_.connect(tcp::endpoint(asio::ip::make_address("127.0.0.1"), daemon.peer_address().port));
    peer::Hello hello;
    hello.node_id = "raw";
    hello.capabilities |= peer::kCapFidelity;
    write(peer::encode_hello(peer::PeerMessage::kHello, hello));
    REQUIRE(read_frame().first == peer::PeerMessage::kHelloOk);
  }
  void write(const std::vector<std::byte>& bytes) { asio::write(socket_, asio::buffer(bytes)); }
  std::pair<peer::PeerMessage, std::vector<std::byte>> read_frame() {
    std::array<std::byte, peer::kPeerHeaderBytes> header{};
    asio::read(socket_, asio::buffer(header));
    auto decoded = peer::decode_peer_header(header);
    REQUIRE(decoded.has_value());
    std::vector<std::byte> payload(decoded.value().length);
    asio::read(socket_, asio::buffer(payload));
    return {decoded.value().type, std::move(payload)};
  }
  void send_chunk(std::uint64_t transfer_id, std::uint32_t index, std::span<const std::byte> data,
                  std::uint64_t checksum) {
    std::vector<std::byte> frame(peer::kPeerHeaderBytes + peer::kChunkHeaderBytes + data.size());
    peer::encode_peer_header(std::span<std::byte, peer::kPeerHeaderBytes>(frame.data(), peer::kPeerHeaderBytes),
                             peer::PeerMessage::kChunk,
                             static_cast<std::uint32_t>(peer::kChunkHeaderBytes + data.size()));
    peer::encode_chunk_header(
        std::span<std::byte, peer::kChunkHeaderBytes>(frame.data() + peer::kPeerHeaderBytes, peer::kChunkHeaderBytes),
        {transfer_id, index, checksum});
    std::memcpy(frame.data() + peer::kPeerHeaderBytes + peer::kChunkHeaderBytes, data.data(), data.size());
    write(frame);
  }
  // Reads frames until an error frame or the connection closing; returns the error code seen.
  std::optional<ErrorCode> error_then_close() {
    std::optional<ErrorCode> code;
    try {
      while (true) {
        auto [type, payload] = read_frame();
        if (type == peer::PeerMessage::kError) code = peer::decode_peer_error(payload).code;
      }
    } catch (const boost::system::system_error&) {
    }
    return code;
  }

 private:
  asio::io_context io_;
  tcp::socket socket_;
};

// A push of `frame` in chunks of `chunk_bytes`, chunk i carrying the running xxh3 of the stream
// header and chunks 0..i.
// Its token ids are the frame's, under the chain root `id` (a key of its own per id).
struct HandPush {
  peer::EncodedEntryHeader header;
  std::span<const std::byte> bytes;
  HandPush(std::uint64_t id, std::uint64_t model_id, const KvFrame& frame, std::uint32_t chunk_bytes,
           std::uint32_t window)
      : bytes(std::as_bytes(std::span(frame.frame))) {
    header.id = id;
    header.chain = frame.chain_at(id);
    header.key = KvFrame::key_for(model_id, header.chain);
    header.frame_bytes = frame.frame.size();
    header.chunk_bytes = chunk_bytes;
    header.window_chunks = window;
  }
  [[nodiscard]] std::span<const std::byte> chunk(std::uint32_t index) const {
    const std::size_t offset = index * std::size_t{header.chunk_bytes};
    return bytes.subspan(offset, std::min<std::size_t>(header.chunk_bytes, bytes.size() - offset));
  }
  [[nodiscard]] std::uint64_t running(std::uint32_t index) const {
    const auto stream_header = peer::stream_header_bytes(header);
    std::vector<std::byte> covered(stream_header.begin(), stream_header.end());
    const auto end = std::min<std::size_t>(bytes.size(), (index + 1) * std::size_t{header.chunk_bytes});
    covered.insert(covered.end(), bytes.begin(), bytes.begin() + static_cast<std::ptrdiff_t>(end));
    return XXH3_64bits(covered.data(), covered.size());
  }
  [[nodiscard]] std::uint32_t chunks() const { return static_cast<std::uint32_t>(header.chunk_count()); }
};

}  // namespace

TEST_CASE("push sender killed at 10, 50 and 90 percent: receiver fails it, keeps nothing, a retry lands",
          "[peer][crash][fault]") {
  PeerDaemon daemon;
  TempDir dir;
  const auto frame = kv_frame(kFrameBytes, 9);
  write_frame_file(dir / "kv.frame", frame);
  write_tokens_file(dir / "tokens.json", frame);
  auto local = daemon.data_plane();
  std::uint64_t failures_before = 0;
  std::uint64_t transfer_id = 500;
  for (const double percent : {0.10, 0.50, 0.90}) {
    INFO("killed at " << percent * 100 << "%");
    ++transfer_id;
    const auto arena_before = local.stats().value().arena_bytes_in_use;
    std::vector<std::string> argv = send_argv(daemon, transfer_id, dir / "kv.frame", frame, true);
    ChildProcess sender(argv, dir.path());
    REQUIRE(
        wait_until([&] { return printed_progress(sender) >= percent || !sender.running(); }, std::chrono::seconds(30)));
    REQUIRE(sender.running());
    sender.send_signal(SIGKILL);
    REQUIRE(sender.wait_for_exit(std::chrono::seconds(5)).has_value());
    // The receiver sees the dead connection at once and fails the push (goal: within 1 s).
    REQUIRE(wait_until([&] { return daemon.peer_stats().failed_transfers == failures_before + 1; },
                       std::chrono::seconds(1)));
    failures_before += 1;
    CHECK(daemon.peer_stats().active_transfers == 0);
    CHECK(local.lookup(KvFrame::key_for(1, frame.chain_at(transfer_id))).error().code == ErrorCode::kNotFound);
    CHECK(local.stats().value().arena_bytes_in_use == arena_before);

    const auto retry = run_command(send_argv(daemon, transfer_id, dir / "kv.frame", frame, false), dir.path());
    REQUIRE(retry.exit_status == 0);
    CHECK(nlohmann::json::parse(retry.out.substr(retry.out.rfind("{")))["outcome"] == "committed");
    auto entry = local.lookup(KvFrame::key_for(1, frame.chain_at(transfer_id)));
    REQUIRE(entry.has_value());
    CHECK(same_bytes(entry.value().bytes(), frame.kv));
  }
  const auto stats = daemon.peer_stats();
  CHECK(stats.committed_transfers == 3);
  CHECK(stats.failed_transfers == 3);
  CHECK(local.stats().value().entries == 3);
}

TEST_CASE("push receiver killed at 10, 50 and 90 percent: sender errors out, a retry lands", "[peer][crash][fault]") {
  TempDir dir;
  const auto frame = kv_frame(kFrameBytes, 10);
  write_frame_file(dir / "kv.frame", frame);
  write_tokens_file(dir / "tokens.json", frame);
  for (const double percent : {0.10, 0.50, 0.90}) {
    INFO("receiver killed at " << percent * 100 << "%");
    const std::uint64_t transfer_id = 900;
    {
      // Every core busy while the receiver runs and dies, as on a loaded node: the kernel closes a
      // killed process's sockets only once each of its threads has run to its exit.
      CpuHogs hogs;
      PeerDaemon doomed;
      ChildProcess sender(send_argv(doomed, transfer_id, dir / "kv.frame", frame, true), dir.path());
      REQUIRE(wait_until([&] { return printed_progress(sender) >= percent || !sender.running(); },
                         std::chrono::seconds(30)));
      REQUIRE(sender.running());
      doomed.process().send_signal(SIGKILL);
      // The sender's next write or read fails at once (goal: within 1 s).
      const auto status = sender.wait_for_exit(std::chrono::seconds(1));
      hogs.stop();
      REQUIRE(status.has_value());
      CHECK(*status == 1);
      CHECK(sender.stderr_text().find("kvrelay peer:") != std::string::npos);
    }
    PeerDaemon fresh;
    const auto retry = run_command(send_argv(fresh, transfer_id, dir / "kv.frame", frame, false), dir.path());
    REQUIRE(retry.exit_status == 0);
    auto local = fresh.data_plane();
    auto entry = local.lookup(KvFrame::key_for(1, frame.chain_at(transfer_id)));
    REQUIRE(entry.has_value());
    CHECK(same_bytes(entry.value().bytes(), frame.kv));
    CHECK(local.stats().value().entries == 1);
    CHECK(fresh.peer_stats().committed_transfers == 1);
  }
}

TEST_CASE("a pushed chunk with a flipped bit, or with its own checksum instead of the running one, is never filed",
          "[peer][hostile][fault]") {
  PeerDaemon daemon;
  const auto frame = kv_frame(3 * kChunkBytes + 7, 77);
  const HandPush push(4242, 1, frame, kChunkBytes, 8);
  auto local = daemon.data_plane();
  SECTION("the announced key differs from the one the checksums cover") {
    RawPeer raw(daemon);
    auto lying = push.header;
    lying.key.context_hash ^= 1U << 7;
    raw.write(peer::encode_push_encoded(lying));
    raw.send_chunk(push.header.id, 0, push.chunk(0), push.running(0));
    CHECK(raw.error_then_close() == ErrorCode::kChecksumMismatch);
    CHECK(local.lookup(lying.key).error().code == ErrorCode::kNotFound);
  }
  SECTION("a bit flipped in the third chunk") {
    RawPeer raw(daemon);
    raw.write(peer::encode_push_encoded(push.header));
    for (std::uint32_t index = 0; index < 3; ++index) {
      auto data = std::vector<std::byte>(push.chunk(index).begin(), push.chunk(index).end());
      if (index == 2) data[999] ^= std::byte{0x01};
      raw.send_chunk(push.header.id, index, data, push.running(index));
    }
    CHECK(raw.error_then_close() == ErrorCode::kChecksumMismatch);
  }
  SECTION("chunks carrying their own checksums") {
    RawPeer raw(daemon);
    raw.write(peer::encode_push_encoded(push.header));
    raw.send_chunk(push.header.id, 0, push.chunk(0), push.running(0));
    const auto second = push.chunk(1);
    raw.send_chunk(push.header.id, 1, second, XXH3_64bits(second.data(), second.size()));
    CHECK(raw.error_then_close() == ErrorCode::kChecksumMismatch);
  }
  CHECK(local.lookup(push.header.key).error().code == ErrorCode::kNotFound);
  REQUIRE(wait_until([&] { return daemon.peer_stats().failed_transfers == 1; }, std::chrono::seconds(5)));
  CHECK(daemon.peer_stats().active_transfers == 0);
  // The same push sent cleanly is filed.
  auto client = peer::PeerClient::connect(daemon.peer_address(), {});
  REQUIRE(client.has_value());
  REQUIRE(client.value().push_encoded(push.header.id, push.header.key, push.header.chain, frame.bytes()).has_value());
  CHECK(same_bytes(local.lookup(push.header.key).value().bytes(), frame.kv));
}

TEST_CASE("chunk acknowledgements come every half window, the last one with Committed", "[peer]") {
  PeerDaemon daemon;
  const auto frame = kv_frame(3 * kChunkBytes + 4096, 93);  // four chunks, the last short
  // What the receiver answers a push of four chunks in a window of `window`, as (type, index or id).
  const auto answers = [&](std::uint32_t window, std::uint64_t id) {
    const HandPush push(id, 1, frame, kChunkBytes, window);
    REQUIRE(push.chunks() == 4);
    RawPeer raw(daemon);
    raw.write(peer::encode_push_encoded(push.header));
    for (std::uint32_t index = 0; index < push.chunks(); ++index)
      raw.send_chunk(id, index, push.chunk(index), push.running(index));
    std::vector<std::pair<peer::PeerMessage, std::uint64_t>> seen;
    while (seen.empty() || seen.back().first != peer::PeerMessage::kCommitted) {
      auto [type, payload] = raw.read_frame();
      REQUIRE(type != peer::PeerMessage::kError);
      ByteReader reader(payload);
      const auto got = reader.get<std::uint64_t>();
      REQUIRE(got.has_value());
      CHECK(*got == id);
      std::uint64_t value = *got;
      if (type == peer::PeerMessage::kChunkAck) value = reader.get<std::uint32_t>().value();
      seen.emplace_back(type, value);
    }
    CHECK(same_bytes(daemon.data_plane().lookup(push.header.key).value().bytes(), frame.kv));
    return seen;
  };
  using peer::PeerMessage;
  SECTION("a window of one: every chunk") {
    const std::vector<std::pair<PeerMessage, std::uint64_t>> expected{{PeerMessage::kChunkAck, 0},
                                                                      {PeerMessage::kChunkAck, 1},
                                                                      {PeerMessage::kChunkAck, 2},
                                                                      {PeerMessage::kChunkAck, 3},
                                                                      {PeerMessage::kCommitted, 801}};
    CHECK(answers(1, 801) == expected);
  }
  SECTION("a window of four: every second chunk") {
    const std::vector<std::pair<PeerMessage, std::uint64_t>> expected{
        {PeerMessage::kChunkAck, 1}, {PeerMessage::kChunkAck, 3}, {PeerMessage::kCommitted, 802}};
    CHECK(answers(4, 802) == expected);
  }
}

TEST_CASE("peer refuses malformed frames, out-of-order chunks and retired messages", "[peer][hostile][fault]") {
  PeerDaemon daemon;
  const auto frame = kv_frame(200, 1);
  SECTION("bad magic before the hello") {
    asio::io_context io;
    tcp::socket socket(io);
    socket.connect(tcp::endpoint(asio::ip::make_address("127.0.0.1"), daemon.peer_address().port));
    std::vector<std::byte> junk(64, std::byte{0x41});
    asio::write(socket, asio::buffer(junk));
    std::array<std::byte, peer::kPeerHeaderBytes> header{};
    asio::read(socket, asio::buffer(header));
    CHECK(peer::decode_peer_header(header).value().type == peer::PeerMessage::kError);
  }
  SECTION("a frame longer than its type allows") {
    RawPeer raw(daemon);
    std::vector<std::byte> bytes(peer::kPeerHeaderBytes);
    peer::encode_peer_header(std::span<std::byte, peer::kPeerHeaderBytes>(bytes.data(), peer::kPeerHeaderBytes),
                             peer::PeerMessage::kPing, 1U << 30);
    raw.write(bytes);
    CHECK(raw.error_then_close() == ErrorCode::kProtocol);
  }
  SECTION("a chunk outside any stream, and a chunk out of order") {
    RawPeer raw(daemon);
    const auto data = peer_pattern(100, 1);
    raw.send_chunk(1, 0, data, XXH3_64bits(data.data(), data.size()));
    CHECK(raw.error_then_close() == ErrorCode::kProtocol);
    RawPeer second(daemon);
    const HandPush push(2, 1, frame, 100, 8);
    second.write(peer::encode_push_encoded(push.header));
    second.send_chunk(2, 1, push.chunk(1), push.running(1));
    CHECK(second.error_then_close() == ErrorCode::kProtocol);
  }
  SECTION("version 1's Begin, which no version 2 sidecar takes") {
    RawPeer raw(daemon);
    raw.write(peer::encode_peer_frame(static_cast<peer::PeerMessage>(3), std::vector<std::byte>(64)));
    CHECK(raw.error_then_close() == ErrorCode::kProtocol);
  }
  SECTION("a push larger than the receiver takes") {
    RawPeer raw(daemon);
    HandPush huge(3, 1, frame, 1U << 20, 8);
    huge.header.frame_bytes = 3ULL << 30;  // over the fixture's 2 GiB store
    raw.write(peer::encode_push_encoded(huge.header));
    CHECK(raw.error_then_close() == ErrorCode::kResourceExhausted);
  }
  SECTION("a push whose chunks hold no KV frame") {
    RawPeer raw(daemon);
    const auto junk = peer_pattern(200, 5);
    peer::EncodedEntryHeader header;
    header.id = 4;
    header.key = {1, 4};
    header.frame_bytes = junk.size();
    header.chunk_bytes = 1U << 20;
    raw.write(peer::encode_push_encoded(header));
    raw.send_chunk(4, 0, junk, XXH3_64bits(junk.data(), junk.size()));
    CHECK(raw.error_then_close().has_value());
  }
  REQUIRE(wait_until([&] { return daemon.peer_stats().active_transfers == 0; }, std::chrono::seconds(5)));
  CHECK(daemon.data_plane().stats().value().entries == 0);
}

namespace {

// A listener in the test process that answers one connection the way a kvrelay of wire
// version 1 did: it could not read a version 2 header and said so in a version 1 error.
class VersionOneSidecar {
 public:
  VersionOneSidecar() : acceptor_(io_, tcp::endpoint(asio::ip::make_address("127.0.0.1"), 0)) {
    thread_ = std::thread([this] {
      boost::system::error_code ec;
      tcp::socket socket(io_);
      acceptor_.accept(socket, ec);
      if (ec) return;
      std::array<std::byte, peer::kPeerHeaderBytes> header{};
      asio::read(socket, asio::buffer(header), ec);
      const auto refusal =
          peer::encode_peer_error_for_version(Error{ErrorCode::kBadVersion, "peer protocol version 2"}, 1);
      asio::write(socket, asio::buffer(refusal), ec);
    });
  }
  ~VersionOneSidecar() {
    boost::system::error_code ignored;
    acceptor_.close(ignored);
    thread_.join();
  }
  VersionOneSidecar(const VersionOneSidecar&) = delete;
  VersionOneSidecar& operator=(const VersionOneSidecar&) = delete;
  [[nodiscard]] HostPort address() const { return {"127.0.0.1", acceptor_.local_endpoint().port()}; }

 private:
  asio::io_context io_;
  tcp::acceptor acceptor_;
  std::thread thread_;
};

}  // namespace

TEST_CASE("wire versions: a version 1 peer and this one refuse each other by name, in words each can read",
          "[peer][hostile][fault]") {
  SECTION("a version 1, 3 or 4 hello to this sidecar gets an error of its version, and the sidecar serves on") {
    // Versions 3 and 4 have version 5's hello layout: only the version tells them apart.
    const std::uint16_t version = GENERATE(std::uint16_t{1}, std::uint16_t{3}, std::uint16_t{4});
    INFO("wire version " << version);
    PeerDaemon daemon;
    asio::io_context io;
    tcp::socket socket(io);
    socket.connect(tcp::endpoint(asio::ip::make_address("127.0.0.1"), daemon.peer_address().port));
    ByteWriter hello;
    hello.put(std::uint32_t{version}).put(std::uint64_t{1}).put_string("old-node").put(std::uint32_t{16U << 20});
    hello.put_string("");
    std::vector<std::byte> frame(peer::kPeerHeaderBytes);
    const std::uint32_t magic = peer::kPeerMagic;
    const std::uint16_t type = 1;
    const auto length = static_cast<std::uint32_t>(hello.bytes().size());
    std::memcpy(frame.data(), &magic, 4);
    std::memcpy(frame.data() + 4, &version, 2);
    std::memcpy(frame.data() + 6, &type, 2);
    std::memcpy(frame.data() + 8, &length, 4);
    frame.insert(frame.end(), hello.bytes().begin(), hello.bytes().end());
    asio::write(socket, asio::buffer(frame));
    std::array<std::byte, peer::kPeerHeaderBytes> header{};
    asio::read(socket, asio::buffer(header));
    // What a version 1 reader checks: magic, its own version, the error type.
    std::uint16_t reply_version = 0;
    std::uint16_t reply_type = 0;
    std::uint32_t reply_length = 0;
    std::memcpy(&reply_version, header.data() + 4, 2);
    std::memcpy(&reply_type, header.data() + 6, 2);
    std::memcpy(&reply_length, header.data() + 8, 4);
    CHECK(reply_version == version);
    CHECK(reply_type == static_cast<std::uint16_t>(peer::PeerMessage::kError));
    std::vector<std::byte> payload(reply_length);
    asio::read(socket, asio::buffer(payload));
    const auto error = peer::decode_peer_error(payload);
    CHECK(error.code == ErrorCode::kBadVersion);
    CHECK_THAT(error.message, Catch::Contains(fmt::format("wire version {}", peer::kPeerVersion)) &&
                                  Catch::Contains(fmt::format("not version {}", version)));
    auto current = peer::PeerClient::connect(daemon.peer_address(), {});
    REQUIRE(current.has_value());
    CHECK(current.value().ping().has_value());
  }
  SECTION("this client against a version 1 sidecar fails its connect with both versions named") {
    VersionOneSidecar old;
    auto client = peer::PeerClient::connect(old.address(), {});
    REQUIRE_FALSE(client.has_value());
    CHECK(client.error().code == ErrorCode::kBadVersion);
    CHECK_THAT(client.error().message, Catch::Contains("wire version 1") &&
                                           Catch::Contains(fmt::format("speaks {}", peer::kPeerVersion)) &&
                                           Catch::Contains("peer protocol version 2"));
  }
}

}  // namespace kvrelay::test
