#include <xxhash.h>

#include <boost/asio/connect.hpp>
#include <boost/asio/io_context.hpp>
#include <boost/asio/ip/tcp.hpp>
#include <boost/asio/read.hpp>
#include <boost/asio/write.hpp>
#include <catch2/catch.hpp>

#include <algorithm>
#include <atomic>
#include <csignal>
#include <cstring>
#include <sstream>
#include <thread>
#include <vector>

#include "kvrelay/shm_transport/byte_io.h"

#include "peer_fixture.h"

namespace kvrelay::test {

namespace {

namespace asio = boost::asio;
using asio::ip::tcp;
namespace peer = proxy::peer;

constexpr std::size_t kFileBytes = 16U << 20;
constexpr std::uint32_t kChunkBytes = 256U << 10;

// Last "progress DONE TOTAL" fraction a sender printed, 0 when none yet.
double sender_progress(const ChildProcess& sender) {
  std::istringstream lines(sender.stdout_text());
  std::string word;
  double fraction = 0;
  std::uint64_t done = 0;
  std::uint64_t total = 0;
  while (lines >> word) {
    if (word == "progress" && lines >> done >> total && total > 0) {
      fraction = static_cast<double>(done) / static_cast<double>(total);
    }
  }
  return fraction;
}

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

std::vector<std::string> send_argv(const PeerDaemon& daemon, std::uint64_t transfer_id,
                                   const std::filesystem::path& file, bool paced) {
  std::vector<std::string> argv{kvrelay_binary().string(),
                                "peer",
                                "send",
                                "--to",
                                daemon.peer_text(),
                                "--transfer-id",
                                std::to_string(transfer_id),
                                "--chunk-bytes",
                                std::to_string(kChunkBytes),
                                "--window",
                                "2",
                                "--progress"};
  if (paced) argv.insert(argv.end(), {"--rate-limit-mib", "24"});
  argv.push_back(file.string());
  return argv;
}

// A hand-driven peer connection for sending frames the real client never would.
class RawPeer {
 public:
  explicit RawPeer(const PeerDaemon& daemon, std::uint64_t extra_capabilities = 0) : socket_(io_) {
    socket_.connect(tcp::endpoint(asio::ip::make_address("127.0.0.1"), daemon.peer_address().port));
    peer::Hello hello;
    hello.node_id = "raw";
    hello.capabilities |= extra_capabilities;
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

}  // namespace

TEST_CASE("peer sender killed at 10, 50 and 90 percent: receiver fails it, keeps nothing, retry lands once",
          "[peer][crash][fault]") {
  PeerDaemon daemon;
  TempDir dir;
  const auto bytes = peer_pattern(kFileBytes, 9);
  write_file(dir / "payload", std::string(reinterpret_cast<const char*>(bytes.data()), bytes.size()));
  auto local = daemon.data_plane();
  std::uint64_t failures_before = 0;
  std::uint64_t transfer_id = 500;
  for (const double percent : {0.10, 0.50, 0.90}) {
    INFO("killed at " << percent * 100 << "%");
    ++transfer_id;
    const auto arena_before = local.stats().value().arena_bytes_in_use;
    ChildProcess sender(send_argv(daemon, transfer_id, dir / "payload", true), dir.path());
    REQUIRE(
        wait_until([&] { return sender_progress(sender) >= percent || !sender.running(); }, std::chrono::seconds(30)));
    REQUIRE(sender.running());
    sender.send_signal(SIGKILL);
    REQUIRE(sender.wait_for_exit(std::chrono::seconds(5)).has_value());
    // The receiver sees the dead connection at once and fails the transfer (goal: within 1 s).
    REQUIRE(wait_until([&] { return daemon.peer_stats().failed_transfers == failures_before + 1; },
                       std::chrono::seconds(1)));
    failures_before += 1;
    CHECK(daemon.peer_stats().active_transfers == 0);
    CHECK(local.lookup({1, transfer_id}).error().code == ErrorCode::kNotFound);
    // The half-received entry's arena block went back with the failed transfer.
    CHECK(local.stats().value().arena_bytes_in_use == arena_before);

    const auto retry = run_command(send_argv(daemon, transfer_id, dir / "payload", false), dir.path());
    REQUIRE(retry.exit_status == 0);
    CHECK(nlohmann::json::parse(retry.out.substr(retry.out.rfind("{")))["outcome"] == "committed");
    const auto again = run_command(send_argv(daemon, transfer_id, dir / "payload", false), dir.path());
    REQUIRE(again.exit_status == 0);
    CHECK(nlohmann::json::parse(again.out.substr(again.out.rfind("{")))["outcome"] == "already_committed");
    auto entry = local.lookup({1, transfer_id});
    REQUIRE(entry.has_value());
    CHECK(same_bytes(entry.value().bytes(), bytes));
  }
  const auto stats = daemon.peer_stats();
  CHECK(stats.committed_transfers == 3);
  CHECK(stats.duplicate_transfers == 3);
  CHECK(local.stats().value().entries == 3);
}

TEST_CASE("peer receiver killed at 10, 50 and 90 percent: sender errors out, retry lands once",
          "[peer][crash][fault]") {
  TempDir dir;
  const auto bytes = peer_pattern(kFileBytes, 10);
  write_file(dir / "payload", std::string(reinterpret_cast<const char*>(bytes.data()), bytes.size()));
  for (const double percent : {0.10, 0.50, 0.90}) {
    INFO("receiver killed at " << percent * 100 << "%");
    const std::uint64_t transfer_id = 900;
    {
      // Every core busy while the receiver runs and dies, as on a loaded node: the kernel closes a
      // killed process's sockets only once each of its threads has run to its exit, so a
      // background thread starved of CPU (as SCHED_IDLE ones are) would hold the connection open
      // for seconds.
      CpuHogs hogs;
      PeerDaemon doomed;
      ChildProcess sender(send_argv(doomed, transfer_id, dir / "payload", true), dir.path());
      REQUIRE(wait_until([&] { return sender_progress(sender) >= percent || !sender.running(); },
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
    const auto retry = run_command(send_argv(fresh, transfer_id, dir / "payload", false), dir.path());
    REQUIRE(retry.exit_status == 0);
    const auto again = run_command(send_argv(fresh, transfer_id, dir / "payload", false), dir.path());
    REQUIRE(again.exit_status == 0);
    CHECK(nlohmann::json::parse(again.out.substr(again.out.rfind("{")))["outcome"] == "already_committed");
    auto local = fresh.data_plane();
    auto entry = local.lookup({1, transfer_id});
    REQUIRE(entry.has_value());
    CHECK(same_bytes(entry.value().bytes(), bytes));
    CHECK(local.stats().value().entries == 1);
    CHECK(fresh.peer_stats().committed_transfers == 1);
  }
}

TEST_CASE("peer chunk with a flipped bit is detected and never committed, a clean retry lands",
          "[peer][hostile][fault]") {
  PeerDaemon daemon;
  const auto bytes = peer_pattern(2 * kChunkBytes, 77);
  peer::Begin begin;
  begin.transfer_id = 4242;
  begin.key = {1, 4242};
  begin.info = shm::EntryInfo{KvLayout{}, bytes.size(), XXH3_64bits(bytes.data(), bytes.size())};
  begin.chunk_bytes = kChunkBytes;
  {
    RawPeer raw(daemon);
    raw.write(peer::encode_begin(begin));
    REQUIRE(raw.read_frame().first == peer::PeerMessage::kBeginOk);
    const std::span first(bytes.data(), kChunkBytes);
    raw.send_chunk(begin.transfer_id, 0, first, XXH3_64bits(first.data(), first.size()));
    auto second = std::vector<std::byte>(bytes.begin() + kChunkBytes, bytes.end());
    const auto checksum = XXH3_64bits(second.data(), second.size());
    second[12345] ^= std::byte{0x10};  // one bit flipped "in transit"
    raw.send_chunk(begin.transfer_id, 1, second, checksum);
    CHECK(raw.error_then_close() == ErrorCode::kChecksumMismatch);
  }
  auto local = daemon.data_plane();
  CHECK(local.lookup(begin.key).error().code == ErrorCode::kNotFound);
  REQUIRE(wait_until([&] { return daemon.peer_stats().failed_transfers == 1; }, std::chrono::seconds(5)));

  SECTION("a whole-entry checksum that does not match the chunks is refused too") {
    RawPeer raw(daemon);
    auto lying = begin;
    lying.info.checksum ^= 1U;
    raw.write(peer::encode_begin(lying));
    REQUIRE(raw.read_frame().first == peer::PeerMessage::kBeginOk);
    for (std::uint32_t index = 0; index < 2; ++index) {
      const std::span chunk(bytes.data() + index * kChunkBytes, kChunkBytes);
      raw.send_chunk(begin.transfer_id, index, chunk, XXH3_64bits(chunk.data(), chunk.size()));
    }
    CHECK(raw.error_then_close() == ErrorCode::kChecksumMismatch);
    CHECK(local.lookup(begin.key).error().code == ErrorCode::kNotFound);
  }
  SECTION("the same transfer id sent cleanly commits once") {
    auto client = peer::PeerClient::connect(daemon.peer_address(), {});
    REQUIRE(client.has_value());
    REQUIRE(client.value().send(begin.transfer_id, begin.key, KvLayout{}, bytes).value() ==
            peer::TransferOutcome::kCommitted);
    auto entry = local.lookup(begin.key);
    REQUIRE(entry.has_value());
    CHECK(same_bytes(entry.value().bytes(), bytes));
  }
}

TEST_CASE("running chunk checksums: a flipped bit or a chunk's own checksum is refused, the entry gets the whole one",
          "[peer][hostile][fault]") {
  PeerDaemon daemon;
  const auto bytes = peer_pattern(3 * kChunkBytes + 7, 91);
  const auto whole = XXH3_64bits(bytes.data(), bytes.size());
  peer::Begin begin;
  begin.transfer_id = 5151;
  begin.key = {1, 5151};
  begin.info = shm::EntryInfo{KvLayout{}, bytes.size(), 0};
  begin.chunk_bytes = kChunkBytes;
  begin.running_checksums = true;
  // Chunk i's checksum: the xxh3 of chunks 0..i.
  const auto running = [&](std::uint32_t index) {
    return XXH3_64bits(bytes.data(), std::min<std::size_t>(bytes.size(), (index + 1) * std::size_t{kChunkBytes}));
  };
  const auto chunk = [&](std::uint32_t index) {
    const std::size_t offset = index * std::size_t{kChunkBytes};
    return std::vector<std::byte>(
        bytes.begin() + static_cast<std::ptrdiff_t>(offset),
        bytes.begin() + static_cast<std::ptrdiff_t>(std::min(bytes.size(), offset + kChunkBytes)));
  };
  auto local = daemon.data_plane();

  SECTION("the receiver announces running checksums and the client uses them") {
    auto client = peer::PeerClient::connect(daemon.peer_address(), {});
    REQUIRE(client.has_value());
    CHECK((client.value().remote().capabilities & peer::kCapRunningChecksums) != 0);
    REQUIRE(client.value().send(begin.transfer_id, begin.key, KvLayout{}, bytes).value() ==
            peer::TransferOutcome::kCommitted);
    auto entry = local.lookup(begin.key);
    REQUIRE(entry.has_value());
    CHECK(same_bytes(entry.value().bytes(), bytes));
    CHECK(entry.value().info.checksum == whole);
  }
  SECTION("a bit flipped in the third chunk") {
    RawPeer raw(daemon);
    raw.write(peer::encode_begin(begin));
    REQUIRE(raw.read_frame().first == peer::PeerMessage::kBeginOk);
    for (std::uint32_t index = 0; index < 4; ++index) {
      auto data = chunk(index);
      if (index == 2) data[999] ^= std::byte{0x01};
      raw.send_chunk(begin.transfer_id, index, data, running(index));
      if (index == 2) break;
    }
    CHECK(raw.error_then_close() == ErrorCode::kChecksumMismatch);
    CHECK(local.lookup(begin.key).error().code == ErrorCode::kNotFound);
  }
  SECTION("chunks carrying their own checksums instead of the running ones") {
    RawPeer raw(daemon);
    raw.write(peer::encode_begin(begin));
    REQUIRE(raw.read_frame().first == peer::PeerMessage::kBeginOk);
    const auto first = chunk(0);
    raw.send_chunk(begin.transfer_id, 0, first, running(0));  // the first chunk's are the same
    const auto second = chunk(1);
    raw.send_chunk(begin.transfer_id, 1, second, XXH3_64bits(second.data(), second.size()));
    CHECK(raw.error_then_close() == ErrorCode::kChecksumMismatch);
    CHECK(local.lookup(begin.key).error().code == ErrorCode::kNotFound);
  }
  SECTION("a running begin that also carries a whole checksum is malformed") {
    RawPeer raw(daemon);
    auto frame = peer::encode_begin(begin);
    // Payload: transfer id (8), key (16), layout (24), bytes (8), then the checksum.
    std::memcpy(frame.data() + peer::kPeerHeaderBytes + 56, &whole, sizeof(whole));
    raw.write(frame);
    CHECK(raw.error_then_close() == ErrorCode::kProtocol);
  }
  REQUIRE(wait_until([&] { return daemon.peer_stats().active_transfers == 0; }, std::chrono::seconds(5)));
}

TEST_CASE("eager chunks: a receiver that will not take a transfer drops them and answers in step",
          "[peer][hostile][fault]") {
  PeerDaemon daemon;
  auto local = daemon.data_plane();
  peer::PeerClientOptions options;
  options.chunk_bytes = 64 * 1024;  // 4 chunks, all of them eager (window 8)
  const auto first = peer_pattern(3 * options.chunk_bytes + 5, 31);
  const auto second = peer_pattern(2 * options.chunk_bytes, 32);

  SECTION("a retried id: its eager chunks are dropped, and the same connection carries the next transfer") {
    auto client = peer::PeerClient::connect(daemon.peer_address(), options);
    REQUIRE(client.has_value());
    REQUIRE(client.value().send(70, {1, 70}, KvLayout{}, first).value() == peer::TransferOutcome::kCommitted);
    REQUIRE(client.value().send(70, {1, 70}, KvLayout{}, first).value() == peer::TransferOutcome::kAlreadyCommitted);
    REQUIRE(client.value().send(71, {1, 71}, KvLayout{}, second).value() == peer::TransferOutcome::kCommitted);
    CHECK(same_bytes(local.lookup({1, 70}).value().bytes(), first));
    CHECK(same_bytes(local.lookup({1, 71}).value().bytes(), second));
    const auto stats = daemon.peer_stats();
    CHECK(stats.committed_transfers == 2);
    CHECK(stats.duplicate_transfers == 1);
  }
  SECTION("a transfer over the receiver's limit: its eager chunks are read, then the refusal arrives") {
    RawPeer raw(daemon);
    peer::Begin huge;
    huge.transfer_id = 72;
    huge.key = {1, 72};
    huge.info = shm::EntryInfo{KvLayout{}, 3ULL << 30, 0};  // over the fixture's 2 GiB store
    huge.chunk_bytes = 1U << 20;
    huge.running_checksums = true;
    huge.eager_chunks = 2;
    raw.write(peer::encode_begin(huge));
    const auto chunk = peer_pattern(huge.chunk_bytes, 72);
    raw.send_chunk(huge.transfer_id, 0, chunk, XXH3_64bits(chunk.data(), chunk.size()));
    raw.send_chunk(huge.transfer_id, 1, chunk, 0);
    CHECK(raw.error_then_close() == ErrorCode::kResourceExhausted);
    CHECK(local.lookup(huge.key).error().code == ErrorCode::kNotFound);
  }
  SECTION("more eager chunks than the transfer has is malformed") {
    RawPeer raw(daemon);
    peer::Begin lying;
    lying.transfer_id = 73;
    lying.info = shm::EntryInfo{KvLayout{}, 10, 0};
    lying.chunk_bytes = 4;
    lying.running_checksums = true;
    lying.eager_chunks = 4;  // 10 bytes in chunks of 4: 3 chunks
    raw.write(peer::encode_begin(lying));
    CHECK(raw.error_then_close() == ErrorCode::kProtocol);
  }
  REQUIRE(wait_until([&] { return daemon.peer_stats().active_transfers == 0; }, std::chrono::seconds(5)));
}

TEST_CASE("chunk acknowledgements: each chunk for a sender without cumulative acks, every half window with them",
          "[peer][fault]") {
  PeerDaemon daemon;
  const auto bytes = peer_pattern(4 * kChunkBytes, 93);
  peer::Begin begin;
  begin.key = {1, 0};
  begin.info = shm::EntryInfo{KvLayout{}, bytes.size(), 0};
  begin.chunk_bytes = kChunkBytes;
  begin.running_checksums = true;
  begin.eager_chunks = 4;  // the sender's window: the whole transfer
  // What the receiver answers after Begin and four chunks, as (type, chunk index or id).
  const auto answers = [&](std::uint64_t capabilities, std::uint64_t transfer_id) {
    RawPeer raw(daemon, capabilities);
    begin.transfer_id = transfer_id;
    begin.key.context_hash = transfer_id;
    raw.write(peer::encode_begin(begin));
    for (std::uint32_t index = 0; index < 4; ++index) {
      const auto end = (index + 1) * std::size_t{kChunkBytes};
      raw.send_chunk(transfer_id, index, std::span(bytes).subspan(index * std::size_t{kChunkBytes}, kChunkBytes),
                     XXH3_64bits(bytes.data(), end));
    }
    std::vector<std::pair<peer::PeerMessage, std::uint64_t>> seen;
    while (seen.empty() || seen.back().first != peer::PeerMessage::kCommitted) {
      auto [type, payload] = raw.read_frame();
      REQUIRE(type != peer::PeerMessage::kError);
      shm::ByteReader reader(payload);
      const auto id = reader.get<std::uint64_t>();
      REQUIRE(id.has_value());
      CHECK(*id == transfer_id);
      std::uint64_t value = *id;
      if (type == peer::PeerMessage::kChunkAck) value = reader.get<std::uint32_t>().value();
      seen.emplace_back(type, value);
    }
    auto entry = daemon.data_plane().lookup(begin.key);
    REQUIRE(entry.has_value());
    CHECK(same_bytes(entry.value().bytes(), bytes));
    return seen;
  };
  using peer::PeerMessage;
  SECTION("a sender that did not announce them hears about every chunk") {
    const std::vector<std::pair<PeerMessage, std::uint64_t>> expected{
        {PeerMessage::kBeginOk, 801}, {PeerMessage::kChunkAck, 0}, {PeerMessage::kChunkAck, 1},
        {PeerMessage::kChunkAck, 2},  {PeerMessage::kChunkAck, 3}, {PeerMessage::kCommitted, 801}};
    CHECK(answers(0, 801) == expected);
  }
  SECTION("a sender that announced them hears every half window, and about the last chunk with Committed") {
    const std::vector<std::pair<PeerMessage, std::uint64_t>> expected{{PeerMessage::kBeginOk, 802},
                                                                      {PeerMessage::kChunkAck, 1},
                                                                      {PeerMessage::kChunkAck, 3},
                                                                      {PeerMessage::kCommitted, 802}};
    CHECK(answers(peer::kCapCumulativeAcks, 802) == expected);
  }
}

TEST_CASE("peer refuses malformed frames and out-of-order chunks", "[peer][hostile][fault]") {
  PeerDaemon daemon;
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
    std::vector<std::byte> frame(peer::kPeerHeaderBytes);
    peer::encode_peer_header(std::span<std::byte, peer::kPeerHeaderBytes>(frame.data(), peer::kPeerHeaderBytes),
                             peer::PeerMessage::kPing, 1U << 30);
    raw.write(frame);
    CHECK(raw.error_then_close() == ErrorCode::kProtocol);
  }
  SECTION("a chunk with no transfer begun, and a chunk out of order") {
    RawPeer raw(daemon);
    const auto data = peer_pattern(100, 1);
    raw.send_chunk(1, 0, data, XXH3_64bits(data.data(), data.size()));
    CHECK(raw.error_then_close() == ErrorCode::kProtocol);
    RawPeer second(daemon);
    peer::Begin begin;
    begin.transfer_id = 2;
    begin.key = {1, 2};
    begin.info = shm::EntryInfo{KvLayout{}, 200, 0};
    begin.chunk_bytes = 100;
    second.write(peer::encode_begin(begin));
    REQUIRE(second.read_frame().first == peer::PeerMessage::kBeginOk);
    second.send_chunk(2, 1, data, XXH3_64bits(data.data(), data.size()));
    CHECK(second.error_then_close() == ErrorCode::kProtocol);
  }
  SECTION("a layout that does not describe the announced size") {
    RawPeer raw(daemon);
    peer::Begin begin;
    begin.transfer_id = 3;
    begin.info = shm::EntryInfo{KvLayout{2, 2, 2, DType::kFloat32, 2}, 100, 0};
    raw.write(peer::encode_begin(begin));
    CHECK(raw.error_then_close() == ErrorCode::kLayoutMismatch);
  }
  REQUIRE(wait_until([&] { return daemon.peer_stats().active_transfers == 0; }, std::chrono::seconds(5)));
  CHECK(daemon.data_plane().stats().value().entries == 0);
}

}  // namespace kvrelay::test
