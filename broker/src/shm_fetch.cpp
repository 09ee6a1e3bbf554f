#include "shm_fetch.h"

#include <sys/socket.h>
#include <sys/time.h>

#include <fmt/format.h>

#include <algorithm>

#include "kvrelay/peer/fetch_encoding.h"

namespace kvrelay::broker {

namespace {

using Clock = std::chrono::steady_clock;

Error deadline_error(std::string_view stage) {
  return Error{ErrorCode::kTimeout, fmt::format("{}: deadline exceeded", stage)};
}

// The wait one data-plane call may take: its own timeout or the time left, whichever is less.
// nullopt: no time left.
std::optional<std::chrono::microseconds> wait_for_call(std::chrono::milliseconds call_timeout,
                                                       peer::Deadline deadline) {
  const auto left = std::chrono::duration_cast<std::chrono::microseconds>(deadline - Clock::now());
  if (left.count() <= 0) return std::nullopt;
  return std::min<std::chrono::microseconds>(call_timeout, left);
}

// The data plane's socket blocks; its send and receive timeouts bound the next call.
void bound_next_call(const shm::ShmClient& client, std::chrono::microseconds wait) {
  const timeval timeout{static_cast<time_t>(wait.count() / 1'000'000),
                        static_cast<suseconds_t>(wait.count() % 1'000'000)};
  ::setsockopt(client.socket_fd(), SOL_SOCKET, SO_RCVTIMEO, &timeout, sizeof(timeout));
  ::setsockopt(client.socket_fd(), SOL_SOCKET, SO_SNDTIMEO, &timeout, sizeof(timeout));
}

// A failed call with the stage named; one that ran into the deadline says so.
Error call_error(std::string_view stage, const Error& error, peer::Deadline deadline) {
  if (Clock::now() >= deadline) return deadline_error(stage);
  return Error{error.code, fmt::format("{}: {}", stage, error.message)};
}

// The first entry of the chain (longest prefix first) that adds tokens to what the asker holds.
Result<std::optional<std::pair<kv_store::EntryKey, shm::ReadOnlyEntry>>> look_up_chain(
    const ShmFetchContext& context, const peer::FetchRequest& request, peer::Deadline deadline) {
  for (const std::uint64_t hash : request.hashes) {
    const auto wait = wait_for_call(context.call_timeout, deadline);
    if (!wait) return deadline_error("shm lookup");
    bound_next_call(*context.client, *wait);
    const kv_store::EntryKey key{request.model_id, hash};
    auto found = context.client->lookup(key);
    if (!found) {
      if (found.error().code == ErrorCode::kNotFound) continue;
      return call_error("shm lookup", found.error(), deadline);
    }
    // Raw transfers without a layout are not KV; a prefix no longer than the asker's adds nothing.
    if (found.value().info.layout.layers == 0 || found.value().info.layout.tokens <= request.skip_tokens) continue;
    return std::optional(std::pair(key, std::move(found).value()));
  }
  return std::optional<std::pair<kv_store::EntryKey, shm::ReadOnlyEntry>>();
}

}  // namespace

Result<std::optional<peer::PeerClient::FetchedFrame>> fetch_over_shm(const ShmFetchContext& context,
                                                                     const peer::FetchRequest& request,
                                                                     peer::Deadline deadline,
                                                                     std::uint64_t max_frame_bytes) {
  const auto requested_at = Clock::now();
  KVRELAY_TRY(const auto spec, codec::resolve_codec(context.codecs, request.codec));
  if (!context.client) {
    const auto wait = wait_for_call(context.call_timeout, deadline);
    if (!wait) return deadline_error("shm connect");
    auto connected = shm::ShmClient::connect(
        context.socket_path, shm::kDataPlaneVersion,
        std::max(std::chrono::milliseconds(1), std::chrono::duration_cast<std::chrono::milliseconds>(*wait)));
    if (!connected) return call_error(fmt::format("shm connect {}", context.socket_path), connected.error(), deadline);
    // Reads go through the arena's descriptor (pread): no need to touch the peer's pages here,
    // whatever this sidecar's own memory strategy.
    connected.value().set_memory_strategy(MemoryStrategy::kPortable);
    context.client.emplace(std::move(connected).value());
  }
  KVRELAY_TRY(auto found, look_up_chain(context, request, deadline));
  if (!found) return std::optional<peer::PeerClient::FetchedFrame>();
  const auto& [key, entry] = *found;
  if (entry.info.bytes > max_frame_bytes) {
    return fail(ErrorCode::kResourceExhausted,
                fmt::format("shm entry of {} bytes is more than the {} allowed", entry.info.bytes, max_frame_bytes));
  }
  const auto looked_up = Clock::now();
  auto stored = context.buffers.take(static_cast<std::size_t>(entry.info.bytes));
  if (auto read = entry.read(0, stored.bytes()); !read) return call_error("shm read", read.error(), deadline);
  // Only the tokens after the asker's prefix, encoded as a TCP fetch would send them.
  KVRELAY_TRY(auto encoded,
              peer::encode_for_fetch(entry.info.layout, stored.bytes(), request.skip_tokens, spec, context.buffers));
  if (Clock::now() >= deadline) return deadline_error("shm encode");
  peer::PeerClient::FetchedFrame fetched;
  fetched.key = key;
  // The peer sends an entry's token ids with it, or no entry at all (a sidecar older than
  // data-plane version 5 sends none: the chain stays empty and the fetch stage refuses it).
  if (entry.chain) fetched.chain = *entry.chain;
  fetched.buffer = std::move(encoded.buffer);
  fetched.frame_bytes = encoded.frame_bytes;
  fetched.transport = "shm";
  fetched.reply_wait = std::chrono::duration_cast<std::chrono::microseconds>(looked_up - requested_at);
  fetched.transfer = std::chrono::duration_cast<std::chrono::microseconds>(Clock::now() - looked_up);
  return std::optional(std::move(fetched));
}

}  // namespace kvrelay::broker
