#pragma once

// Stage two's loop: asks each candidate in turn for the blocks after the held prefix, and
// materializes the first good answer into an entry of the whole prefix. Every attempt is
// described for the decision record (docs/operations.md, "The fetch record").

#include <nlohmann/json.hpp>

#include <cstdint>
#include <functional>
#include <memory>
#include <optional>
#include <string>

#include "kvrelay/codec_plugins/registry.h"
#include "kvrelay/kv_store/arena.h"
#include "kvrelay/kv_store/entry_chain.h"
#include "kvrelay/kv_store/prefix_scan.h"
#include "kvrelay/shm_transport/control_protocol.h"

#include "fetcher.h"

namespace kvrelay::broker {

struct FetchedKv {
  // Held prefix + fetched delta; lossy KV carries the product its source stamped (fidelity.product).
  std::shared_ptr<const kv_store::StoredEntry> entry;
  std::size_t blocks = 0;
  std::string source;
  std::string transport;  // "tcp" or "shm"
  std::uint64_t frame_bytes = 0;
  std::uint64_t raw_bytes = 0;
  DType dtype = DType::kFloat32;
  double seconds = 0.0;         // the link's share: request to checked KV, without filing it
  double decode_seconds = 0.0;  // of that, the local decode
};

struct FetchOutcome {
  std::optional<FetchedKv> fetched;
  nlohmann::json attempts = nlohmann::json::array();
};

struct FetchInputs {
  const shm::ResolveRequest& request;
  const kv_store::HeldPrefix& held;
  const std::string& codec;
  bool lossless = true;
  peer::Deadline deadline;
  std::uint64_t max_bytes = 0;  // limits.kv_store_bytes
  const codec::CodecRegistry& codecs;
  kv_store::ShmArena* arena = nullptr;
  // How this node files chains: a fetched prefix's token ids must hash to the asked keys.
  kv_store::ChainScope scope = kv_store::ChainScope::kUnscoped;
  std::function<void(const std::string& source)> on_chain_mismatch;  // counted as a refusal
  // Issue #27, sent in every FetchRequest: the route looked up for ("" none), and the least
  // fidelity product the KV may carry (0: any); sources answer "not found" below it, and a reply
  // stamped below it is refused here too. `deadline` goes along as deadline_ms (the time left).
  std::string route{};
  double min_fidelity_product = 0.0;
  // Asked first: the peer a stub says holds this node's spilled entry (issue #27).
  std::string prefer_peer{};
};

// Everything, from connecting to decoding, by in.deadline; past it, nothing fetched.
[[nodiscard]] FetchOutcome fetch_missing(Fetcher& fetcher, const FetchInputs& in);

}  // namespace kvrelay::broker
