#pragma once

// A branch of a published prompt through a sidecar's data plane and the C ABI (issue #27, the
// store's prefix index): 4 blocks published; a prompt that shares the first 2 and then diverges
// resolves 2 blocks' tokens, and what a claim maps is byte for byte the first 2 blocks of the
// publish. Shared by the store-only data plane's test and the daemon's (the KV path a vLLM
// connector resolves through).

#include <catch2/catch.hpp>

#include <cstdint>
#include <cstring>
#include <string>
#include <vector>

#include "kvrelay/shm_transport/kvrelay_client.h"

namespace kvrelay::test {

inline constexpr std::uint32_t kBranchBlockTokens = 16;
inline constexpr std::uint64_t kBranchRowBytes = 8 * 2;  // one token's K (or V): 1 head of 8 fp16 values

// `count` token ids: the first `shared` the same for every seed, the rest the seed's own.
inline std::vector<std::uint32_t> branch_ids(std::size_t count, std::size_t shared, std::uint32_t seed) {
  std::vector<std::uint32_t> ids(count);
  for (std::size_t index = 0; index < count; ++index) {
    ids[index] = index < shared ? static_cast<std::uint32_t>((index * 2654435761U + 7) % 32000)
                                : static_cast<std::uint32_t>((index * 40503U + seed * 977U) % 32000);
  }
  return ids;
}

inline kvrelay_client* branch_connect(const std::string& socket_path) {
  kvrelay_client* client = nullptr;
  REQUIRE(kvrelay_client_connect(socket_path.c_str(), &client) == KVRELAY_OK);
  return client;
}

// Publishes KV for all of `ids` (whole blocks; 1 layer, 1 head of 8 fp16 values a token, K then
// V); returns its bytes.
inline std::vector<std::byte> branch_publish(kvrelay_client* client, std::uint64_t model_id,
                                             const std::vector<std::uint32_t>& ids) {
  const kvrelay_layout layout{1, 1, 8, KVRELAY_DTYPE_FP16, ids.size()};
  std::vector<std::byte> bytes(ids.size() * 2 * kBranchRowBytes);
  std::uint64_t state = 0x9E3779B97F4A7C15ULL;
  for (auto& byte : bytes) {
    state = state * 6364136223846793005ULL + 1442695040888963407ULL;
    byte = static_cast<std::byte>(state >> 56);
  }
  kvrelay_region* region = nullptr;
  REQUIRE(kvrelay_region_alloc(client, bytes.size(), &region) == KVRELAY_OK);
  std::memcpy(kvrelay_region_data(region), bytes.data(), bytes.size());
  kvrelay_publish_request request{};
  request.struct_size = sizeof(request);
  request.block_tokens = kBranchBlockTokens;
  request.model_id = model_id;
  request.root = KVRELAY_ROOT_BLOCK_HASH;
  request.tokens = ids.data();
  request.count = ids.size();
  request.prompt_tokens = ids.size();
  const int committed = kvrelay_region_commit_request(client, region, &request, &layout);
  INFO(kvrelay_last_error(client));
  REQUIRE(committed == KVRELAY_OK);
  return bytes;
}

// The KV of the first `tokens` of `total` tokens: K's rows, then V's.
inline std::vector<std::byte> branch_head(const std::vector<std::byte>& kv, std::uint64_t total, std::uint64_t tokens) {
  const auto k = kv.begin();
  const auto v = kv.begin() + static_cast<std::ptrdiff_t>(total * kBranchRowBytes);
  std::vector<std::byte> head(k, k + static_cast<std::ptrdiff_t>(tokens * kBranchRowBytes));
  head.insert(head.end(), v, v + static_cast<std::ptrdiff_t>(tokens * kBranchRowBytes));
  return head;
}

inline std::vector<std::byte> branch_entry_bytes(const kvrelay_entry* entry) {
  const auto* data = static_cast<const std::byte*>(kvrelay_entry_data(entry));
  return {data, data + kvrelay_entry_size(entry)};
}

inline kvrelay_resolve_request branch_resolve_request(std::uint64_t model_id, const std::vector<std::uint32_t>& ids,
                                                      std::uint32_t flags) {
  kvrelay_resolve_request request{};
  request.struct_size = sizeof(request);
  request.block_tokens = kBranchBlockTokens;
  request.model_id = model_id;
  request.root = KVRELAY_ROOT_BLOCK_HASH;
  request.tokens = ids.data();
  request.count = ids.size();
  request.flags = flags;
  return request;
}

inline void check_branch_resolves_shared_blocks(const std::string& socket_path, std::uint64_t model_id) {
  kvrelay_client* writer = branch_connect(socket_path);
  const auto published_ids = branch_ids(4 * kBranchBlockTokens, 4 * kBranchBlockTokens, 1);
  const auto kv = branch_publish(writer, model_id, published_ids);
  // 70 tokens: the first 2 blocks shared, then another question.
  const auto branch = branch_ids(70, 2 * kBranchBlockTokens, 2);
  REQUIRE(branch[2 * kBranchBlockTokens] != published_ids[2 * kBranchBlockTokens]);
  const auto expected = branch_head(kv, 4 * kBranchBlockTokens, 2 * kBranchBlockTokens);

  kvrelay_client* scheduler = branch_connect(socket_path);
  kvrelay_client* worker = branch_connect(socket_path);
  {  // The scheduler reserves, the worker claims from its own connection.
    const auto request = branch_resolve_request(model_id, branch, KVRELAY_RESOLVE_RESERVE);
    kvrelay_resolved resolved{};
    resolved.struct_size = sizeof(resolved);
    const int answered = kvrelay_resolve(scheduler, &request, &resolved, nullptr);
    INFO(kvrelay_last_error(scheduler));
    REQUIRE(answered == KVRELAY_OK);
    CHECK(resolved.tokens == 2 * kBranchBlockTokens);
    CHECK(std::string(resolved.medium) == "kv_raw");
    CHECK(resolved.fidelity.lossy == 0);
    REQUIRE(resolved.reservation != 0);
    kvrelay_resolved claimed{};
    claimed.struct_size = sizeof(claimed);
    kvrelay_entry* entry = nullptr;
    REQUIRE(kvrelay_claim(worker, resolved.reservation, 0, &claimed, &entry) == KVRELAY_OK);
    CHECK(claimed.tokens == 2 * kBranchBlockTokens);
    kvrelay_layout layout{};
    kvrelay_entry_layout(entry, &layout);
    CHECK(layout.tokens == 2 * kBranchBlockTokens);
    CHECK(branch_entry_bytes(entry) == expected);
    kvrelay_entry_release(entry);
  }
  {  // Without a reservation the entry is mapped at once: the same 2 blocks.
    const auto request = branch_resolve_request(model_id, branch, 0);
    kvrelay_resolved resolved{};
    resolved.struct_size = sizeof(resolved);
    kvrelay_entry* entry = nullptr;
    REQUIRE(kvrelay_resolve(worker, &request, &resolved, &entry) == KVRELAY_OK);
    CHECK(resolved.tokens == 2 * kBranchBlockTokens);
    CHECK(branch_entry_bytes(entry) == expected);
    kvrelay_entry_release(entry);
  }
  {  // The published prompt itself, and one token more: the whole entry, as before.
    auto longer = published_ids;
    longer.push_back(5);
    const auto request = branch_resolve_request(model_id, longer, 0);
    kvrelay_resolved resolved{};
    resolved.struct_size = sizeof(resolved);
    kvrelay_entry* entry = nullptr;
    REQUIRE(kvrelay_resolve(worker, &request, &resolved, &entry) == KVRELAY_OK);
    CHECK(resolved.tokens == 4 * kBranchBlockTokens);
    CHECK(branch_entry_bytes(entry) == kv);
    kvrelay_entry_release(entry);
  }
  {  // A prompt that shares less than a block finds nothing.
    const auto other = branch_ids(70, 8, 3);
    const auto request = branch_resolve_request(model_id, other, 0);
    kvrelay_resolved resolved{};
    resolved.struct_size = sizeof(resolved);
    kvrelay_entry* entry = nullptr;
    CHECK(kvrelay_resolve(worker, &request, &resolved, &entry) == KVRELAY_E_NOT_FOUND);
    CHECK(entry == nullptr);
  }
  kvrelay_client_close(worker);
  kvrelay_client_close(scheduler);
  kvrelay_client_close(writer);
}

}  // namespace kvrelay::test
