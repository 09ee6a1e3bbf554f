#include "fetch_missing.h"

#include <fmt/format.h>

#include <algorithm>
#include <chrono>
#include <cstdint>
#include <random>

#include "materialize.h"

namespace kvrelay::broker {

namespace {

using nlohmann::json;
using FetchClock = std::chrono::steady_clock;

template <class Duration>
double as_milliseconds(Duration duration) {
  return std::chrono::duration<double, std::milli>(duration).count();
}

// FetchRequest.deadline_ms: what is left of `deadline`, at least 1 ms; 0 (none) when unbounded.
std::uint32_t deadline_ms_left(peer::Deadline deadline) {
  if (deadline == peer::Deadline::max()) return 0;
  const auto left = std::chrono::ceil<std::chrono::milliseconds>(deadline - FetchClock::now()).count();
  return static_cast<std::uint32_t>(std::clamp<std::int64_t>(left, 1, UINT32_MAX));
}

}  // namespace

FetchOutcome fetch_missing(Fetcher& fetcher, const FetchInputs& in) {
  const auto& request = in.request;
  FetchOutcome outcome;
  peer::FetchRequest fetch;
  fetch.request_id = std::random_device{}();
  fetch.model_id = request.model_id;
  fetch.codec = in.codec;
  fetch.route = in.route;
  fetch.min_fidelity_product = in.min_fidelity_product;
  // Only the blocks this sidecar lacks cross the link; the held prefix is joined back after.
  const std::uint64_t held_tokens = in.held ? in.held.entry->info.layout.tokens : 0;
  fetch.skip_tokens = held_tokens;
  for (std::size_t blocks = request.block_hashes.size(); blocks > in.held.blocks; --blocks) {
    fetch.hashes.push_back(request.block_hashes[blocks - 1]);
  }
  auto sources = fetcher.candidates(request.model_id, fetch.hashes);
  if (const auto preferred = std::find(sources.begin(), sources.end(), in.prefer_peer); preferred != sources.end())
    std::rotate(sources.begin(), preferred, preferred + 1);
  for (const auto& source : sources) {
    if (FetchClock::now() >= in.deadline) {
      outcome.attempts.push_back({{"peer", source}, {"result", "skipped: lookup deadline reached"}});
      break;
    }
    const auto started = FetchClock::now();
    fetch.deadline_ms = deadline_ms_left(in.deadline);
    auto fetched = fetcher.fetch(source, fetch, in.deadline, in.max_bytes);
    if (!fetched) {
      outcome.attempts.push_back({{"peer", source}, {"result", fetched.error().to_string()}});
      continue;
    }
    if (!fetched.value()) {
      outcome.attempts.push_back({{"peer", source}, {"result", "holds none"}});
      continue;
    }
    const auto received = FetchClock::now();
    const peer::PeerClient::FetchedFrame& frame = *fetched.value();
    if (received >= in.deadline) {  // the worker prefills rather than wait for the decode too
      outcome.attempts.push_back({{"peer", source},
                                  {"transport", frame.transport},
                                  {"result", "timeout: decode: deadline exceeded before the frame could be decoded"}});
      break;
    }
    const auto position = std::find(request.block_hashes.begin(), request.block_hashes.end(), frame.key.context_hash);
    if (position == request.block_hashes.end()) {
      outcome.attempts.push_back({{"peer", source}, {"result", "the reply names a key that was not asked for"}});
      continue;
    }
    // A source must not send less than was asked for, nor lossy KV as a lossless medium.
    if (frame.fidelity_product < in.min_fidelity_product || (in.lossless && frame.fidelity_product < 1.0)) {
      outcome.attempts.push_back(
          {{"peer", source},
           {"transport", frame.transport},
           {"result", fmt::format("refused: fidelity product {} below the {} asked for", frame.fidelity_product,
                                  in.lossless ? 1.0 : in.min_fidelity_product)}});
      continue;
    }
    const auto blocks = static_cast<std::size_t>(position - request.block_hashes.begin()) + 1;
    // The source's token ids must hash to the chain asked for: KV of other tokens is refused.
    if (auto chained = kv_store::verify_chain_keys(request.model_id, frame.chain, in.scope,
                                                   std::span(request.block_hashes).first(blocks));
        !chained) {
      outcome.attempts.push_back(
          {{"peer", source}, {"transport", frame.transport}, {"result", chained.error().to_string()}});
      if (in.on_chain_mismatch) in.on_chain_mismatch(source);
      continue;
    }
    auto entry = entry_from_frame({in.codecs, frame.frame(), in.held.entry.get(), blocks * request.block_tokens,
                                   in.codec, in.lossless, in.max_bytes, fetcher.buffers(), in.arena,
                                   std::make_shared<const kv_store::EntryChain>(frame.chain), frame.fidelity_product});
    if (!entry) {
      outcome.attempts.push_back({{"peer", source}, {"result", entry.error().message}});
      continue;
    }
    const double receive_ms = as_milliseconds(received - started);
    const double seconds = (receive_ms / 1e3) + entry.value().decode_seconds;
    const double filing_ms = entry.value().filing_seconds * 1e3;
    // Where the fetch's time went (docs/operations.md, "The fetch record").
    const json steps{
        {"connect_and_request_ms", receive_ms - as_milliseconds(frame.reply_wait) - as_milliseconds(frame.transfer)},
        {"reply_wait_ms", as_milliseconds(frame.reply_wait)},
        {"transfer_ms", as_milliseconds(frame.transfer)},
        {"decode_ms", entry.value().decode_seconds * 1e3},
        {"entry_ms", in.held ? 0.0 : filing_ms},
        {"join_ms", in.held ? filing_ms : 0.0}};
    json attempt{{"peer", source},
                 {"result", "fetched"},
                 {"transport", frame.transport},
                 {"held_tokens", held_tokens},
                 {"fetched_tokens", blocks * request.block_tokens - held_tokens},
                 {"frame_bytes", frame.frame_bytes},
                 {"raw_bytes", entry.value().raw_bytes},
                 {"fidelity_product", frame.fidelity_product},
                 {"seconds", seconds},
                 {"steps", steps}};
    if (!frame.transport_note.empty()) attempt["transport_note"] = frame.transport_note;
    outcome.attempts.push_back(std::move(attempt));
    outcome.fetched = FetchedKv{std::move(entry.value().entry),
                                blocks,
                                source,
                                frame.transport,
                                frame.frame_bytes,
                                entry.value().raw_bytes,
                                entry.value().dtype,
                                seconds,
                                entry.value().decode_seconds};
    return outcome;
  }
  return outcome;
}

}  // namespace kvrelay::broker
