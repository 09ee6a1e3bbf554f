#pragma once

// A chain of agents a1 -> a2 -> ... whose prompts grow by kStepBlocks blocks a hop, played by the
// tests' shm clients (precision refresh on one daemon and across two): names, token ids, the KV
// each agent's worker computed, and reading back what a lookup served and recorded.

#include <catch2/catch.hpp>
#include <nlohmann/json.hpp>

#include <cmath>
#include <cstdint>
#include <string>
#include <vector>

#include "kvrelay/core/block_hash.h"
#include "kvrelay/core/kv_layout.h"
#include "kvrelay/shm_transport/client.h"

#include "support/kv_path_fixture.h"

namespace kvrelay::test {

inline constexpr std::uint32_t kHopBlockTokens = 16;
// Each agent's prompt adds 12 blocks: more than the int8 codec keeps exact (its first 4 and last
// 128 tokens), so int8 KV of a1's prompt differs from a1's bytes.
inline constexpr std::uint32_t kStepBlocks = 12;
inline constexpr std::uint64_t kPromptStep = std::uint64_t{kStepBlocks} * kHopBlockTokens;

inline std::string agent_name(int index) {
  return "a" + std::to_string(index);
}
inline std::string route_into(int index) {
  return agent_name(index - 1) + "-" + agent_name(index);
}

// One conversation's token ids; agent i's prompt is its first i * kPromptStep.
inline std::vector<TokenId> conversation_ids(std::uint64_t count) {
  std::vector<TokenId> ids(count);
  for (std::uint64_t index = 0; index < count; ++index)
    ids[index] = static_cast<TokenId>(3 + (index * 37 + 11) % 500);
  return ids;
}

// KV a worker computed: distinct, int8-unfriendly floats per agent (so int8 cannot round-trip them).
inline std::vector<float> worker_kv(const KvLayout& layout, int agent) {
  std::vector<float> kv(layout.total_bytes().value() / sizeof(float));
  for (std::size_t index = 0; index < kv.size(); ++index)
    kv[index] = std::sin(0.37F * static_cast<float>(index) + static_cast<float>(agent)) * 3.1F;
  return kv;
}

inline std::vector<std::byte> entry_bytes(const shm::ReadOnlyEntry& entry) {
  std::vector<std::byte> bytes(entry.info.bytes);
  REQUIRE(entry.read(0, bytes).has_value());
  return bytes;
}

// The newest lookup record of `request_id` on `sidecar`.
inline nlohmann::json lookup_of(const Sidecar& sidecar, const std::string& request_id) {
  const nlohmann::json records = sidecar.decisions(64);
  for (const auto& record : records) {
    if (record.value("kind", "") == "lookup" && record.value("request_id", "") == request_id) return record;
  }
  FAIL("no lookup record for " << request_id << " on " << sidecar.node_id());
  return nlohmann::json();
}

}  // namespace kvrelay::test
