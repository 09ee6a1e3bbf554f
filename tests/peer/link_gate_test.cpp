// Issue #27: a peer chunk stream asks a LinkGate before every chunk. Real loopback sockets, both
// ends of the stream in one process (the peer library's own send and receive code), a gate that
// records, holds and releases grants from a thread of its own. Judged by counts and bytes.
// Issue #29: the same chunking and preemption hold when the chunks travel over UCX.

#include "kvrelay/peer/link_gate.h"

#include <boost/asio/co_spawn.hpp>
#include <boost/asio/detached.hpp>
#include <boost/asio/io_context.hpp>
#include <boost/asio/ip/tcp.hpp>
#include <boost/asio/strand.hpp>
#include <catch2/catch.hpp>

#include <condition_variable>
#include <deque>
#include <future>
#include <map>
#include <mutex>
#include <optional>
#include <thread>
#include <vector>

#include "kvrelay/peer/ucx_transport.h"

#include "peer_io.h"
#include "support/skip.h"

namespace {

namespace asio = boost::asio;
using kvrelay::Status;
using kvrelay::peer::LinkGate;
using kvrelay::peer::TransferTag;
using kvrelay::peer::detail::PeerConnection;
using tcp = asio::ip::tcp;
using namespace std::chrono_literals;

constexpr std::uint32_t kChunk = 64 * 1024;

// Grants in arrival order, at most `window` chunks granted and not yet acknowledged on the link
// (the scheduler's per-link window); tickets on hold get no grant until released. Grants run on
// the gate's own thread, as LinkQueues' pacer would run them.
class RecordingGate final : public LinkGate {
 public:
  explicit RecordingGate(std::uint32_t window) : window_(window), thread_([this] { run(); }) {}
  ~RecordingGate() override {
    {
      std::lock_guard lock(mutex_);
      stopping_ = true;
    }
    wake_.notify_all();
    thread_.join();
  }
  std::uint64_t open(const TransferTag& /*tag*/) override {
    std::lock_guard lock(mutex_);
    return ++last_ticket_;
  }
  void request(std::uint64_t ticket, std::uint64_t bytes, std::function<void()> granted) override {
    {
      std::lock_guard lock(mutex_);
      pending_.push_back(Pending{ticket, bytes, std::move(granted)});
    }
    wake_.notify_all();
  }
  void acknowledged(std::uint64_t ticket, std::uint64_t bytes) override {
    {
      std::lock_guard lock(mutex_);
      acked_bytes_[ticket] += bytes;
      unacked_bytes_ -= bytes;
    }
    wake_.notify_all();
  }
  void close(std::uint64_t ticket, bool completed) override {
    std::lock_guard lock(mutex_);
    closed_[ticket] = completed;
    std::erase_if(pending_, [&](const Pending& p) { return p.ticket == ticket; });
  }
  [[nodiscard]] std::uint32_t chunk_bytes() const override { return kChunk; }

  void hold(std::uint64_t ticket, std::size_t after_grants) {
    std::lock_guard lock(mutex_);
    hold_after_[ticket] = after_grants;
  }
  void release(std::uint64_t ticket) {
    {
      std::lock_guard lock(mutex_);
      hold_after_.erase(ticket);
    }
    wake_.notify_all();
  }
  // Blocks until `ticket` waits for a grant that its hold withholds.
  void wait_until_held(std::uint64_t ticket) {
    std::unique_lock lock(mutex_);
    wake_.wait(lock, [&] {
      for (const auto& p : pending_) {
        if (p.ticket == ticket && held(ticket)) return true;
      }
      return false;
    });
  }
  [[nodiscard]] std::vector<std::pair<std::uint64_t, std::uint64_t>> grants() const {
    std::lock_guard lock(mutex_);
    return grants_;
  }
  [[nodiscard]] std::uint64_t acked_bytes(std::uint64_t ticket) const {
    std::lock_guard lock(mutex_);
    const auto found = acked_bytes_.find(ticket);
    return found == acked_bytes_.end() ? 0 : found->second;
  }
  [[nodiscard]] std::uint64_t max_unacked_chunks() const {
    std::lock_guard lock(mutex_);
    return max_unacked_chunks_;
  }

 private:
  struct Pending {
    std::uint64_t ticket;
    std::uint64_t bytes;
    std::function<void()> granted;
  };
  [[nodiscard]] bool held(std::uint64_t ticket) const {
    const auto found = hold_after_.find(ticket);
    if (found == hold_after_.end()) return false;
    std::size_t given = 0;
    for (const auto& grant : grants_)
      given += grant.first == ticket ? 1 : 0;
    return given >= found->second;
  }
  void run() {
    std::unique_lock lock(mutex_);
    while (!stopping_) {
      auto next = pending_.end();
      for (auto it = pending_.begin(); it != pending_.end(); ++it) {
        if (!held(it->ticket)) {
          next = it;
          break;
        }
      }
      if (next == pending_.end() || unacked_chunks_ >= window_) {
        wake_.wait_for(lock, 5ms);
        unacked_chunks_ = (unacked_bytes_ + kChunk - 1) / kChunk;
        continue;
      }
      Pending grant = std::move(*next);
      pending_.erase(next);
      grants_.emplace_back(grant.ticket, grant.bytes);
      unacked_bytes_ += grant.bytes;
      unacked_chunks_ = (unacked_bytes_ + kChunk - 1) / kChunk;
      max_unacked_chunks_ = std::max(max_unacked_chunks_, unacked_chunks_);
      lock.unlock();
      grant.granted();
      wake_.notify_all();
      lock.lock();
    }
  }

  const std::uint32_t window_;
  mutable std::mutex mutex_;
  std::condition_variable wake_;
  std::deque<Pending> pending_;
  std::vector<std::pair<std::uint64_t, std::uint64_t>> grants_;
  std::map<std::uint64_t, std::uint64_t> acked_bytes_;
  std::map<std::uint64_t, bool> closed_;
  std::map<std::uint64_t, std::size_t> hold_after_;
  std::uint64_t unacked_bytes_ = 0;
  std::uint64_t unacked_chunks_ = 0;
  std::uint64_t max_unacked_chunks_ = 0;
  std::uint64_t last_ticket_ = 0;
  bool stopping_ = false;
  std::thread thread_;  // last: it starts after every member above exists
};

std::vector<std::uint8_t> pattern(std::size_t bytes, std::uint8_t seed) {
  std::vector<std::uint8_t> frame(bytes);
  for (std::size_t i = 0; i < bytes; ++i)
    frame[i] = static_cast<std::uint8_t>(seed + i * 131 + (i >> 9));
  return frame;
}

// One loopback connection: the sending and the receiving PeerConnection.
struct Link {
  std::shared_ptr<PeerConnection> sender;
  std::shared_ptr<PeerConnection> receiver;
};

// Two UCP workers (each on a strand of the runner's io_context) that stream chunks over UCX
// (UCX_TLS=tcp) for connections made with them.
struct UcxWorkers {
  std::shared_ptr<kvrelay::peer::UcxContext> context;
  std::shared_ptr<kvrelay::peer::UcxWorker> sending;
  std::shared_ptr<kvrelay::peer::UcxWorker> receiving;
  explicit UcxWorkers(asio::io_context& io) {
    kvrelay::UcxPolicy settings;
    settings.tls = "tcp";
    auto made = kvrelay::peer::UcxContext::create(settings);
    REQUIRE(made.has_value());
    context = made.value();
    auto first =
        kvrelay::peer::UcxWorker::create(context, asio::make_strand(io), kvrelay::peer::UcxThreading::kManyThreads);
    auto second =
        kvrelay::peer::UcxWorker::create(context, asio::make_strand(io), kvrelay::peer::UcxThreading::kManyThreads);
    REQUIRE(first.has_value());
    REQUIRE(second.has_value());
    sending = first.value();
    receiving = second.value();
  }
  ~UcxWorkers() {
    sending->stop();
    receiving->stop();
  }
  UcxWorkers(const UcxWorkers&) = delete;
  UcxWorkers& operator=(const UcxWorkers&) = delete;
};

Link connect_loopback(asio::io_context& io, UcxWorkers* ucx = nullptr) {
  tcp::acceptor acceptor(io, tcp::endpoint(asio::ip::address_v4::loopback(), 0));
  tcp::socket client(io);
  client.connect(acceptor.local_endpoint());
  tcp::socket server = acceptor.accept();
  Link link{std::make_shared<PeerConnection>(std::move(client)), std::make_shared<PeerConnection>(std::move(server))};
  if (ucx != nullptr) {
    auto expected = ucx->receiving->expect_link(ucx->sending->address());
    REQUIRE(expected.has_value());
    link.receiver->ucx = expected.value();
    auto dialled = ucx->sending->dial(ucx->receiving->address(), link.receiver->ucx->token());
    REQUIRE(dialled.has_value());
    link.sender->ucx = dialled.value();
    const auto by = std::chrono::steady_clock::now() + 5s;
    while (!link.sender->ucx->ready() && std::chrono::steady_clock::now() < by)
      std::this_thread::sleep_for(1ms);
    REQUIRE(link.sender->ucx->ready());
  }
  asio::co_spawn(io, kvrelay::peer::detail::watchdog(link.sender), asio::detached);
  asio::co_spawn(io, kvrelay::peer::detail::watchdog(link.receiver), asio::detached);
  return link;
}

kvrelay::peer::EncodedEntryHeader stream_header(std::uint64_t id, std::size_t bytes) {
  kvrelay::peer::EncodedEntryHeader header;
  header.id = id;
  header.key = kvrelay::kv_store::EntryKey{1, id};
  header.frame_bytes = bytes;
  header.chunk_bytes = kChunk;
  header.window_chunks = kvrelay::peer::detail::kGatedWindowChunks;
  return header;
}

asio::awaitable<Status> send(std::shared_ptr<PeerConnection> connection, kvrelay::peer::EncodedEntryHeader header,
                             const std::vector<std::uint8_t>* frame, LinkGate* gate, std::uint64_t ticket,
                             std::chrono::milliseconds timeout) {
  kvrelay::peer::detail::ChunkStreamOptions options;
  options.gate = gate;
  options.ticket = ticket;
  const auto announce = kvrelay::peer::encode_push_encoded(header);
  auto sent =
      co_await kvrelay::peer::detail::send_chunk_stream(*connection, announce, header, *frame, options, timeout);
  gate->close(ticket, sent.has_value());  // the opener closes, and a pending request goes with it
  connection->close();
  co_return sent;
}

asio::awaitable<Status> receive(std::shared_ptr<PeerConnection> connection, kvrelay::peer::EncodedEntryHeader header,
                                std::vector<std::uint8_t>* into) {
  auto announce = co_await kvrelay::peer::detail::read_frame(*connection, 10s, 10s);
  if (!announce) co_return kvrelay::outcome::failure(announce.error());
  auto got = co_await kvrelay::peer::detail::receive_chunk_stream(*connection, header, *into, true, 10s);
  co_return got;
}

asio::awaitable<void> settle(asio::awaitable<Status> task, std::shared_ptr<std::promise<Status>> promise) {
  auto result = co_await std::move(task);
  promise->set_value(std::move(result));
}

// Status has no default value, which asio::use_future needs: a promise set by a wrapper instead.
std::future<Status> spawn(asio::io_context& io, asio::awaitable<Status> task) {
  auto promise = std::make_shared<std::promise<Status>>();
  auto future = promise->get_future();
  asio::co_spawn(io, settle(std::move(task), std::move(promise)), asio::detached);
  return future;
}

struct Stream {
  kvrelay::peer::EncodedEntryHeader header;
  std::vector<std::uint8_t> frame;
  std::vector<std::uint8_t> received;
  std::uint64_t ticket = 0;
  std::future<Status> sent;
  std::future<Status> got;
};

void start(asio::io_context& io, Stream& stream, RecordingGate& gate, std::uint64_t id, std::size_t bytes,
           std::chrono::milliseconds timeout = 10s, UcxWorkers* ucx = nullptr) {
  stream.header = stream_header(id, bytes);
  stream.frame = pattern(bytes, static_cast<std::uint8_t>(id));
  stream.received.assign(bytes, 0);
  stream.ticket = gate.open(TransferTag{});
  const Link link = connect_loopback(io, ucx);
  stream.got = spawn(io, receive(link.receiver, stream.header, &stream.received));
  stream.sent = spawn(io, send(link.sender, stream.header, &stream.frame, &gate, stream.ticket, timeout));
}

std::size_t grants_of(const RecordingGate& gate, std::uint64_t ticket) {
  std::size_t count = 0;
  for (const auto& grant : gate.grants())
    count += grant.first == ticket ? 1 : 0;
  return count;
}

// The io_context runs on two threads, as the daemon's peer server does.
struct Runner {
  asio::io_context io;
  asio::executor_work_guard<asio::io_context::executor_type> work = asio::make_work_guard(io);
  std::vector<std::thread> threads;
  Runner() {
    for (int i = 0; i < 2; ++i)
      threads.emplace_back([this] { io.run(); });
  }
  ~Runner() {
    work.reset();
    io.stop();
    for (auto& thread : threads)
      thread.join();
  }
};

}  // namespace

namespace {

void gated_streams_land(bool over_ucx) {
  RecordingGate gate(4);
  Runner runner;
  std::optional<UcxWorkers> ucx;
  if (over_ucx) ucx.emplace(runner.io);
  UcxWorkers* workers = ucx ? &*ucx : nullptr;
  Stream a;
  Stream b;
  start(runner.io, a, gate, 1, 10 * kChunk + 123, 10s, workers);
  start(runner.io, b, gate, 2, 3 * kChunk, 10s, workers);
  REQUIRE(a.sent.get());
  REQUIRE(a.got.get());
  REQUIRE(b.sent.get());
  REQUIRE(b.got.get());
  CHECK(a.received == a.frame);
  CHECK(b.received == b.frame);
  CHECK(grants_of(gate, a.ticket) == 11);
  CHECK(grants_of(gate, b.ticket) == 3);
  CHECK(gate.acked_bytes(a.ticket) == a.frame.size());
  CHECK(gate.acked_bytes(b.ticket) == b.frame.size());
  CHECK(gate.max_unacked_chunks() <= 4);
}

void withheld_stream_resumes(bool over_ucx) {
  RecordingGate gate(4);
  Runner runner;
  std::optional<UcxWorkers> ucx;
  if (over_ucx) ucx.emplace(runner.io);
  UcxWorkers* workers = ucx ? &*ucx : nullptr;
  Stream bulk;
  gate.hold(1, 3);  // the first ticket: three chunks, then paused
  start(runner.io, bulk, gate, 1, 12 * kChunk, 10s, workers);
  REQUIRE(bulk.ticket == 1);
  gate.wait_until_held(bulk.ticket);
  Stream urgent;
  start(runner.io, urgent, gate, 2, 4 * kChunk, 10s, workers);
  REQUIRE(urgent.sent.get());
  REQUIRE(urgent.got.get());
  CHECK(urgent.received == urgent.frame);
  gate.release(bulk.ticket);
  REQUIRE(bulk.sent.get());
  REQUIRE(bulk.got.get());
  CHECK(bulk.received == bulk.frame);
  // Every urgent chunk left between the bulk stream's third and fourth: preempted at a boundary.
  const auto grants = gate.grants();
  REQUIRE(grants.size() == 16);
  for (std::size_t i = 0; i < grants.size(); ++i) {
    const bool urgent_slot = i >= 3 && i < 7;
    CHECK(grants[i].first == (urgent_slot ? urgent.ticket : bulk.ticket));
  }
  CHECK(grants_of(gate, bulk.ticket) == 12);  // no chunk asked for (or sent) twice
  CHECK(gate.acked_bytes(bulk.ticket) == bulk.frame.size());
}

}  // namespace

TEST_CASE("a gated chunk stream asks the gate once per chunk and lands byte-exact", "[scheduler]") {
  gated_streams_land(false);
}

TEST_CASE("a stream the gate withholds pauses at a chunk boundary and resumes without resending", "[scheduler]") {
  withheld_stream_resumes(false);
}

TEST_CASE("over ucx a gated chunk stream asks the gate once per chunk and lands byte-exact", "[scheduler][ucx]") {
  if (!kvrelay::peer::ucx_built()) KVRELAY_SKIP("built without UCX (libucx-dev)");
  gated_streams_land(true);
}

TEST_CASE("over ucx a withheld stream pauses at a chunk boundary and resumes without resending", "[scheduler][ucx]") {
  if (!kvrelay::peer::ucx_built()) KVRELAY_SKIP("built without UCX (libucx-dev)");
  withheld_stream_resumes(true);
}

TEST_CASE("paused streams holding the link window still read their acknowledgements", "[scheduler]") {
  // A link window of two chunks and three streams: each paused stream has a chunk in flight, and
  // only reading the acknowledgements while paused gives the window back.
  RecordingGate gate(2);
  Runner runner;
  std::vector<Stream> streams(3);
  for (std::size_t i = 0; i < streams.size(); ++i)
    start(runner.io, streams[i], gate, i + 1, 6 * kChunk + 100 + 7 * i);
  for (auto& stream : streams) {
    REQUIRE(stream.sent.get());
    REQUIRE(stream.got.get());
    CHECK(stream.received == stream.frame);
    CHECK(grants_of(gate, stream.ticket) == 7);
  }
  CHECK(gate.max_unacked_chunks() <= 2);
}

TEST_CASE("a stream the gate never grants fails with the scheduler named", "[scheduler][fault]") {
  RecordingGate gate(4);
  Runner runner;
  Stream starved;
  gate.hold(1, 0);
  start(runner.io, starved, gate, 1, 2 * kChunk, 200ms);
  const auto sent = starved.sent.get();
  REQUIRE_FALSE(sent);
  CHECK(sent.error().code == kvrelay::ErrorCode::kTimeout);
  CHECK(sent.error().message.find("link scheduler granted no chunk") != std::string::npos);
  CHECK_FALSE(starved.got.get());  // the receiver saw the connection close, not a frame
  CHECK(grants_of(gate, starved.ticket) == 0);
}
