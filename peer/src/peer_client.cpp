#include "kvrelay/peer/peer_client.h"

// GCC 12 reports a false -Wmismatched-new-delete for Asio's coroutine frame allocator
// (awaitable_frame_base has matching class-level new/delete).
#pragma GCC diagnostic ignored "-Wmismatched-new-delete"

#include <boost/asio/co_spawn.hpp>
#include <boost/asio/connect.hpp>
#include <boost/asio/detached.hpp>
#include <boost/asio/io_context.hpp>
#include <fmt/format.h>

#include <algorithm>
#include <condition_variable>
#include <cstring>
#include <mutex>
#include <optional>
#include <system_error>
#include <thread>

#include "kvrelay/core/bulk_hash.h"
#include "kvrelay/core/byte_io.h"
#include "kvrelay/shm_transport/client.h"

#include "peer_io.h"

namespace kvrelay::peer {

using namespace detail;

namespace {

template <class T>
asio::awaitable<void> store_result(asio::awaitable<Result<T>> task, std::optional<Result<T>>* out) {
  out->emplace(co_await std::move(task));
}

}  // namespace

struct PeerClient::State {
  PeerClientOptions options;
  std::shared_ptr<WarmBufferPool> frame_buffers;  // options.frame_buffers, or one that keeps nothing
  asio::io_context io;
  std::shared_ptr<PeerConnection> connection;
  Hello remote;
  bool broken = false;             // after an error mid-protocol the stream position is unknown
  std::vector<std::byte> staging;  // options.stage_chunks: one chunk, kept warm across transfers

  State() = default;
  State(const State&) = delete;
  State& operator=(const State&) = delete;
  // Lets the watchdog see the connection closed and finish before the io_context goes.
  ~State() {
    if (!connection) return;
    connection->close();
    io.restart();
    io.run();
  }

  // Runs one coroutine to completion on this thread.
  template <class T>
  Result<T> run(asio::awaitable<Result<T>> task) {
    if (broken) return fail(ErrorCode::kIo, "peer connection is broken");
    std::optional<Result<T>> result;
    io.restart();
    asio::co_spawn(io, store_result(std::move(task), &result), asio::detached);
    // Until this task is done, not until the io_context runs dry: the connection's watchdog
    // stays suspended on its timer between calls.
    while (!result && io.run_one() > 0) {
    }
    if (!result) return fail(ErrorCode::kInternal, "peer client task did not finish");
    if (!result->has_value()) broken = true;
    return std::move(*result);
  }
};

namespace {

// `error` with the stage of the exchange it happened in, so a record says where a lookup stalled.
Error at_stage(std::string_view stage, const Error& error) {
  return Error{error.code, fmt::format("{}: {}", stage, error.message)};
}

// Holds `connection.limit` at `deadline` for one exchange; put back to none when it ends.
class ExchangeDeadline {
 public:
  ExchangeDeadline(PeerConnection& connection, Deadline deadline) : connection_(connection) {
    connection_.limit = deadline;
  }
  ~ExchangeDeadline() { connection_.limit = Deadline::max(); }
  ExchangeDeadline(const ExchangeDeadline&) = delete;
  ExchangeDeadline& operator=(const ExchangeDeadline&) = delete;

 private:
  PeerConnection& connection_;
};

// Between calls: no exchange's deadline applies, and the server decides when to drop us.
void arm_idle(PeerConnection& connection) {
  connection.limit = Deadline::max();
  connection.arm(std::chrono::hours(24 * 365));
}

asio::awaitable<Result<PeerFrame>> expect(PeerConnection& connection, PeerMessage type,
                                          std::chrono::milliseconds timeout) {
  auto frame = co_await read_frame(connection, timeout, timeout);
  if (!frame) co_return frame;
  if (frame.value().header.type == PeerMessage::kError) {
    co_return outcome::failure(decode_peer_error(frame.value().payload));
  }
  if (frame.value().header.type != type) {
    co_return fail(ErrorCode::kProtocol, fmt::format("expected peer message {}, got {}", static_cast<int>(type),
                                                     static_cast<int>(frame.value().header.type)));
  }
  co_return frame;
}

// A peer address resolved within `by`. A numeric address needs no lookup. A host name is looked
// up on a thread of its own: getaddrinfo cannot be interrupted, and an io_context's resolver
// would make the client's teardown wait for it, so past `by` the caller stops waiting and the
// thread finishes alone.
Result<tcp::resolver::results_type> resolve_within(const HostPort& address, std::chrono::steady_clock::time_point by) {
  const std::string port = std::to_string(address.port);
  boost::system::error_code ec;
  {
    asio::io_context local;
    tcp::resolver numeric(local);
    auto endpoints =
        numeric.resolve(address.host, port, tcp::resolver::numeric_host | tcp::resolver::numeric_service, ec);
    if (!ec) return endpoints;
  }
  struct Pending {
    std::mutex mutex;
    std::condition_variable done;
    bool finished = false;
    boost::system::error_code ec;
    tcp::resolver::results_type endpoints;
  };
  auto pending = std::make_shared<Pending>();
  try {
    std::thread([pending, host = address.host, port] {
      asio::io_context local;
      tcp::resolver resolver(local);
      boost::system::error_code error;
      auto endpoints = resolver.resolve(host, port, error);
      const std::lock_guard lock(pending->mutex);
      pending->ec = error;
      pending->endpoints = std::move(endpoints);
      pending->finished = true;
      pending->done.notify_all();
    }).detach();
  } catch (const std::system_error& error) {
    return fail(ErrorCode::kResourceExhausted,
                fmt::format("resolve {}: no thread: {}", address.to_string(), error.what()));
  }
  std::unique_lock lock(pending->mutex);
  if (!pending->done.wait_until(lock, by, [&] { return pending->finished; })) {
    return fail(ErrorCode::kTimeout, fmt::format("peer connect: resolve {}: no answer in time", address.to_string()));
  }
  if (pending->ec)
    return fail(ErrorCode::kIo, fmt::format("resolve {}: {}", address.to_string(), pending->ec.message()));
  return pending->endpoints;
}

asio::awaitable<Result<bool>> connect_and_hello(PeerClient::State* state, HostPort address, Deadline deadline) {
  auto executor = co_await asio::this_coro::executor;
  // Bounded like the connect, so a slow DNS server cannot hold a lookup past its deadline.
  auto endpoints =
      resolve_within(address, std::min(deadline, std::chrono::steady_clock::now() + state->options.connect_timeout));
  if (!endpoints) co_return endpoints.error();
  state->connection = std::make_shared<PeerConnection>(tcp::socket(executor));
  auto& connection = *state->connection;
  asio::co_spawn(executor, watchdog(state->connection), asio::detached);
  {
    const ExchangeDeadline bounded(connection, deadline);
    connection.arm(state->options.connect_timeout);
    auto [connect_ec, endpoint] = co_await asio::async_connect(connection.socket, endpoints.value(), kNoThrow);
    if (connect_ec) co_return outcome::failure(at_stage("peer connect", io_error(connection, connect_ec, "connect")));
    tune_socket(connection.socket);
    Hello mine;
    mine.node_id = state->options.node_id;
    mine.capabilities |= kCapCumulativeAcks | kCapFidelity;
    const auto hello = encode_hello(PeerMessage::kHello, mine);
    if (auto sent =
            co_await write_all(connection, asio::buffer(hello), asio::const_buffer{}, state->options.read_timeout);
        !sent) {
      co_return outcome::failure(at_stage("peer hello", sent.error()));
    }
    auto reply = co_await expect(connection, PeerMessage::kHelloOk, state->options.read_timeout);
    if (!reply) co_return outcome::failure(at_stage("peer hello", reply.error()));
    auto remote = decode_hello(reply.value().payload);
    if (!remote) co_return outcome::failure(at_stage("peer hello", remote.error()));
    state->remote = std::move(remote).value();
  }
  connection.arm(std::chrono::hours(24 * 365));  // idle between calls; the server decides when to drop us
  co_return true;
}

// BeginOk: the receiver's answer to a Begin (proceed, or already committed: nothing to send).
asio::awaitable<Result<BeginState>> read_begin_answer(PeerConnection& connection, const Begin& begin,
                                                      std::chrono::milliseconds timeout) {
  auto begin_ok = co_await expect(connection, PeerMessage::kBeginOk, timeout);
  if (!begin_ok) co_return outcome::failure(begin_ok.error());
  ByteReader reader(begin_ok.value().payload);
  const auto id = reader.get<std::uint64_t>();
  const auto state_byte = reader.get<std::uint8_t>();
  if (!state_byte || *id != begin.transfer_id || reader.remaining() != 0) {
    co_return fail(ErrorCode::kProtocol, "malformed begin reply");
  }
  if (*state_byte == static_cast<std::uint8_t>(BeginState::kAlreadyCommitted)) {
    connection.arm(std::chrono::hours(24 * 365));
    co_return BeginState::kAlreadyCommitted;
  }
  if (*state_byte != static_cast<std::uint8_t>(BeginState::kProceed)) {
    co_return fail(ErrorCode::kProtocol, "bad begin state");
  }
  co_return BeginState::kProceed;
}

asio::awaitable<Result<TransferOutcome>> send_chunks(PeerClient::State* state, Begin begin,
                                                     std::span<const std::byte> bytes,
                                                     const std::vector<std::uint64_t>* chunk_checksums) {
  auto& connection = *state->connection;
  const auto& options = state->options;
  const auto begin_frame = encode_begin(begin);
  const std::uint64_t chunks = begin.chunk_count();
  // With eager chunks the Begin goes out in the first chunk's write: written alone, it woke the
  // receiver once for the Begin and again for the chunk behind it.
  bool begin_sent = false;
  if (begin.eager_chunks == 0 || chunks == 0) {
    if (auto sent =
            co_await write_all(connection, asio::buffer(begin_frame), asio::const_buffer{}, options.read_timeout);
        !sent) {
      co_return outcome::failure(sent.error());
    }
    begin_sent = true;
  }
  // Until the receiver answers the Begin only the eager chunks go out (the receiver drops them if
  // it does not take the transfer); without eager chunks the answer comes before the first one.
  bool answered = false;

  const auto started = std::chrono::steady_clock::now();
  asio::steady_timer pacing(connection.socket.get_executor());
  std::uint64_t next = 0;
  std::uint64_t acked = 0;
  std::array<std::byte, kPeerHeaderBytes + kChunkHeaderBytes> header{};
  BulkHashStream running;  // begin.running_checksums: each chunk hashed once, just before it goes out
  if (begin.running_checksums && !running.valid()) {
    co_return fail(ErrorCode::kResourceExhausted, "XXH3_createState");
  }
  // One write completes (the kernel has the bytes) before the next chunk is staged, so one
  // chunk's worth of buffer serves the whole window.
  std::byte* staging = nullptr;
  if (options.stage_chunks && chunks > 0) {
    const auto chunk_size = static_cast<std::size_t>(std::min<std::uint64_t>(begin.chunk_bytes, begin.info.bytes));
    if (state->staging.size() < chunk_size) state->staging.resize(chunk_size);
    staging = state->staging.data();
  }
  while (!answered || acked < chunks) {
    while (next < chunks && next - acked < options.window_chunks && (answered || next < begin.eager_chunks)) {
      const std::uint64_t offset = next * begin.chunk_bytes;
      const std::size_t length =
          static_cast<std::size_t>(std::min<std::uint64_t>(begin.chunk_bytes, begin.info.bytes - offset));
      const std::span<const std::byte> chunk(bytes.data() + offset, length);
      std::uint64_t checksum = 0;
      if (begin.running_checksums) {
        checksum = running_checksum(running, chunk, staging);
      } else {
        checksum = (*chunk_checksums)[static_cast<std::size_t>(next)];
        if (staging != nullptr) std::memcpy(staging, chunk.data(), length);
      }
      encode_peer_header(std::span<std::byte, kPeerHeaderBytes>(header.data(), kPeerHeaderBytes), PeerMessage::kChunk,
                         static_cast<std::uint32_t>(kChunkHeaderBytes + length));
      encode_chunk_header(std::span<std::byte, kChunkHeaderBytes>(header.data() + kPeerHeaderBytes, kChunkHeaderBytes),
                          ChunkHeader{begin.transfer_id, static_cast<std::uint32_t>(next), checksum});
      const asio::const_buffer body(staging != nullptr ? staging : chunk.data(), length);
      auto sent = begin_sent ? co_await write_all(connection, asio::buffer(header), body, options.read_timeout)
                             : co_await write_all(connection, asio::buffer(begin_frame), asio::buffer(header), body,
                                                  options.read_timeout);
      if (!sent) co_return outcome::failure(sent.error());
      begin_sent = true;
      ++next;
      if (options.rate_limit_bytes_per_s > 0) {
        const double seconds =
            static_cast<double>(offset + length) / static_cast<double>(options.rate_limit_bytes_per_s);
        pacing.expires_at(started + std::chrono::microseconds(static_cast<std::int64_t>(seconds * 1e6)));
        [[maybe_unused]] auto [ec] = co_await pacing.async_wait(kNoThrow);
      }
    }
    if (!answered) {
      auto state_byte = co_await read_begin_answer(connection, begin, options.read_timeout);
      if (!state_byte) co_return outcome::failure(state_byte.error());
      if (state_byte.value() == BeginState::kAlreadyCommitted) co_return TransferOutcome::kAlreadyCommitted;
      answered = true;
      continue;  // send the rest of the window before waiting for an acknowledgement
    }
    auto ack = co_await expect(connection, PeerMessage::kChunkAck, options.read_timeout);
    if (!ack) co_return outcome::failure(ack.error());
    ByteReader ack_reader(ack.value().payload);
    const auto ack_id = ack_reader.get<std::uint64_t>();
    const auto ack_index = ack_reader.get<std::uint32_t>();
    // Cumulative (kCapCumulativeAcks): any chunk already sent and not yet acknowledged.
    if (!ack_index || *ack_id != begin.transfer_id || *ack_index < acked || *ack_index >= next) {
      co_return fail(ErrorCode::kProtocol, "unexpected chunk acknowledgement");
    }
    acked = std::uint64_t{*ack_index} + 1;
    if (options.on_progress) {
      options.on_progress(std::min<std::uint64_t>(acked * begin.chunk_bytes, begin.info.bytes), begin.info.bytes);
    }
  }
  auto committed = co_await expect(connection, PeerMessage::kCommitted, options.read_timeout);
  if (!committed) co_return outcome::failure(committed.error());
  connection.arm(std::chrono::hours(24 * 365));
  if (options.link_estimator) {
    options.link_estimator->add_transfer(
        state->remote.node_id, begin.info.bytes,
        std::chrono::duration_cast<std::chrono::microseconds>(std::chrono::steady_clock::now() - started));
  }
  co_return TransferOutcome::kCommitted;
}

asio::awaitable<Result<std::chrono::microseconds>> ping_once(PeerClient::State* state) {
  auto& connection = *state->connection;
  const auto started = std::chrono::steady_clock::now();
  ByteWriter nonce;
  nonce.put(static_cast<std::uint64_t>(started.time_since_epoch().count()));
  const auto frame = encode_peer_frame(PeerMessage::kPing, nonce.bytes());
  if (auto sent =
          co_await write_all(connection, asio::buffer(frame), asio::const_buffer{}, state->options.read_timeout);
      !sent) {
    co_return outcome::failure(sent.error());
  }
  auto pong = co_await expect(connection, PeerMessage::kPong, state->options.read_timeout);
  if (!pong) co_return outcome::failure(pong.error());
  if (pong.value().payload != nonce.bytes()) co_return fail(ErrorCode::kProtocol, "pong does not echo the ping");
  connection.arm(std::chrono::hours(24 * 365));
  co_return std::chrono::duration_cast<std::chrono::microseconds>(std::chrono::steady_clock::now() - started);
}

asio::awaitable<Result<PeerServerStats>> stats_once(PeerClient::State* state) {
  auto& connection = *state->connection;
  const auto frame = encode_peer_frame(PeerMessage::kStats, {});
  if (auto sent =
          co_await write_all(connection, asio::buffer(frame), asio::const_buffer{}, state->options.read_timeout);
      !sent) {
    co_return outcome::failure(sent.error());
  }
  auto reply = co_await expect(connection, PeerMessage::kStatsReply, state->options.read_timeout);
  if (!reply) co_return outcome::failure(reply.error());
  connection.arm(std::chrono::hours(24 * 365));
  co_return decode_peer_stats(reply.value().payload);
}

asio::awaitable<Result<std::optional<PeerClient::FetchedFrame>>> fetch_once(PeerClient::State* state,
                                                                            FetchRequest request,
                                                                            std::uint64_t max_frame_bytes,
                                                                            Deadline deadline) {
  auto& connection = *state->connection;
  const auto timeout = state->options.read_timeout;
  const ExchangeDeadline bounded(connection, deadline);
  const auto requested_at = std::chrono::steady_clock::now();
  const auto frame = encode_fetch(request);
  if (auto sent = co_await write_all(connection, asio::buffer(frame), asio::const_buffer{}, timeout); !sent) {
    co_return outcome::failure(at_stage("fetch request", sent.error()));
  }
  auto reply = co_await expect(connection, PeerMessage::kFetchReply, timeout);
  if (!reply) co_return outcome::failure(at_stage("fetch reply", reply.error()));
  auto header = decode_fetch_reply(reply.value().payload, request.request_id);
  if (!header) co_return outcome::failure(at_stage("fetch reply", header.error()));
  if (!header.value()) {
    arm_idle(connection);
    co_return std::optional<PeerClient::FetchedFrame>{};
  }
  const auto& found = *header.value();
  const bool requested =
      std::find(request.hashes.begin(), request.hashes.end(), found.key.context_hash) != request.hashes.end();
  if (found.key.model_id != request.model_id || !requested) {
    co_return fail(ErrorCode::kProtocol, "fetch reply for a key that was not asked for");
  }
  if (found.frame_bytes > max_frame_bytes) {
    co_return fail(
        ErrorCode::kResourceExhausted,
        fmt::format("peer announces a {}-byte frame, more than the {} allowed", found.frame_bytes, max_frame_bytes));
  }
  PeerClient::FetchedFrame fetched;
  fetched.key = found.key;
  const auto started = std::chrono::steady_clock::now();
  fetched.reply_wait = std::chrono::duration_cast<std::chrono::microseconds>(started - requested_at);
  fetched.frame_bytes = static_cast<std::size_t>(found.frame_bytes);
  fetched.buffer = state->frame_buffers->take(fetched.frame_bytes);
  const auto destination = fetched.buffer.u8();
  if (auto got = co_await read_encoded_chunks(connection, found, destination, timeout); !got) {
    co_return outcome::failure(at_stage("fetch transfer", got.error()));
  }
  arm_idle(connection);
  fetched.transfer = std::chrono::duration_cast<std::chrono::microseconds>(std::chrono::steady_clock::now() - started);
  if (state->options.link_estimator) {
    state->options.link_estimator->add_transfer(
        state->remote.node_id, found.frame_bytes,
        std::chrono::duration_cast<std::chrono::microseconds>(std::chrono::steady_clock::now() - started));
  }
  co_return std::optional<PeerClient::FetchedFrame>(std::move(fetched));
}

asio::awaitable<Result<bool>> push_encoded_once(PeerClient::State* state, EncodedEntryHeader header,
                                                std::span<const std::uint8_t> frame,
                                                const std::vector<std::uint64_t>* chunk_checksums) {
  auto& connection = *state->connection;
  const auto timeout = state->options.read_timeout;
  const auto announce = encode_push_encoded(header);
  if (auto sent = co_await write_all(connection, asio::buffer(announce), asio::const_buffer{}, timeout); !sent) {
    co_return outcome::failure(sent.error());
  }
  const auto started = std::chrono::steady_clock::now();
  if (auto sent = co_await write_encoded_chunks(connection, header, frame, *chunk_checksums, timeout); !sent) {
    co_return outcome::failure(sent.error());
  }
  auto committed = co_await expect(connection, PeerMessage::kCommitted, timeout);
  if (!committed) co_return outcome::failure(committed.error());
  connection.arm(std::chrono::hours(24 * 365));
  if (state->options.link_estimator) {
    state->options.link_estimator->add_transfer(
        state->remote.node_id, header.frame_bytes,
        std::chrono::duration_cast<std::chrono::microseconds>(std::chrono::steady_clock::now() - started));
  }
  co_return true;
}

asio::awaitable<Result<std::vector<kv_store::EntryKey>>> summary_once(PeerClient::State* state) {
  auto& connection = *state->connection;
  const auto frame = encode_peer_frame(PeerMessage::kSummary, {});
  if (auto sent =
          co_await write_all(connection, asio::buffer(frame), asio::const_buffer{}, state->options.read_timeout);
      !sent) {
    co_return outcome::failure(sent.error());
  }
  auto reply = co_await expect(connection, PeerMessage::kSummaryReply, state->options.read_timeout);
  if (!reply) co_return outcome::failure(reply.error());
  connection.arm(std::chrono::hours(24 * 365));
  co_return decode_summary(reply.value().payload);
}

}  // namespace

PeerClientOptions peer_client_options(const Policy& policy, const PeerPolicy& peer) {
  PeerClientOptions options;
  options.node_id = policy.node_id;
  options.read_timeout = policy.limits.read_timeout;
  options.allow_shared_memory = peer.same_host;
  options.stage_chunks = policy.limits.peer_staging;
  return options;
}

PeerClient::PeerClient(std::unique_ptr<State> state) : state_(std::move(state)) {}
PeerClient::~PeerClient() = default;  // State's destructor closes the connection
PeerClient::PeerClient(PeerClient&&) noexcept = default;
PeerClient& PeerClient::operator=(PeerClient&&) noexcept = default;

Result<PeerClient> PeerClient::connect(const HostPort& address, PeerClientOptions options, Deadline deadline) {
  if (options.chunk_bytes == 0 || options.chunk_bytes > kMaxChunkBytes) {
    return fail(ErrorCode::kInvalidArgument, "chunk size out of range");
  }
  if (options.window_chunks == 0) return fail(ErrorCode::kInvalidArgument, "window must hold at least one chunk");
  auto state = std::make_unique<State>();
  state->options = std::move(options);
  state->frame_buffers =
      state->options.frame_buffers ? state->options.frame_buffers : std::make_shared<WarmBufferPool>(0, 0);
  if (deadline <= std::chrono::steady_clock::now()) {
    return fail(ErrorCode::kTimeout, "peer connect: deadline exceeded before connecting");
  }
  KVRELAY_TRY(state->run(connect_and_hello(state.get(), address, deadline)));
  return PeerClient(std::move(state));
}

const Hello& PeerClient::remote() const {
  return state_->remote;
}

Result<TransferOutcome> PeerClient::send(std::uint64_t transfer_id, const kv_store::EntryKey& key, const KvLayout& layout,
                                         std::span<const std::byte> bytes) {
  Begin begin;
  begin.transfer_id = transfer_id;
  begin.key = key;
  begin.info = kv_store::EntryInfo{layout, bytes.size(), 0};
  begin.chunk_bytes = std::min(state_->options.chunk_bytes, state_->remote.max_chunk_bytes);
  if (state_->options.split_single_chunk) begin.chunk_bytes = transfer_chunk_bytes(begin.chunk_bytes, bytes.size());
  KVRELAY_TRY(kv_store::validate_entry_info(begin.info));
  if (state_->options.allow_shared_memory && (state_->remote.capabilities & kCapSharedMemory) != 0 &&
      !state_->remote.shm_socket.empty()) {
    // Same host: one copy into the receiver's shared memory instead of a trip through TCP.
    KVRELAY_TRY(auto local, shm::ShmClient::connect(state_->remote.shm_socket));
    KVRELAY_TRY(local.publish(key, layout, bytes));
    return TransferOutcome::kCommittedViaSharedMemory;
  }
  if ((state_->remote.capabilities & kCapRunningChecksums) != 0) {
    begin.running_checksums = true;
    begin.eager_chunks =
        static_cast<std::uint32_t>(std::min<std::uint64_t>(begin.chunk_count(), state_->options.window_chunks));
    return state_->run(send_chunks(state_.get(), begin, bytes, nullptr));
  }
  // A peer that wants the checksum in Begin: every checksum up front, in one pass.
  const auto checksums = checksum_chunks(bytes, begin.chunk_bytes);
  begin.info.checksum = checksums.whole;
  return state_->run(send_chunks(state_.get(), begin, bytes, &checksums.chunks));
}

Result<std::chrono::microseconds> PeerClient::ping() {
  KVRELAY_TRY(auto rtt, state_->run(ping_once(state_.get())));
  if (state_->options.link_estimator) state_->options.link_estimator->add_rtt(state_->remote.node_id, rtt);
  return rtt;
}

Result<PeerServerStats> PeerClient::stats() {
  return state_->run(stats_once(state_.get()));
}

Result<std::optional<PeerClient::FetchedFrame>> PeerClient::fetch(const FetchRequest& request,
                                                                  std::uint64_t max_frame_bytes, Deadline deadline) {
  // Nothing sent yet: the stream stays in step and the connection usable.
  if (deadline <= std::chrono::steady_clock::now()) {
    return fail(ErrorCode::kTimeout, "fetch request: deadline exceeded before it was sent");
  }
  return state_->run(fetch_once(state_.get(), request, max_frame_bytes, deadline));
}

Status PeerClient::push_encoded(std::uint64_t transfer_id, const kv_store::EntryKey& key,
                                std::span<const std::uint8_t> frame) {
  EncodedEntryHeader header;
  header.id = transfer_id;
  header.key = key;
  header.frame_bytes = frame.size();
  header.chunk_bytes = std::min(state_->options.chunk_bytes, state_->remote.max_chunk_bytes);
  // Every chunk's checksum and the whole frame's in one pass (was: the whole, then each chunk).
  const auto checksums = checksum_chunks(std::as_bytes(frame), header.chunk_bytes);
  header.frame_checksum = checksums.whole;
  KVRELAY_TRY(state_->run(push_encoded_once(state_.get(), header, frame, &checksums.chunks)));
  return ok();
}

Result<std::vector<kv_store::EntryKey>> PeerClient::summary() {
  return state_->run(summary_once(state_.get()));
}

}  // namespace kvrelay::peer
