#include "kvrelay/refworker/sidecar_kv_connector.h"

#include <unistd.h>

#include <fmt/format.h>
#include <spdlog/spdlog.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <memory>

namespace kvrelay::refworker {

SidecarKvConnector::SidecarKvConnector(std::string socket_path, std::uint64_t fingerprint_id,
                                       std::uint32_t block_tokens)
    : socket_path_(std::move(socket_path)), fingerprint_id_(fingerprint_id), block_tokens_(block_tokens) {}

Result<shm::ShmClient*> SidecarKvConnector::client() {
  if (!client_) {
    auto connected = shm::ShmClient::connect(socket_path_);
    if (!connected) return connected.error();
    client_.emplace(std::move(connected).value());
  }
  return &*client_;
}

std::vector<BlockHash> SidecarKvConnector::block_hashes(std::span<const std::int32_t> tokens,
                                                        const nlohmann::json& params) const {
  std::vector<TokenId> ids(tokens.begin(), tokens.end());  // ids are validated non-negative upstream
  return hash_blocks(fingerprint_id_, ids, block_tokens_, chain_root(params));
}

BlockHash chain_root(const nlohmann::json& params) {
  if (!params.is_object()) return kRootBlockHash;
  const auto it = params.find("chain_root");
  if (it == params.end() || !it->is_string()) return kRootBlockHash;
  // A malformed root hashes the default chain; the sidecar then finds nothing of a tenant's.
  return parse_block_hash_hex(it->get_ref<const std::string&>()).value_or(kRootBlockHash);
}

std::vector<float> slice_kv_prefix(const KvLayout& layout, std::span<const float> kv, std::uint64_t tokens) {
  const std::uint64_t row = static_cast<std::uint64_t>(layout.kv_heads) * layout.head_dim;
  std::vector<float> prefix(static_cast<std::size_t>(layout.layers) * 2 * tokens * row);
  for (std::uint64_t tensor = 0; tensor < 2ULL * layout.layers; ++tensor) {
    std::memcpy(prefix.data() + tensor * tokens * row, kv.data() + tensor * layout.tokens * row,
                tokens * row * sizeof(float));
  }
  return prefix;
}

namespace {

std::string params_text(const nlohmann::json& params) {
  return params.is_null() ? std::string() : params.dump(-1, ' ', false, nlohmann::json::error_handler_t::replace);
}

}  // namespace

Result<KvPrefix> SidecarKvConnector::copy_prefix(const shm::ReadOnlyEntry& entry, std::uint64_t prefix_tokens) {
  const auto& info = entry.info;
  if (info.layout.tokens != prefix_tokens || info.layout.dtype != DType::kFloat32 ||
      info.bytes != entry.bytes().size()) {
    return fail(ErrorCode::kLayoutMismatch,
                fmt::format("sidecar entry for {} tokens has layout {}", prefix_tokens, info.layout.describe()));
  }
  KvPrefix prefix;
  prefix.layout = info.layout;
  prefix.kv.resize(info.bytes / sizeof(float));
  std::memcpy(prefix.kv.data(), entry.bytes().data(), info.bytes);
  return prefix;
}

Result<KvPrefix> SidecarKvConnector::segment_prefix(shm::ReadOnlyEntry entry, std::uint64_t prefix_tokens) {
  const auto& info = entry.info;
  KVRELAY_TRY(const std::uint64_t expected, info.layout.total_bytes());
  if (info.layout.tokens != prefix_tokens || info.layout.dtype != DType::kFloat32 || info.bytes != expected) {
    return fail(ErrorCode::kLayoutMismatch,
                fmt::format("sidecar entry for {} tokens has layout {}", prefix_tokens, info.layout.describe()));
  }
  KvPrefix prefix;
  prefix.layout = info.layout;
  // A sealed segment, or an arena block under lease until this prefix is dropped: either way
  // its bytes cannot change, so reading it later, from the model thread, is safe.
  auto held = std::make_shared<shm::ReadOnlyEntry>(std::move(entry));
  prefix.read = [held](std::uint64_t offset, std::span<float> into) -> Status {
    return held->read(offset * sizeof(float), std::as_writable_bytes(into));
  };
  return prefix;
}

Result<KvPrefix> SidecarKvConnector::resolved_prefix(shm::ResolvedPrefix resolved, std::uint64_t prompt_tokens) const {
  const shm::ResolvedMeta& meta = resolved.meta;
  const std::uint64_t start = std::uint64_t{meta.first_block} * block_tokens_;
  const std::uint64_t end = start + (std::uint64_t{meta.blocks} * block_tokens_);
  if (end > prompt_tokens) {
    return fail(ErrorCode::kProtocol,
                fmt::format("sidecar resolved tokens {}..{} of a {}-token prompt", start, end, prompt_tokens));
  }
  std::uint64_t rows = end - start;
  if (!meta.kept.empty()) {
    KVRELAY_TRY(check_token_runs(meta.kept, end));
    if (meta.kept.front().start < start) {
      return fail(ErrorCode::kProtocol, "sidecar's sparse KV keeps a position before the blocks it covers");
    }
    rows = run_tokens(meta.kept);
  }
  KVRELAY_TRY(auto prefix, segment_prefix(std::move(resolved.entry), rows));
  prefix.fidelity = meta.fidelity.prefix(end);
  prefix.start_tokens = meta.kept.empty() ? start : 0;
  if (!meta.kept.empty()) {
    prefix.kept = meta.kept;
    prefix.context_tokens = end;
  }
  return prefix;
}

Result<std::optional<KvPrefix>> SidecarKvConnector::lookup(std::span<const std::int32_t> tokens,
                                                           const nlohmann::json& params) {
  const std::lock_guard lock(mutex_);
  const auto hashes = block_hashes(tokens, params);
  KVRELAY_TRY(auto* sidecar, client());
  if (sidecar->server_version() < 2) return lookup_by_keys(*sidecar, tokens, hashes);
  shm::ResolveRequest request;
  request.model_id = fingerprint_id_;
  request.block_tokens = block_tokens_;
  request.prompt_tokens = tokens.size();
  request.block_hashes.assign(hashes.begin(), hashes.end());
  request.params_json = params_text(params);
  // This worker prefills what precedes a span and attends over sparse positions (issue #28).
  if (sidecar->server_version() >= shm::kSpanDataPlaneVersion) request.flags = shm::kResolveSpan | shm::kResolveSparse;
  auto resolved = sidecar->resolve_unmapped(request);
  if (!resolved) {
    if (resolved.error().code == ErrorCode::kNotFound) {
      spdlog::debug("kv lookup miss: {}", resolved.error().message);
      return std::optional<KvPrefix>{};
    }
    client_.reset();  // the connection is in an unknown state: reconnect next time
    return resolved.error();
  }
  const std::string medium = resolved.value().meta.medium;
  KVRELAY_TRY(auto prefix, resolved_prefix(std::move(resolved).value(), tokens.size()));
  spdlog::debug("kv lookup: {} tokens from {} via {}", prefix.layout.tokens, prefix.start_tokens, medium);
  return std::optional<KvPrefix>(std::move(prefix));
}

Result<std::optional<KvPrefix>> SidecarKvConnector::lookup_by_keys(shm::ShmClient& sidecar,
                                                                   std::span<const std::int32_t> tokens,
                                                                   const std::vector<BlockHash>& hashes) {
  // Longest prefix first; a prefix equal to the whole prompt would leave nothing to prefill.
  for (std::size_t blocks = hashes.size(); blocks > 0; --blocks) {
    const std::uint64_t prefix_tokens = blocks * block_tokens_;
    if (prefix_tokens >= tokens.size()) continue;
    auto entry = sidecar.lookup({fingerprint_id_, hashes[blocks - 1]});
    if (!entry) {
      if (entry.error().code == ErrorCode::kNotFound) continue;
      client_.reset();
      return entry.error();
    }
    KVRELAY_TRY(auto prefix, copy_prefix(entry.value(), prefix_tokens));
    return std::optional<KvPrefix>(std::move(prefix));
  }
  return std::optional<KvPrefix>{};
}

Status SidecarKvConnector::publish(std::span<const std::int32_t> tokens, const KvLayout& layout,
                                   std::span<const float> kv, const nlohmann::json& params, const Fidelity& fidelity,
                                   std::uint64_t prompt_tokens) {
  const std::lock_guard lock(mutex_);
  const auto hashes = block_hashes(tokens, params);
  if (hashes.empty()) return ok();  // shorter than one block: nothing shareable
  const std::uint64_t full_tokens = hashes.size() * block_tokens_;
  KVRELAY_TRY(auto* sidecar, client());
  const auto prefix = full_tokens == layout.tokens ? std::vector<float>(kv.begin(), kv.end())
                                                   : slice_kv_prefix(layout, kv, full_tokens);
  const auto bytes = std::as_bytes(std::span<const float>(prefix));
  // The token ids the key is the chain of, so the sidecar can check it and send the KV to peers.
  kv_store::EntryChain chain;
  chain.block_tokens = block_tokens_;
  chain.root = chain_root(params);
  chain.tokens.assign(tokens.begin(), tokens.begin() + static_cast<std::ptrdiff_t>(full_tokens));
  chain.prompt_tokens = static_cast<std::uint32_t>(std::min(prompt_tokens, full_tokens));
  auto published = sidecar->publish_with_context({fingerprint_id_, hashes.back()}, layout.with_tokens(full_tokens),
                                                 bytes, params_text(params), fidelity.prefix(full_tokens), &chain);
  if (!published && published.error().code != ErrorCode::kAlreadyExists) {
    client_.reset();
    return published.error();
  }
  return ok();
}

void SidecarKvConnector::report_prefill(std::span<const std::int32_t> computed_tokens, std::uint64_t context_tokens,
                                        double seconds, const nlohmann::json& params) {
  const std::lock_guard lock(mutex_);
  auto sidecar = client();
  if (!sidecar) return;  // the cost model misses one sample; the request is unaffected
  const shm::PrefillReport report{fingerprint_id_, computed_tokens.size(), context_tokens, seconds,
                                  params_text(params)};
  if (auto sent = sidecar.value()->report_prefill(report); !sent) {
    spdlog::debug("prefill report not delivered: {}", sent.error().to_string());
    client_.reset();
  }
}

}  // namespace kvrelay::refworker
