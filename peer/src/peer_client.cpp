#include "kvrelay/peer/peer_client.h"

// GCC 12 reports a false -Wmismatched-new-delete for Asio's coroutine frame allocator
// (awaitable_frame_base has matching class-level new/delete).
#pragma GCC diagnostic ignored "-Wmismatched-new-delete"

#include <boost/asio/co_spawn.hpp>
#include <boost/asio/connect.hpp>
#include <boost/asio/detached.hpp>
#include <boost/asio/io_context.hpp>
#include <fmt/format.h>
#include <fmt/ranges.h>

#include <algorithm>
#include <cmath>
#include <condition_variable>
#include <cstring>
#include <mutex>
#include <optional>
#include <system_error>
#include <thread>

#include "kvrelay/core/bulk_hash.h"
#include "kvrelay/core/byte_io.h"

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
  PeerCertificate certificate;
  bool broken = false;                    // after an error mid-protocol the stream position is unknown
  std::vector<std::byte> staging;         // options.stage_chunks: one chunk, kept warm across transfers
  std::shared_ptr<UcxWorker> ucx_worker;  // options.ucx: progressed by `io` while a call runs

  State() = default;
  State(const State&) = delete;
  State& operator=(const State&) = delete;
  // Lets the watchdog see the connection closed and finish before the io_context goes.
  ~State() {
    if (connection) connection->close();
    if (ucx_worker) ucx_worker->stop();
    if (!connection && !ucx_worker) return;
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

// The peer's HelloOk. A peer of another wire version answers in its own, with a refusal (a
// newer one) or an error about our frames (an older one); either way the caller learns both
// versions.
asio::awaitable<Result<PeerFrame>> read_hello_reply(PeerConnection& connection, const HostPort& address,
                                                    std::chrono::milliseconds timeout) {
  auto frame = co_await read_frame(connection, timeout, timeout, true);
  if (!frame) co_return frame;
  const auto& header = frame.value().header;
  if (header.version != kPeerVersion) {
    const auto said = header.type == PeerMessage::kError ? decode_peer_error(frame.value().payload).message
                                                         : std::string("a hello reply");
    auto mismatch = wire_version_mismatch(header.version, fmt::format("peer {}", address.to_string()));
    co_return fail(ErrorCode::kBadVersion, fmt::format("{} (it answered: {})", mismatch.message, said));
  }
  if (header.type == PeerMessage::kError) co_return outcome::failure(decode_peer_error(frame.value().payload));
  if (header.type != PeerMessage::kHelloOk) {
    co_return fail(ErrorCode::kProtocol,
                   fmt::format("expected a hello reply, got peer message {}", static_cast<int>(header.type)));
  }
  co_return frame;
}

// Issue #29: asks the peer for UCX over this (authenticated) connection, dials the worker address
// it answers with, presents its token and waits for the peer to answer it.
asio::awaitable<Status> open_ucx(PeerClient::State* state, const HostPort& address) {
  auto& connection = *state->connection;
  const auto timeout = state->options.read_timeout;
  if ((state->remote.capabilities & kCapUcx) == 0) {
    co_return fail(ErrorCode::kUnsupported,
                   fmt::format("peer {} ({}) offers no UCX transport: its policy has no ucx section, or it was "
                               "built without UCX",
                               state->remote.node_id, address.to_string()));
  }
  auto worker = UcxWorker::create(state->options.ucx, state->io.get_executor(), UcxThreading::kOneThread);
  if (!worker) co_return outcome::failure(worker.error());
  state->ucx_worker = worker.value();
  const auto open = encode_ucx_open(state->ucx_worker->address());
  if (auto sent = co_await write_all(connection, asio::buffer(open), asio::const_buffer{}, timeout); !sent) {
    co_return sent;
  }
  auto reply = co_await expect(connection, PeerMessage::kUcxOpenReply, timeout);
  if (!reply) co_return outcome::failure(reply.error());
  auto offer = decode_ucx_open_reply(reply.value().payload);
  if (!offer) co_return outcome::failure(offer.error());
  auto link = state->ucx_worker->dial(offer.value().worker_address, offer.value().token);
  if (!link) co_return outcome::failure(link.error());
  connection.ucx = link.value();
  co_return co_await await_ucx(connection, UcxUntil::kReady, timeout, "token answer", true);
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
    if (state->options.tls) {
      auto shaken =
          co_await start_tls(connection, state->options.tls->context(), false, state->options.connect_timeout);
      if (!shaken) co_return outcome::failure(at_stage("peer TLS", shaken.error()));
      state->certificate = remote_certificate(connection);
      if (!names_identity(state->certificate, state->options.identity)) {
        co_return fail(
            ErrorCode::kPermissionDenied,
            fmt::format("peer TLS: {} presents a certificate naming [{}], not identity '{}'", address.to_string(),
                        fmt::join(state->certificate.names, ", "), state->options.identity));
      }
    }
    Hello mine;
    mine.node_id = state->options.node_id;
    mine.capabilities |= kCapFidelity;
    const auto hello = encode_hello(PeerMessage::kHello, mine);
    if (auto sent =
            co_await write_all(connection, asio::buffer(hello), asio::const_buffer{}, state->options.read_timeout);
        !sent) {
      co_return outcome::failure(at_stage("peer hello", sent.error()));
    }
    auto reply = co_await read_hello_reply(connection, address, state->options.read_timeout);
    if (!reply) co_return outcome::failure(at_stage("peer hello", reply.error()));
    auto remote = decode_hello(reply.value().payload);
    if (!remote) co_return outcome::failure(at_stage("peer hello", remote.error()));
    state->remote = std::move(remote).value();
    if (state->options.ucx) {
      auto opened = co_await open_ucx(state, address);
      if (!opened) co_return outcome::failure(at_stage("peer UCX", opened.error()));
    }
  }
  connection.arm(std::chrono::hours(24 * 365));  // idle between calls; the server decides when to drop us
  co_return true;
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
  fetched.transport = std::string(transport_name(connection));
  fetched.key = found.key;
  fetched.chain = std::move(found.chain);
  fetched.fidelity_product = found.fidelity_product;
  const auto started = std::chrono::steady_clock::now();
  fetched.reply_wait = std::chrono::duration_cast<std::chrono::microseconds>(started - requested_at);
  fetched.frame_bytes = static_cast<std::size_t>(found.frame_bytes);
  fetched.buffer = state->frame_buffers->take(fetched.frame_bytes);
  const auto destination = fetched.buffer.u8().first(fetched.frame_bytes);
  if (auto got =
          co_await receive_chunk_stream(connection, found, destination, true, timeout, &state->options.on_progress);
      !got) {
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

TransferPurpose transfer_purpose(PushPurpose purpose) {
  switch (purpose) {
    case PushPurpose::kPrefetch:
      return TransferPurpose::kPrefetch;
    case PushPurpose::kSpill:
      return TransferPurpose::kSpill;
    case PushPurpose::kPush:
      break;
  }
  return TransferPurpose::kPush;
}

asio::awaitable<Result<bool>> push_encoded_once(PeerClient::State* state, EncodedEntryHeader header,
                                                std::span<const std::uint8_t> frame,
                                                std::chrono::microseconds* busy_out) {
  auto& connection = *state->connection;
  const auto& options = state->options;
  // Issue #27: the push joins the queue of the link to the peer; its ticket holds the link's
  // share until the peer has committed (the last chunk is acknowledged by Committed).
  GateTicket ticket(options.gate.get(),
                    TransferTag{state->remote.node_id, header.route, transfer_purpose(header.purpose),
                                header.frame_bytes, std::nullopt});
  header.chunk_bytes = std::min(ticket.chunk_bytes(options.chunk_bytes), state->remote.max_chunk_bytes);
  if (options.split_single_chunk) header.chunk_bytes = transfer_chunk_bytes(header.chunk_bytes, frame.size());
  header.window_chunks = ticket.window_chunks(options.window_chunks);
  const auto announce = encode_push_encoded(header);
  ChunkStreamOptions stream;
  stream.staging = options.stage_chunks ? &state->staging : nullptr;
  stream.rate_limit_bytes_per_s = options.rate_limit_bytes_per_s;
  stream.on_progress = options.on_progress;
  std::chrono::nanoseconds grant_wait{};
  stream.grant_wait = &grant_wait;
  ticket.apply(stream);
  const auto started = std::chrono::steady_clock::now();
  if (auto sent = co_await send_chunk_stream(connection, announce, header, frame, stream, options.read_timeout);
      !sent) {
    co_return outcome::failure(at_stage("push transfer", sent.error()));
  }
  auto committed = co_await expect(connection, PeerMessage::kCommitted, options.read_timeout);
  if (!committed) co_return outcome::failure(at_stage("push commit", committed.error()));
  auto id = decode_committed(committed.value().payload);
  if (!id) co_return outcome::failure(id.error());
  if (id.value() != header.id) co_return fail(ErrorCode::kProtocol, fmt::format("committed for push {}", id.value()));
  arm_idle(connection);
  ticket.complete();
  // Busy time only: waiting behind other transfers on the link says nothing of its speed.
  const auto busy =
      std::chrono::duration_cast<std::chrono::microseconds>(std::chrono::steady_clock::now() - started - grant_wait);
  if (options.link_estimator) options.link_estimator->add_transfer(state->remote.node_id, header.frame_bytes, busy);
  if (busy_out != nullptr) *busy_out = busy;
  co_return true;
}

asio::awaitable<Result<SummaryReply>> summary_once(PeerClient::State* state) {
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

asio::awaitable<Result<std::chrono::microseconds>> probe_once(PeerClient::State* state, std::uint32_t bytes) {
  auto& connection = *state->connection;
  const auto started = std::chrono::steady_clock::now();
  const auto frame = encode_probe(bytes);
  if (auto sent =
          co_await write_all(connection, asio::buffer(frame), asio::const_buffer{}, state->options.read_timeout);
      !sent) {
    co_return outcome::failure(sent.error());
  }
  std::uint64_t received = 0;
  while (received < bytes) {
    auto reply = co_await expect(connection, PeerMessage::kProbeReply, state->options.read_timeout);
    if (!reply) co_return outcome::failure(reply.error());
    const auto size = reply.value().payload.size();
    if (size == 0 || received + size > bytes) {
      co_return fail(ErrorCode::kProtocol,
                     fmt::format("probe reply of {} bytes after {} of {}", size, received, bytes));
    }
    received += size;
  }
  connection.arm(std::chrono::hours(24 * 365));
  co_return std::chrono::duration_cast<std::chrono::microseconds>(std::chrono::steady_clock::now() - started);
}

}  // namespace

PeerClientOptions peer_client_options(const Policy& policy) {
  PeerClientOptions options;
  options.node_id = policy.node_id;
  options.read_timeout = policy.limits.read_timeout;
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
  if (options.window_chunks == 0 || options.window_chunks > kMaxWindowChunks) {
    return fail(ErrorCode::kInvalidArgument,
                fmt::format("window of {} chunks outside 1..{}", options.window_chunks, kMaxWindowChunks));
  }
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

const PeerCertificate& PeerClient::remote_certificate() const {
  return state_->certificate;
}

std::string_view PeerClient::transport() const {
  return transport_name(*state_->connection);
}

std::vector<std::string> PeerClient::transport_lanes() const {
  return state_->connection->ucx ? state_->connection->ucx->lanes() : std::vector<std::string>{};
}

Result<std::chrono::microseconds> PeerClient::ping() {
  KVRELAY_TRY(auto rtt, state_->run(ping_once(state_.get())));
  if (state_->options.link_estimator) state_->options.link_estimator->add_rtt(state_->remote.node_id, rtt);
  return rtt;
}

Result<std::chrono::microseconds> PeerClient::probe_bandwidth(std::uint32_t bytes) {
  if (bytes == 0 || bytes > kMaxProbeBytes) {
    return fail(ErrorCode::kInvalidArgument, fmt::format("a probe of {} bytes, not 1..{}", bytes, kMaxProbeBytes));
  }
  KVRELAY_TRY(auto elapsed, state_->run(probe_once(state_.get(), bytes)));
  if (state_->options.link_estimator)
    state_->options.link_estimator->add_transfer(state_->remote.node_id, bytes, elapsed);
  return elapsed;
}

Result<PeerServerStats> PeerClient::stats() {
  return state_->run(stats_once(state_.get()));
}

Result<std::optional<PeerClient::FetchedFrame>> PeerClient::fetch(const FetchRequest& request,
                                                                  std::uint64_t max_frame_bytes, Deadline deadline) {
  // Nothing sent yet: the stream stays in step and the connection usable.
  if (request.route.size() > kMaxRouteBytes) {
    return fail(ErrorCode::kInvalidArgument,
                fmt::format("fetch request: route of {} bytes, more than {}", request.route.size(), kMaxRouteBytes));
  }
  if (!(request.min_fidelity_product >= 0.0 && request.min_fidelity_product <= 1.0) ||
      std::signbit(request.min_fidelity_product)) {
    return fail(ErrorCode::kInvalidArgument,
                fmt::format("fetch request: min_fidelity_product {} outside [0, 1]", request.min_fidelity_product));
  }
  if (deadline <= std::chrono::steady_clock::now()) {
    return fail(ErrorCode::kTimeout, "fetch request: deadline exceeded before it was sent");
  }
  return state_->run(fetch_once(state_.get(), request, max_frame_bytes, deadline));
}

Status PeerClient::push_encoded(std::uint64_t transfer_id, const kv_store::EntryKey& key,
                                const kv_store::EntryChain& chain, std::span<const std::uint8_t> frame,
                                std::string_view route) {
  PushOptions push;
  push.route = std::string(route);
  return push_encoded(transfer_id, key, chain, frame, push);
}

Status PeerClient::push_encoded(std::uint64_t transfer_id, const kv_store::EntryKey& key,
                                const kv_store::EntryChain& chain, std::span<const std::uint8_t> frame,
                                const PushOptions& push) {
  if (frame.empty()) return fail(ErrorCode::kInvalidArgument, "push of an empty frame");
  if (push.route.size() > kMaxRouteBytes) {
    return fail(ErrorCode::kInvalidArgument,
                fmt::format("push: route of {} bytes, more than {}", push.route.size(), kMaxRouteBytes));
  }
  EncodedEntryHeader header;
  header.id = transfer_id;
  header.key = key;
  header.chain = chain;
  header.frame_bytes = frame.size();
  // Chunk size and window are set where the push joins its link's queue (push_encoded_once).
  header.route = push.route;
  header.purpose = push.purpose;
  header.skip_tokens = push.skip_tokens;
  // The codec_factor contract gives lossless codecs 1, so the codec's kind need not be known here.
  header.fidelity_product = stamped_product(push.source, push.codec, false, state_->options.codec_factor);
  KVRELAY_TRY(state_->run(push_encoded_once(state_.get(), header, frame, push.busy)));
  return ok();
}

Result<std::vector<kv_store::EntryKey>> PeerClient::summary() {
  KVRELAY_TRY(auto reply, summary_reply());
  return std::move(reply.keys);
}

Result<SummaryReply> PeerClient::summary_reply() {
  return state_->run(summary_once(state_.get()));
}

}  // namespace kvrelay::peer
