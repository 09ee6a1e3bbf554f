#pragma once

// Shared pieces of the broker stage tests: a one-node policy with one peer, a tiny KV layout
// (one layer, one head, four dims, fp32), entries filed under block hashes, and a fixed engine.

#include <cstddef>
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "kvrelay/broker/engine_advisor.h"
#include "kvrelay/core/policy.h"
#include "kvrelay/kv_store/entry.h"
#include "kvrelay/kv_store/entry_chain.h"
#include "kvrelay/kv_store/entry_store.h"
#include "kvrelay/shm_transport/control_protocol.h"

namespace kvrelay::broker::stage_testing {

inline constexpr std::uint32_t kBlockTokens = 16;

inline std::string one_peer_policy(const std::string& route_extra = "") {
  const std::string model =
      R"("model": {"architecture": "llama", "layers": 1, "kv_heads": 1, "head_dim": 4, "dtype": "fp32", "weights": "w"})";
  return R"({"schema_version": 1, "node": {"id": "node-a"}, "listen": {"http": "127.0.0.1:0"},
    "peers": [{"id": "node-b", "address": "127.0.0.1:7071"}],
    "agents": [{"id": "planner", "upstream": "http://127.0.0.1:9000", )" +
         model + R"(},
               {"id": "coder", "upstream": "http://127.0.0.1:9001", )" +
         model + R"(},
               {"id": "reviewer", "upstream": "http://127.0.0.1:9002", "node": "node-b", )" +
         model + R"(}],
    "routes": [{"id": "plan-code", "from": "planner", "to": "coder")" +
         route_extra + "}]}";
}

inline Policy parsed_policy(const std::string& route_extra = "") {
  auto policy = parse_policy(one_peer_policy(route_extra), "stage_test.json");
  if (!policy) throw std::runtime_error(policy.error().to_string());  // test setup only
  return std::move(policy).value();
}

inline KvLayout tiny_layout(std::uint64_t tokens) {
  return KvLayout{1, 1, 4, DType::kFloat32, tokens};
}

// KV whose every float is its token index plus `offset`, so slices and joins can be checked.
inline std::vector<float> tiny_kv(std::uint64_t tokens, float offset = 0.0F) {
  std::vector<float> kv;
  for (int half = 0; half < 2; ++half) {  // K then V
    for (std::uint64_t token = 0; token < tokens; ++token) {
      for (int dim = 0; dim < 4; ++dim)
        kv.push_back(static_cast<float>(token) + offset);
    }
  }
  return kv;
}

inline std::shared_ptr<const kv_store::StoredEntry> tiny_entry(std::uint64_t tokens, Fidelity fidelity = {}) {
  const auto kv = tiny_kv(tokens);
  auto made = kv_store::make_stored_entry(tiny_layout(tokens), std::as_bytes(std::span(kv)));
  if (!made) throw std::runtime_error(made.error().to_string());
  made.value()->fidelity = std::move(fidelity);
  return made.value();
}

// The token ids of a prompt of `blocks` blocks, and their chain (hashed as model 7's).
inline constexpr std::uint64_t kChainModel = 7;
inline kv_store::EntryChain stage_chain(std::size_t blocks) {
  kv_store::EntryChain chain;
  chain.block_tokens = kBlockTokens;
  for (std::size_t token = 0; token < blocks * kBlockTokens; ++token)
    chain.tokens.push_back(static_cast<TokenId>(1000 + token));
  return chain;
}
inline std::vector<std::uint64_t> chain_of(std::size_t blocks) {
  return kv_store::chain_keys(kChainModel, stage_chain(blocks), kv_store::ChainScope::kUnscoped);
}

inline shm::ResolveRequest lookup_of(std::uint64_t model_id, std::size_t blocks, std::uint64_t prompt_tokens,
                                     std::string params = "") {
  return shm::ResolveRequest{model_id,         kBlockTokens,      prompt_tokens,
                             chain_of(blocks), std::move(params), shm::kDataPlaneVersion};
}

// An engine that always advises `medium` and counts how it was asked.
class FixedEngine final : public EngineAdvisor {
 public:
  explicit FixedEngine(std::string medium) : medium_(std::move(medium)) {}
  std::optional<EngineAdvice> advise(const Policy&, const RoutePolicy&, decision::TransferShape shape, bool commit,
                                     nlohmann::json& cost) override {
    last_shape = shape;
    commits += commit ? 1 : 0;
    ++calls;
    cost = {{"fixed", medium_}};
    if (medium_.empty()) return std::nullopt;
    return EngineAdvice{medium_, "fixed"};
  }
  decision::TransferShape last_shape;
  int calls = 0;
  int commits = 0;

 private:
  std::string medium_;
};

}  // namespace kvrelay::broker::stage_testing
