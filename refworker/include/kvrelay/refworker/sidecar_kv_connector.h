#pragma once

// The reference worker's KV connector over the local kvrelay sidecar's shared-memory data plane
// (the client library in shm_transport/), doing what a vLLM KV connector does:
// - lookup: the prompt's chained block hashes name its possible prefixes; the sidecar, given the
//   request's kv_transfer_params.kvrelay, chooses the medium (and may fetch from a peer) and
//   answers with the longest prefix it supplies (short of the whole prompt, so at least one token
//   is prefilled for logits), mapped read-only and imported;
//   Its chain starts at the root the request's kvrelay params name (chain_root), so tenants and
//   cache salts never share a chain;
// - publish: the KV of the full blocks of prompt + generated tokens is committed under the hash
//   of its last block, so any later prompt that extends this context finds it, with those
//   blocks' token ids (the sidecar checks the key against them, and peers need them).

#include <memory>
#include <mutex>
#include <string>

#include "kvrelay/core/block_hash.h"
#include "kvrelay/refworker/kv_connector.h"
#include "kvrelay/shm_transport/client.h"

namespace kvrelay::refworker {

class SidecarKvConnector final : public KvConnector {
 public:
  // Connects lazily (and again after a failure), so a worker can start before its sidecar.
  SidecarKvConnector(std::string socket_path, std::uint64_t fingerprint_id,
                     std::uint32_t block_tokens = kDefaultBlockTokens);

  Result<std::optional<KvPrefix>> lookup(std::span<const std::int32_t> tokens, const nlohmann::json& params) override;
  Status publish(std::span<const std::int32_t> tokens, const KvLayout& layout, std::span<const float> kv,
                 const nlohmann::json& params, const Fidelity& fidelity, std::uint64_t prompt_tokens) override;
  void report_prefill(std::span<const std::int32_t> computed_tokens, std::uint64_t context_tokens, double seconds,
                      const nlohmann::json& params) override;

 private:
  Result<shm::ShmClient*> client();
  // Version-1 sidecars: probe the store key by key, longest prefix first.
  Result<std::optional<KvPrefix>> lookup_by_keys(shm::ShmClient& sidecar, std::span<const std::int32_t> tokens,
                                                 const std::vector<BlockHash>& hashes);
  // Copies an entry out after checking it covers exactly `prefix_tokens` fp32 tokens.
  static Result<KvPrefix> copy_prefix(const shm::ReadOnlyEntry& entry, std::uint64_t prefix_tokens);
  // Leaves the bytes in the entry's segment; the session reads them straight into its cache.
  static Result<KvPrefix> segment_prefix(shm::ReadOnlyEntry entry, std::uint64_t prefix_tokens);
  // The KvPrefix a Resolved reply describes (a prefix, a span or sparse KV), checked against the
  // prompt of `prompt_tokens` tokens.
  [[nodiscard]] Result<KvPrefix> resolved_prefix(shm::ResolvedPrefix resolved, std::uint64_t prompt_tokens) const;
  // The prompt's chain from the root the request's kvrelay params name.
  [[nodiscard]] std::vector<BlockHash> block_hashes(std::span<const std::int32_t> tokens,
                                                    const nlohmann::json& params) const;

  std::string socket_path_;
  std::uint64_t fingerprint_id_;
  std::uint32_t block_tokens_;
  std::mutex mutex_;  // the model thread is the only caller today; the client is not thread-safe
  std::optional<shm::ShmClient> client_;
};

// Where a request's block-hash chain starts: kv_transfer_params.kvrelay.chain_root (16 hex digits,
// set by the front proxy for a tenant or a cache_salt), else kRootBlockHash.
[[nodiscard]] BlockHash chain_root(const nlohmann::json& params);

// Copies the first `tokens` tokens of every layer's K and V out of a cache in KvLayout order.
[[nodiscard]] std::vector<float> slice_kv_prefix(const KvLayout& layout, std::span<const float> kv,
                                                 std::uint64_t tokens);

}  // namespace kvrelay::refworker
