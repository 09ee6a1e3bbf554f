#include "kvrelay/peer/peer_server.h"

// GCC 12 reports a false -Wmismatched-new-delete for Asio's coroutine frame allocator
// (awaitable_frame_base has matching class-level new/delete).
#pragma GCC diagnostic ignored "-Wmismatched-new-delete"

#include <boost/asio/co_spawn.hpp>
#include <boost/asio/detached.hpp>
#include <boost/asio/post.hpp>
#include <boost/asio/strand.hpp>
#include <fmt/format.h>
#include <fmt/ranges.h>
#include <spdlog/spdlog.h>

#include <algorithm>
#include <array>
#include <atomic>
#include <deque>
#include <mutex>
#include <optional>
#include <set>
#include <unordered_set>
#include <vector>

#include "kvrelay/codec_plugins/frame.h"
#include "kvrelay/core/bulk_hash.h"
#include "kvrelay/core/byte_io.h"
#include "kvrelay/core/kv_tokens.h"
#include "kvrelay/kv_store/memfd.h"
#include "kvrelay/kv_store/prefix_scan.h"
#include "kvrelay/peer/fetch_encoding.h"
#include "kvrelay/peer/fidelity_product.h"
#include "kvrelay/peer/peer_authorization.h"

#include "peer_io.h"
#include "push_delta.h"

namespace kvrelay::peer {

using namespace detail;

struct PeerServer::Shared {
  static constexpr std::size_t kWarmBuffers = 4;
  Shared(PeerServerOptions server_options, std::shared_ptr<kv_store::EntryStore> entry_store)
      : options(std::move(server_options)),
        store(std::move(entry_store)),
        buffers(kWarmBuffers, options.warm_buffer_bytes) {}
  const PeerServerOptions options;
  const std::shared_ptr<kv_store::EntryStore> store;
  WarmBufferPool buffers;  // fetches' read and encode buffers, pushed frames
  std::unique_ptr<tcp::acceptor> acceptor;

  mutable std::mutex mutex;
  PeerServerStats counters;
  std::uint64_t active_fetches = 0;  // fetch replies being sent (summaries' queued_transfers)
  std::set<std::weak_ptr<PeerConnection>, std::owner_less<>> sessions;
  bool stopped = false;
  std::vector<std::shared_ptr<UcxWorker>> ucx_workers;  // options.ucx: made by listen()
  std::atomic<std::size_t> next_ucx_worker{0};
};

namespace {

using SharedPtr = std::shared_ptr<PeerServer::Shared>;

// One session's state after its hello.
struct Session {
  Hello remote;
  // Who the peer is: with TLS the policy peer its certificate names, else its hello's node id.
  std::string peer_id;
  bool tls = false;
  std::vector<std::byte> staging;  // options.stage_chunks: one chunk, kept warm across replies
  std::optional<std::chrono::steady_clock::time_point> last_probe;
};

// A session may ask for a bandwidth probe at most this often: its bytes are filler on the link.
constexpr std::chrono::seconds kMinProbeGap{1};

// Counts one fetch reply as in progress while it is sent.
class ActiveFetch {
 public:
  explicit ActiveFetch(SharedPtr shared) : shared_(std::move(shared)) {
    const std::lock_guard lock(shared_->mutex);
    ++shared_->active_fetches;
  }
  ~ActiveFetch() {
    const std::lock_guard lock(shared_->mutex);
    --shared_->active_fetches;
  }
  ActiveFetch(const ActiveFetch&) = delete;
  ActiveFetch& operator=(const ActiveFetch&) = delete;

 private:
  SharedPtr shared_;
};

// Counts one push as active while it runs, and as failed unless it was filed.
class ActivePush {
 public:
  explicit ActivePush(SharedPtr shared) : shared_(std::move(shared)) {
    const std::lock_guard lock(shared_->mutex);
    ++shared_->counters.active_transfers;
  }
  ~ActivePush() {
    const std::lock_guard lock(shared_->mutex);
    --shared_->counters.active_transfers;
    if (!filed_) ++shared_->counters.failed_transfers;
  }
  ActivePush(const ActivePush&) = delete;
  ActivePush& operator=(const ActivePush&) = delete;
  void mark_filed() { filed_ = true; }

 private:
  SharedPtr shared_;
  bool filed_ = false;
};

asio::awaitable<Status> send_frame(PeerConnection& connection, const std::vector<std::byte>& frame,
                                   std::chrono::milliseconds timeout) {
  co_return co_await write_all(connection, asio::buffer(frame), asio::const_buffer{}, timeout);
}

// The identity the policy peer `peer_id` must present ("" when the policy has no such peer).
std::string peer_claimed_identity(const SharedPtr& shared, const std::string& peer_id) {
  const auto policy = shared->options.policy ? shared->options.policy() : nullptr;
  const PeerPolicy* peer = policy ? policy->find_peer(peer_id) : nullptr;
  return peer != nullptr ? peer_identity(*peer) : std::string();
}

void count_refused(const SharedPtr& shared, std::string_view reason) {
  if (shared->options.on_refused) shared->options.on_refused(reason);
}

// The session's grant under the current policy; nullopt: no policy, nothing is restricted.
std::optional<PeerGrant> session_grant(const SharedPtr& shared, const Session& session,
                                       std::shared_ptr<const Policy>& policy) {
  if (!shared->options.policy) return std::nullopt;
  policy = shared->options.policy();
  return grant_for(*policy, session.peer_id, session.tls);
}

// How this node files chains: by tenant where its policy has tenants.
kv_store::ChainScope chain_scope(const Policy* policy) {
  return policy != nullptr && !policy->tenants.empty() ? kv_store::ChainScope::kTenant
                                                       : kv_store::ChainScope::kUnscoped;
}

// Answers a Fetch with the longest prefix of the chain this node holds, encoded with the
// requested codec, or "not found".
asio::awaitable<Status> serve_fetch(const SharedPtr& shared, PeerConnection& connection, Session& session,
                                    const FetchRequest& request) {
  const auto received_at = std::chrono::steady_clock::now();
  const auto& options = shared->options;
  if (!options.codecs) co_return fail(ErrorCode::kUnsupported, "this sidecar has no codecs for fetches");
  auto spec = codec::resolve_codec(*options.codecs, request.codec);
  if (!spec) co_return outcome::failure(spec.error());
  // A lossless fetch is served exact KV only (the asker files it as exact); a lossy one exact KV
  // or KV its own codec made, never another lossy codec's relabelled.
  const std::vector<std::uint64_t> chain(request.hashes.rbegin(), request.hashes.rend());  // first block first
  const bool lossless = spec.value().codec->lossless();
  // Whole entries only (allow_longer off): a longer entry's prefix would need its encode cut to
  // those tokens and its chain's prefix sent under the key asked for, or the asker's chain check
  // refuses it. A peer holding only a longer entry answers a miss (issue #27, S7).
  const auto held = kv_store::longest_held_prefix(
      *shared->store, {request.model_id, chain, chain.size(), 0,
                       lossless ? kv_store::FidelityRule::exact_only()
                                : kv_store::FidelityRule::exact_or_lossy(codec::spec_name(spec.value()))});
  const std::shared_ptr<const kv_store::StoredEntry> entry = held.entry;
  const kv_store::EntryKey key =
      held ? kv_store::EntryKey{request.model_id, chain[held.blocks - 1]} : kv_store::EntryKey{};
  // A held prefix that adds nothing to what the asker has is a miss, like no prefix at all.
  std::shared_ptr<const Policy> policy;
  const auto grant = session_grant(shared, session, policy);
  // KV published without its token ids never leaves this node: the asker could not verify it.
  const bool refused = entry && entry->chain && grant && !authorize_fetch(*policy, *grant, *entry);
  if (refused) {
    // Answered as a miss, like KV this node does not hold: the asker learns nothing of it.
    count_refused(shared, "fetch");
    spdlog::warn("peer {}: fetch of model {:016x} refused: none of its agents uses that model and tenant",
                 session.peer_id, request.model_id);
  }
  // What the reply would be worth (issue #27): below the asker's least product it is a miss, as
  // lossy KV is for a lossless ask.
  const std::string reply_codec = codec::spec_name(spec.value());
  const double product = entry ? stamped_product(entry->fidelity, reply_codec, lossless, options.codec_factor) : 1.0;
  const bool below_floor = entry && product < request.min_fidelity_product;
  if (below_floor) {
    spdlog::debug("peer {}: fetch of model {:016x} as {}: product {} is below the {} asked for", session.peer_id,
                  request.model_id, reply_codec, product, request.min_fidelity_product);
  }
  if (refused || below_floor || !entry || !entry->chain || entry->info.layout.tokens <= request.skip_tokens) {
    const auto miss = encode_fetch_reply(request.request_id, nullptr);
    co_return co_await send_frame(connection, miss, options.read_timeout);
  }
  const ActiveFetch active(shared);
  // Read through the kernel into a warm buffer and encoded into another: mapping the entry, or
  // encoding into a fresh buffer, paid a first touch per 4 KiB page on every fetch, several
  // times the cost of the copies on hosts with lazily built page tables.
  auto stored = shared->buffers.take(static_cast<std::size_t>(entry->info.bytes));
  if (auto read = kv_store::read_entry(*entry, 0, stored.bytes()); !read) co_return read;
  auto encoded =
      encode_for_fetch(entry->info.layout, stored.bytes(), request.skip_tokens, spec.value(), shared->buffers);
  if (!encoded) co_return outcome::failure(encoded.error());
  stored = {};  // back to the pool before the send: a concurrent fetch may use it meanwhile
  const auto frame = encoded.value().frame();
  // Issue #27: the reply joins the queue of the link to the asker, weighed by the route it names
  // and due by the asker's deadline.
  TransferTag tag{session.peer_id, request.route, TransferPurpose::kFetchReply, frame.size(), std::nullopt};
  if (request.deadline_ms > 0) tag.deadline = received_at + std::chrono::milliseconds(request.deadline_ms);
  GateTicket ticket(options.gate.get(), tag);
  EncodedEntryHeader header;
  header.id = request.request_id;
  header.key = key;
  header.frame_bytes = frame.size();
  header.chunk_bytes = transfer_chunk_bytes(
      std::min(ticket.chunk_bytes(options.chunk_bytes), session.remote.max_chunk_bytes), frame.size());
  header.window_chunks = ticket.window_chunks(options.window_chunks);
  header.chain = *entry->chain;
  header.fidelity_product = product;
  const auto reply = encode_fetch_reply(request.request_id, &header);
  ChunkStreamOptions stream;
  stream.staging = options.stage_chunks ? &session.staging : nullptr;
  ticket.apply(stream);
  if (auto sent = co_await send_chunk_stream(connection, reply, header, frame, stream, options.read_timeout); !sent) {
    co_return sent;
  }
  ticket.complete();
  {
    const std::lock_guard lock(shared->mutex);
    ++shared->counters.fetches_served;
  }
  if (options.on_kv_bytes) {
    options.on_kv_bytes({"served", request.codec, header.frame_bytes, encoded.value().raw_bytes,
                         encoded.value().layout.dtype, encoded.value().encode_seconds});
  }
  co_return ok();
}

// How a pushed entry is filed: as its purpose brought it (counted apart in GET /admin/kv).
kv_store::EntryOrigin stored_origin(PushPurpose purpose) {
  switch (purpose) {
    case PushPurpose::kPrefetch:
      return kv_store::EntryOrigin::kPrefetched;
    case PushPurpose::kSpill:
      return kv_store::EntryOrigin::kSpilledIn;
    case PushPurpose::kPush:
      break;
  }
  return kv_store::EntryOrigin::kPushed;
}

// Receives an encoded entry pushed ahead by a peer, decodes it to raw KV and files it.
// `sender_records_fidelity`: the sender announced kCapFidelity; without it even a lossless
// frame may carry KV computed over a lossy import, so it is filed as unverified (never exact).
asio::awaitable<Status> receive_pushed(const SharedPtr& shared, PeerConnection& connection, const Session& session,
                                       const EncodedEntryHeader& header, bool sender_records_fidelity) {
  const auto& options = shared->options;
  if (!options.codecs) co_return fail(ErrorCode::kUnsupported, "this sidecar has no codecs for pushed KV");
  if (header.frame_bytes > options.max_entry_bytes) {
    co_return fail(ErrorCode::kResourceExhausted, fmt::format("pushed frame of {} bytes exceeds the limit {}",
                                                              header.frame_bytes, options.max_entry_bytes));
  }
  ActivePush active(shared);
  auto received = shared->buffers.take(static_cast<std::size_t>(header.frame_bytes));
  const auto frame = received.u8();
  if (auto got = co_await receive_chunk_stream(connection, header, frame, false, options.read_timeout); !got) {
    co_return got;
  }
  const auto decode_started = std::chrono::steady_clock::now();
  auto decoded = codec::decode_frame_view(*options.codecs, frame, options.max_entry_bytes, shared->buffers);
  if (!decoded) co_return outcome::failure(decoded.error());
  std::shared_ptr<const Policy> policy;
  const auto grant = session_grant(shared, session, policy);
  const bool spill = header.purpose == PushPurpose::kSpill;
  if (grant && !spill) {  // a spill is on no route: checked once its entry is made, below
    auto allowed = authorize_pushed_entry(*policy, *grant, header.route, decoded.value().header.layout);
    if (allowed) allowed = authorize_pushed_tenant(*policy, *grant, header.route, header.chain);
    if (!allowed) {
      count_refused(shared, "push");  // decoded, never filed
      co_return allowed;
    }
  }
  // The pushed token ids must hash to the key the peer files the KV under (a delta's chain
  // covers the prefix it leaves out too).
  const auto& tail_layout = decoded.value().header.layout;
  if (auto chained = kv_store::verify_chain(header.key, header.skip_tokens + tail_layout.tokens, header.chain,
                                            chain_scope(policy.get()));
      !chained) {
    count_refused(shared, "chain");
    co_return fail(chained.error().code,
                   fmt::format("push from peer {} refused: {}", session.peer_id, chained.error().message));
  }
  // Exact KV is worth 1: a lossless frame stamped lower carries lossy KV, which must not be filed
  // as exact.
  if (header.fidelity_product < 1.0 &&
      codec::fidelity_of(codec::frame_codec(*options.codecs, decoded.value().header)).is_exact()) {
    co_return fail(ErrorCode::kInvalidArgument,
                   fmt::format("push from peer {} refused: a lossless frame stamped with fidelity product {} "
                               "carries lossy KV",
                               session.peer_id, header.fidelity_product));
  }
  const double decode_seconds =
      std::chrono::duration<double>(std::chrono::steady_clock::now() - decode_started).count();
  // A delta joins the prefix this node holds (push_delta.h); a whole entry is filed as it came.
  std::shared_ptr<const kv_store::StoredEntry> head;
  const auto& frame_header = decoded.value().header;
  const codec::CodecSpec pushed_codec = codec::frame_codec(*options.codecs, frame_header);
  if (header.skip_tokens > 0) {
    const bool tail_exact = sender_records_fidelity && codec::fidelity_of(pushed_codec).is_exact();
    auto held = delta_head(*shared->store, header.key.model_id, header.chain, chain_scope(policy.get()),
                           header.skip_tokens, tail_layout, tail_exact);
    if (!held) co_return outcome::failure(held.error());
    head = std::move(held).value();
  }
  const auto tail = std::as_bytes(decoded.value().kv);
  auto entry = head ? join_delta(*head, tail_layout, tail, shared->buffers, options.arena.get())
                    : kv_store::make_stored_entry(tail_layout, tail, options.arena.get());
  if (!entry) co_return outcome::failure(entry.error());
  // Pushed lossy KV is filed as lossy; the store keeps exact KV it already has under this key.
  Fidelity pushed =
      sender_records_fidelity ? codec::fidelity_of(pushed_codec) : Fidelity::lossy(std::string(kUnverifiedFidelity));
  // Lossy KV carries the product its sender stamped (issue #27); exact KV stays at 1.
  if (!pushed.is_exact()) pushed.product = header.fidelity_product;
  entry.value()->fidelity = head ? head->fidelity.then(pushed, header.skip_tokens) : std::move(pushed);
  entry.value()->chain = std::make_shared<const kv_store::EntryChain>(header.chain);
  entry.value()->origin = stored_origin(header.purpose);
  if (spill) {
    // Held for the sender: session_body refused spills before reading them without a policy.
    entry.value()->spilled_from = session.peer_id;
    if (auto allowed = authorize_spilled_entry(*policy, *grant, *entry.value()); !allowed) {
      count_refused(shared, "spill");  // decoded, never filed
      co_return allowed;
    }
  }
  // A spill is filed only within the sender's quota, checked in the same step.
  const std::uint64_t quota = spill ? spill_quota(*policy, *grant) : 0;
  auto put = spill ? shared->store->put_spilled(header.key, std::move(entry).value(), quota)
                   : shared->store->put(header.key, std::move(entry).value());
  if (!put && put.error().code == ErrorCode::kResourceExhausted && spill) {
    count_refused(shared, "spill");
    co_return fail(ErrorCode::kResourceExhausted,
                   fmt::format("spill from peer {} refused: {} (its accept_spill_bytes {})", session.peer_id,
                               put.error().message, quota));
  }
  if (!put && put.error().code != ErrorCode::kAlreadyExists) co_return put;
  {
    const std::lock_guard lock(shared->mutex);
    ++shared->counters.committed_transfers;
    if (!put) ++shared->counters.duplicate_transfers;  // the store kept what it held as exactly
    shared->counters.bytes_received += header.frame_bytes;
    shared->counters.chunks_received += header.chunk_count();
  }
  active.mark_filed();
  if (options.on_kv_bytes) {
    // The spec the sender pushed ("int4+zstd"), so both sides count it under the same medium.
    const std::string spec = codec::spec_name(pushed_codec);
    options.on_kv_bytes(
        {"received", spec, header.frame_bytes, decoded.value().kv.size(), frame_header.layout.dtype, decode_seconds});
  }
  // The last chunk's acknowledgement goes out with Committed, in one write: sent alone it woke
  // the sender, which then slept again until Committed came a moment later.
  const auto last_ack = encode_chunk_ack(header.id, static_cast<std::uint32_t>(header.chunk_count() - 1));
  const auto committed = encode_committed(header.id);
  co_return co_await write_all(connection, asio::buffer(last_ack), asio::buffer(committed), options.read_timeout);
}

// What this sidecar takes of a push before reading its chunks: whole entries or deltas (the
// tokens after a prefix it holds), pushed or prefetched along a route, and whole entries a peer
// spills. A spill's delta is refused: a spill is held for its sender alone, apart from the rest.
Status acceptable_push(const EncodedEntryHeader& header) {
  if (header.skip_tokens > 0 && header.purpose == PushPurpose::kSpill) {
    return fail(ErrorCode::kUnsupported,
                fmt::format("spill {} leaves out its first {} tokens: a spill carries the whole entry", header.id,
                            header.skip_tokens));
  }
  return ok();
}

// `bytes` of filler in ProbeReply frames of at most a control payload each.
asio::awaitable<Status> serve_probe(PeerConnection& connection, std::uint32_t bytes,
                                    std::chrono::milliseconds timeout) {
  static const std::vector<std::byte> filler(kMaxControlPayload);
  for (std::uint32_t sent = 0; sent < bytes;) {
    const std::uint32_t size = std::min<std::uint32_t>(bytes - sent, kMaxControlPayload);
    const auto frame = encode_peer_frame(PeerMessage::kProbeReply, std::span(filler).first(size));
    if (auto written = co_await send_frame(connection, frame, timeout); !written) co_return written;
    sent += size;
  }
  co_return ok();
}

// The NodeState a summary carries: what this server can read, then what the daemon adds.
NodeState node_state(const SharedPtr& shared, const Session& session) {
  const auto& options = shared->options;
  NodeState state;
  state.store_budget = options.store_budget_bytes;
  state.store_used = shared->store->stats().bytes;
  if (options.arena) {
    const auto arena = options.arena->stats();
    state.arena_capacity = arena.capacity;
    state.arena_in_use = arena.in_use;
  }
  {
    const std::lock_guard lock(shared->mutex);
    state.queued_transfers = shared->counters.active_transfers + shared->active_fetches;
  }
  // What the asker may still spill here: its quota less its spills this store holds.
  std::shared_ptr<const Policy> policy;
  if (const auto grant = session_grant(shared, session, policy)) {
    const std::uint64_t quota = spill_quota(*policy, *grant);
    const std::uint64_t held = shared->store->spilled_in_bytes(session.peer_id);
    state.spill_accept_left = quota > held ? quota - held : 0;
  }
  if (options.node_state) options.node_state(session.peer_id, state);
  return state;
}

// Issue #29: a link on one of the UCX workers for this connection's chunk streams, and the
// UcxOpenReply that hands its token and the worker's address to the peer (over this connection,
// which TLS authenticated where the policy has peer_tls).
Result<std::vector<std::byte>> open_ucx(const SharedPtr& shared, PeerConnection& connection,
                                        std::span<const std::byte> payload) {
  auto remote_worker = decode_ucx_open(payload);
  if (!remote_worker) return remote_worker.error();
  if (connection.ucx) return fail(ErrorCode::kProtocol, "UCX open on a connection that has a UCX link");
  if (shared->ucx_workers.empty()) return fail(ErrorCode::kUnsupported, "this sidecar offers no UCX transport");
  boost::system::error_code ec;
  const auto remote = connection.socket.remote_endpoint(ec);
  if (ec || (!remote.address().is_loopback() && !shared->options.ucx_trusted_network)) {
    count_refused(shared, "ucx");
    return fail(ErrorCode::kPermissionDenied,
                "UCX carries KV in plaintext: offered only to loopback peers unless /ucx/trusted_network");
  }
  const auto& worker = shared->ucx_workers[shared->next_ucx_worker.fetch_add(1) % shared->ucx_workers.size()];
  auto link = worker->expect_link(remote_worker.value());
  if (!link) return link.error();
  connection.ucx = link.value();
  UcxOpenReply reply;
  reply.token = connection.ucx->token();
  reply.worker_address = worker->address();
  return encode_ucx_open_reply(reply);
}

// Serves one connection until it closes; any error ends the session. (Temporaries are never
// passed into co_await expressions here: GCC 12 can destroy them twice.)
asio::awaitable<Status> session_body(const SharedPtr& shared, PeerConnection& connection) {
  const auto& options = shared->options;
  auto hello = co_await read_frame(connection, options.handshake_timeout, options.handshake_timeout, true);
  if (!hello) co_return outcome::failure(hello.error());
  if (hello.value().header.type != PeerMessage::kHello) co_return fail(ErrorCode::kProtocol, "expected hello");
  if (hello.value().header.version != kPeerVersion) {
    // Refused in the peer's own version, so that it can read why.
    const std::uint16_t theirs = hello.value().header.version;
    spdlog::warn("peer session: {}", wire_version_mismatch(theirs, "a connecting peer").message);
    const Error refusal{ErrorCode::kBadVersion,
                        fmt::format("kvrelay peer {} speaks peer wire version {}, not version {}: both ends of a "
                                    "peer link must run a kvrelay release of the same wire version",
                                    options.node_id, kPeerVersion, theirs)};
    const auto report = encode_peer_error_for_version(refusal, theirs);
    [[maybe_unused]] const auto sent = co_await send_frame(connection, report, options.read_timeout);
    co_return ok();
  }
  auto remote = decode_hello(hello.value().payload);
  if (!remote) co_return outcome::failure(remote.error());
  Session session;
  session.remote = remote.value();
  session.tls = connection.tls.has_value();
  session.peer_id = session.remote.node_id;
  const auto certificate = remote_certificate(connection);
  const auto claimed_identity = peer_claimed_identity(shared, session.peer_id);
  if (session.tls && !names_identity(certificate, claimed_identity)) {
    count_refused(shared, "identity");
    co_return fail(ErrorCode::kPermissionDenied,
                   fmt::format("peer hello names node {}, which its certificate does not: refused", session.peer_id));
  }
  Hello mine;
  mine.node_id = options.node_id;
  mine.capabilities |= kCapFidelity;
  if (!options.shm_socket.empty()) {
    mine.capabilities |= kCapSharedMemory;
    mine.shm_socket = options.shm_socket;
  }
  if (!shared->ucx_workers.empty()) mine.capabilities |= kCapUcx;
  const auto hello_ok = encode_hello(PeerMessage::kHelloOk, mine);
  if (auto sent = co_await send_frame(connection, hello_ok, options.read_timeout); !sent) co_return sent;
  while (connection.socket.is_open()) {
    auto frame = co_await read_frame(connection, options.idle_timeout, options.read_timeout);
    if (!frame) {
      // A close between frames is how a session normally ends: nothing to report.
      if (frame.error().code == ErrorCode::kIo) co_return ok();
      co_return outcome::failure(frame.error());
    }
    const auto& payload = frame.value().payload;
    std::vector<std::byte> answer;
    switch (frame.value().header.type) {
      case PeerMessage::kPing:
        if (payload.size() > 64) co_return fail(ErrorCode::kProtocol, "oversized ping");
        answer = encode_peer_frame(PeerMessage::kPong, payload);
        break;
      case PeerMessage::kStats: {
        PeerServerStats snapshot;
        {
          std::lock_guard lock(shared->mutex);
          snapshot = shared->counters;
        }
        answer = encode_peer_stats(snapshot);
        break;
      }
      case PeerMessage::kFetch: {
        auto request = decode_fetch(payload);
        if (!request) co_return outcome::failure(request.error());
        auto served = co_await serve_fetch(shared, connection, session, request.value());
        if (!served) co_return served;
        continue;
      }
      case PeerMessage::kPushEncoded: {
        auto header = decode_push_encoded(payload);
        if (!header) co_return outcome::failure(header.error());
        // The session ends with this error: nothing is read or filed.
        if (auto acceptable = acceptable_push(header.value()); !acceptable) co_return acceptable;
        std::shared_ptr<const Policy> policy;
        const auto grant = session_grant(shared, session, policy);
        if (header.value().purpose == PushPurpose::kSpill) {
          // Spills need this node's quota for the sender: without a policy there is none.
          auto allowed = grant ? authorize_spill(*policy, *grant)
                               : fail(ErrorCode::kPermissionDenied, "spill refused: this sidecar has no policy");
          if (!allowed) {
            count_refused(shared, "spill");  // the session ends with this error: nothing is read or filed
            co_return allowed;
          }
        } else if (grant) {
          auto allowed = authorize_push(*policy, *grant, header.value().route);
          if (!allowed) {
            count_refused(shared, "push");  // the session ends with this error: nothing is read or filed
            co_return allowed;
          }
        }
        const bool sender_records_fidelity = (remote.value().capabilities & kCapFidelity) != 0;
        auto received = co_await receive_pushed(shared, connection, session, header.value(), sender_records_fidelity);
        if (!received) co_return received;
        continue;
      }
      case PeerMessage::kProbe: {
        auto bytes = decode_probe(payload);
        if (!bytes) co_return outcome::failure(bytes.error());
        const auto now = std::chrono::steady_clock::now();
        if (session.last_probe && now - *session.last_probe < kMinProbeGap) {
          co_return fail(ErrorCode::kProtocol, "bandwidth probes more often than once a second");
        }
        session.last_probe = now;
        auto served = co_await serve_probe(connection, bytes.value(), options.read_timeout);
        if (!served) co_return served;
        continue;
      }
      case PeerMessage::kUcxOpen: {
        auto offer = open_ucx(shared, connection, payload);
        if (!offer) co_return outcome::failure(offer.error());
        answer = std::move(offer).value();
        break;
      }
      case PeerMessage::kSummary: {
        if (!payload.empty()) co_return fail(ErrorCode::kProtocol, "summary request with a payload");
        // Only what this peer may fetch: other tenants' salted hashes are not its to see.
        std::shared_ptr<const Policy> policy;
        const auto grant = session_grant(shared, session, policy);
        // Each shown key with its entry's effective product, in the same order (the filter runs
        // on each entry in turn, under the store's lock).
        std::vector<double> products;
        const auto keys = shared->store->recent_keys(kMaxSummaryKeys, [&](const kv_store::StoredEntry& entry) {
          const bool shown = entry.chain != nullptr && (!grant || authorize_fetch(*policy, *grant, entry));
          if (shown) products.push_back(effective_product(entry.fidelity, options.codec_factor));
          return shown;
        });
        const auto node = node_state(shared, session);
        answer = encode_summary(keys, node, products);
        break;
      }
      default:
        co_return fail(ErrorCode::kProtocol, "unexpected peer message");
    }
    if (auto sent = co_await send_frame(connection, answer, options.read_timeout); !sent) co_return sent;
  }
  co_return ok();
}

// After an error report: reads and drops what the peer still sends, until it closes or `grace`
// passes. Closing with its bytes unread would reset the connection, and a peer still writing (a
// refused push's chunks) would see a broken pipe instead of the report.
asio::awaitable<void> drain(PeerConnection& connection, std::chrono::milliseconds grace) {
  boost::system::error_code ignored;
  connection.socket.shutdown(tcp::socket::shutdown_send, ignored);
  connection.limit = std::chrono::steady_clock::now() + grace;
  std::array<std::byte, 64 << 10> scratch{};
  while (connection.socket.is_open()) {
    connection.arm(grace);
    auto [ec, n] = co_await connection.socket.async_read_some(asio::buffer(scratch), kNoThrow);
    if (ec) break;
  }
}

// TLS before anything else: a failed handshake, or a certificate that names no policy peer,
// closes the connection before a byte of it is read as a kvrelay frame.
asio::awaitable<Status> accept_tls(const SharedPtr& shared, PeerConnection& connection) {
  const auto& options = shared->options;
  auto shaken = co_await start_tls(connection, options.tls->context(), true, options.handshake_timeout);
  if (!shaken) co_return shaken;
  const auto certificate = remote_certificate(connection);
  const auto policy = options.policy ? options.policy() : nullptr;
  if (policy != nullptr) {
    for (const auto& peer : policy->peers) {
      if (names_identity(certificate, peer_identity(peer))) co_return ok();
    }
  }
  co_return fail(ErrorCode::kPermissionDenied, fmt::format("certificate names [{}], no peer identity in the policy",
                                                           fmt::join(certificate.names, ", ")));
}

asio::awaitable<void> run_session(SharedPtr shared, std::shared_ptr<PeerConnection> connection) {
  if (shared->options.tls) {
    const auto accepted = co_await accept_tls(shared, *connection);
    if (!accepted) {
      spdlog::warn("peer connection refused before any frame was read: {}", accepted.error().to_string());
      count_refused(shared, accepted.error().code == ErrorCode::kPermissionDenied ? "identity" : "handshake");
      connection->close();
      co_return;
    }
  }
  const auto status = co_await session_body(shared, *connection);
  if (!status && connection->socket.is_open()) {
    spdlog::warn("peer session: {}", status.error().to_string());
    const auto report = encode_peer_error(status.error());
    const std::chrono::milliseconds grace(500);
    [[maybe_unused]] const auto sent = co_await send_frame(*connection, report, grace);
    co_await drain(*connection, grace);
  } else if (!status) {
    spdlog::warn("peer session: {}", status.error().to_string());
  }
  connection->close();
}

asio::awaitable<void> accept_loop(SharedPtr shared, asio::io_context& io) {
  while (true) {
    tcp::socket socket(asio::make_strand(io));
    auto [ec] = co_await shared->acceptor->async_accept(socket, kNoThrow);
    if (ec) {
      if (ec == asio::error::operation_aborted || !shared->acceptor->is_open()) co_return;
      spdlog::warn("peer accept: {}", ec.message());
      continue;
    }
    tune_socket(socket);
    auto connection = std::make_shared<PeerConnection>(std::move(socket));
    {
      std::lock_guard lock(shared->mutex);
      if (shared->stopped) co_return;
      ++shared->counters.sessions;
      shared->sessions.insert(connection);
    }
    const auto executor = connection->socket.get_executor();
    asio::co_spawn(executor, watchdog(connection), asio::detached);
    asio::co_spawn(executor, run_session(shared, connection), [shared, connection](std::exception_ptr) {
      std::lock_guard lock(shared->mutex);
      shared->sessions.erase(connection);
    });
  }
}

}  // namespace

PeerServer::PeerServer(asio::io_context& io, PeerServerOptions options, std::shared_ptr<kv_store::EntryStore> store)
    : io_(io), shared_(std::make_shared<Shared>(std::move(options), std::move(store))) {}

PeerServer::~PeerServer() {
  stop();
}

Status PeerServer::listen(const HostPort& address) {
  boost::system::error_code ec;
  const auto ip = asio::ip::make_address(address.host, ec);
  if (ec)
    return fail(ErrorCode::kInvalidArgument, fmt::format("peer listen address '{}': {}", address.host, ec.message()));
  auto acceptor = std::make_unique<tcp::acceptor>(asio::make_strand(io_));
  const tcp::endpoint endpoint(ip, address.port);
  acceptor->open(endpoint.protocol(), ec);
  if (!ec) acceptor->set_option(asio::socket_base::reuse_address(true), ec);
  if (!ec) acceptor->bind(endpoint, ec);
  if (!ec) acceptor->listen(asio::socket_base::max_listen_connections, ec);
  if (ec) return fail(ErrorCode::kIo, fmt::format("peer listen {}: {}", address.to_string(), ec.message()));
  shared_->acceptor = std::move(acceptor);
  if (shared_->options.ucx && shared_->ucx_workers.empty()) {
    for (unsigned index = 0; index < std::max(1U, shared_->options.ucx_workers); ++index) {
      auto worker = UcxWorker::create(shared_->options.ucx, asio::make_strand(io_), UcxThreading::kManyThreads,
                                      [weak = std::weak_ptr<Shared>(shared_)] {
                                        if (const auto shared = weak.lock()) count_refused(shared, "ucx_token");
                                      });
      if (!worker) return worker.error();
      shared_->ucx_workers.push_back(std::move(worker).value());
    }
  }
  asio::co_spawn(shared_->acceptor->get_executor(), accept_loop(shared_, io_), asio::detached);
  return ok();
}

tcp::endpoint PeerServer::local_endpoint() const {
  boost::system::error_code ec;
  return shared_->acceptor ? shared_->acceptor->local_endpoint(ec) : tcp::endpoint{};
}

void PeerServer::stop() {
  std::vector<std::shared_ptr<PeerConnection>> open;
  {
    std::lock_guard lock(shared_->mutex);
    if (shared_->stopped) return;
    shared_->stopped = true;
    for (const auto& weak : shared_->sessions) {
      if (auto connection = weak.lock()) open.push_back(std::move(connection));
    }
  }
  if (shared_->acceptor) {
    asio::post(shared_->acceptor->get_executor(), [shared = shared_] {
      boost::system::error_code ignored;
      shared->acceptor->close(ignored);
    });
  }
  for (auto& connection : open) {
    asio::post(connection->socket.get_executor(), [connection] { connection->close(); });
  }
  for (const auto& worker : shared_->ucx_workers)
    worker->stop();
}

std::uint64_t PeerServer::ucx_refused_endpoints() const {
  std::uint64_t refused = 0;
  for (const auto& worker : shared_->ucx_workers)
    refused += worker->refused_endpoints();
  return refused;
}

PeerServerStats PeerServer::stats() const {
  std::lock_guard lock(shared_->mutex);
  return shared_->counters;
}

}  // namespace kvrelay::peer
