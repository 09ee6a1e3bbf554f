// Property: a lookup that chose a lossless medium gets exact KV, whatever lossy traffic came
// before it. Three reference workers on stories260K, each behind its own sidecar, peered over
// loopback TCP in a ring of push routes; a seeded sequence of handoffs forces lossy and lossless
// media independently on each side of a route, so lossy KV is pushed, imported and republished.
//
// The reference for a run of tokens is the bytes an exact publish stored for them (read back
// from the publisher's own sidecar), not a fresh prefill: decode-time and prefill-time KV differ
// in the last bits. A chain may join blocks of two exact publishes, so each served block must
// equal that block of some exact publish of the same tokens; a lossy block equals none.
#include <catch2/catch.hpp>
#include <nlohmann/json.hpp>

#include <cstring>
#include <map>
#include <random>

#include "kvrelay/core/block_hash.h"
#include "kvrelay/core/model_fingerprint.h"
#include "kvrelay/shm_transport/client.h"

#include "support/kv_path_fixture.h"
#include "support/skip.h"

using namespace kvrelay::test;
using nlohmann::json;

namespace {

constexpr std::uint32_t kBlockTokens = 16;
constexpr std::size_t kNodes = 3;
constexpr const char* kMedia[] = {"kv_raw", "kv_lossless", "kv_int8", "kv_int4"};

bool lossless(const std::string& medium) {
  return medium == "kv_raw" || medium == "kv_lossless" || medium == "tokens";
}

std::string agent(std::size_t node) {
  return "w" + std::to_string(node);
}
// The ring: w0 -> w1 -> w2 -> w0, every route pushing on publish.
std::string route_into(std::size_t node) {
  return agent((node + kNodes - 1) % kNodes) + "-" + agent(node);
}

std::vector<kvrelay::TokenId> token_ids(const json& tokens) {
  return tokens.get<std::vector<kvrelay::TokenId>>();
}

// Every exact publish seen so far: its tokens and its KV (fp32, tensor-major: each layer's K,
// then V, token by token).
class ExactPublishes {
 public:
  explicit ExactPublishes(std::uint64_t row_floats) : row_(row_floats) {}

  void add(std::vector<kvrelay::TokenId> tokens, std::vector<float> kv) {
    publishes_.push_back({std::move(tokens), std::move(kv)});
  }
  // How many of the leading `blocks` blocks of `kv` (for `tokens`) equal that block of some
  // exact publish of the same tokens; a mismatch is reported through INFO/CHECK by the caller.
  [[nodiscard]] std::size_t matching_blocks(const std::vector<kvrelay::TokenId>& tokens, std::span<const float> kv,
                                            std::uint64_t kv_tokens, std::size_t blocks) const {
    std::size_t matched = 0;
    for (std::size_t block = 0; block < blocks; ++block) {
      const std::size_t end = (block + 1) * kBlockTokens;
      for (const auto& publish : publishes_) {
        if (publish.tokens.size() < end ||
            !std::equal(tokens.begin(), tokens.begin() + static_cast<std::ptrdiff_t>(end), publish.tokens.begin()))
          continue;
        if (same_block(kv, kv_tokens, publish.kv, publish.tokens.size(), block)) {
          ++matched;
          break;
        }
      }
    }
    return matched;
  }
  [[nodiscard]] std::size_t size() const { return publishes_.size(); }

 private:
  struct Publish {
    std::vector<kvrelay::TokenId> tokens;
    std::vector<float> kv;
  };
  [[nodiscard]] bool same_block(std::span<const float> left, std::uint64_t left_tokens, std::span<const float> right,
                                std::uint64_t right_tokens, std::size_t block) const {
    const std::uint64_t tensors = left.size() / (left_tokens * row_);
    const std::uint64_t first = block * kBlockTokens * row_;
    const std::uint64_t count = kBlockTokens * row_;
    for (std::uint64_t tensor = 0; tensor < tensors; ++tensor) {
      const float* a = left.data() + tensor * left_tokens * row_ + first;
      const float* b = right.data() + tensor * right_tokens * row_ + first;
      if (std::memcmp(a, b, count * sizeof(float)) != 0) return false;
    }
    return true;
  }
  std::uint64_t row_;
  std::vector<Publish> publishes_;
};

std::vector<float> entry_floats(const kvrelay::shm::ReadOnlyEntry& entry) {
  std::vector<float> kv(entry.info.bytes / sizeof(float));
  REQUIRE(entry.read(0, std::as_writable_bytes(std::span(kv))).has_value());
  return kv;
}

// The latest lookup record of a sidecar's decision log.
json last_lookup(const Sidecar& sidecar) {
  for (const auto& record : sidecar.decisions(8)) {
    if (record.value("kind", "") == "lookup") return record;
  }
  return json();
}

struct Ring {
  explicit Ring(const std::filesystem::path& model) {
    for (std::size_t node = 0; node < kNodes; ++node)
      sidecars.push_back(std::make_unique<Sidecar>("n" + std::to_string(node)));
    for (std::size_t node = 0; node < kNodes; ++node) {
      workers.push_back(std::make_unique<RefworkerUnderTest>(
          std::vector<std::string>{"--model", model.string()},
          std::vector<std::string>{"--kvrelay-socket", sidecars[node]->socket_path()}));
    }
  }
  [[nodiscard]] json policy(std::size_t node, const std::vector<std::uint16_t>& peer_ports) const {
    json agents = json::array();
    json peers = json::array();
    json routes = json::array();
    for (std::size_t other = 0; other < kNodes; ++other) {
      const bool here = other == node;
      agents.push_back(agent_json(agent(other), here ? "" : sidecars[other]->node_id(),
                                  here ? workers[other]->port() : 1, stories_model_json()));
      if (!here) {
        peers.push_back(
            {{"id", sidecars[other]->node_id()}, {"address", "127.0.0.1:" + std::to_string(peer_ports[other])}});
      }
      routes.push_back({{"id", route_into(other)},
                        {"from", agent((other + kNodes - 1) % kNodes)},
                        {"to", agent(other)},
                        {"push", true}});
    }
    return sidecar_policy(*sidecars[node], agents, routes, peers);
  }
  void start() {
    std::vector<std::uint16_t> placeholder(kNodes, 1);
    for (std::size_t node = 0; node < kNodes; ++node)
      sidecars[node]->start(policy(node, placeholder));
    std::vector<std::uint16_t> ports;
    for (const auto& sidecar : sidecars)
      ports.push_back(sidecar->peer_port());
    for (std::size_t node = 0; node < kNodes; ++node)
      sidecars[node]->reload(policy(node, ports));
  }
  std::vector<std::unique_ptr<Sidecar>> sidecars;
  std::vector<std::unique_ptr<RefworkerUnderTest>> workers;
};

}  // namespace

TEST_CASE("lossless_lookups_never_serve_lossy_kv", "[proxy][kv_path][fidelity][e2e][process]") {
  const auto model = stories_model_path();
  if (!model) KVRELAY_SKIP("stories260K.bin not found");
  Ring ring(*model);
  ring.start();

  const auto models = http_request(ring.workers[0]->port(), "GET", "/v1/models");
  REQUIRE(models.status == 200);
  const auto fingerprint = json::parse(models.body)["data"][0]["kvrelay"];
  const std::uint64_t model_id = std::stoull(fingerprint["fingerprint_id"].get<std::string>(), nullptr, 16);
  const std::uint64_t row = fingerprint["kv_heads"].get<std::uint64_t>() * fingerprint["head_dim"].get<std::uint64_t>();
  ExactPublishes exact(row);

  std::vector<kvrelay::shm::ShmClient> clients;
  for (const auto& sidecar : ring.sidecars) {
    auto client = kvrelay::shm::ShmClient::connect(sidecar->socket_path());
    REQUIRE(client.has_value());
    clients.push_back(std::move(client).value());
  }
  for (std::size_t node = 0; node < kNodes; ++node) {
    for (std::size_t other = 0; other < kNodes; ++other)
      ring.sidecars[node]->force_medium(route_into(other), "kv_raw");
  }

  std::mt19937 rng(23);
  std::vector<json> conversations;
  for (int seed = 1; seed <= 3; ++seed)
    conversations.push_back(context_prompt(seed, 180));  // lossy codecs keep only the first 4 and last 128 exact
  std::size_t checked_lookups = 0;
  std::size_t checked_blocks = 0;
  std::size_t lossy_imports = 0;

  // Checks the blocks a lossless import (or lookup) delivered, then files an exact publish.
  const auto check_blocks = [&](const std::vector<kvrelay::TokenId>& tokens, const std::vector<float>& kv,
                                std::uint64_t kv_tokens, std::size_t blocks, const std::string& what) {
    if (blocks == 0) return;
    INFO(what << ": " << blocks << " blocks served by a lossless medium");
    CHECK(exact.matching_blocks(tokens, kv, kv_tokens, blocks) == blocks);
    ++checked_lookups;
    checked_blocks += blocks;
  };
  // One request through node `node`'s front proxy; an exact publish is read back as a reference.
  const auto answer = [&](std::size_t node, json prompt, const std::string& step) {
    Sidecar& sidecar = *ring.sidecars[node];
    const auto reply = sidecar.complete(agent(node), greedy(prompt, 8, true));
    const auto lookup = last_lookup(sidecar);
    const std::uint64_t cached = reply["kvrelay"]["cached_tokens"].get<std::uint64_t>();
    const std::string medium = cached == 0 ? "tokens" : lookup.value("medium", "");
    if (!lossless(medium)) ++lossy_imports;
    for (const auto& id : reply["choices"][0]["token_ids"])
      prompt.push_back(id);
    const std::uint64_t published = reply["kvrelay"]["published_tokens"].get<std::uint64_t>();
    REQUIRE(published <= prompt.size());
    const json context(prompt.begin(), prompt.begin() + static_cast<std::ptrdiff_t>(published));
    const auto tokens = token_ids(context);
    const auto hashes = kvrelay::hash_blocks(model_id, tokens, kBlockTokens);
    if (lossless(medium) && !hashes.empty()) {
      auto stored = clients[node].lookup({model_id, hashes.back()});
      REQUIRE(stored.has_value());
      const auto kv = entry_floats(stored.value());
      const std::uint64_t kv_tokens = stored.value().info.layout.tokens;
      check_blocks(tokens, kv, kv_tokens, cached / kBlockTokens, step + " import on " + agent(node));
      exact.add(std::vector<kvrelay::TokenId>(tokens.begin(), tokens.begin() + static_cast<std::ptrdiff_t>(kv_tokens)),
                kv);
    }
    return context;
  };
  const auto follow_up = [&](json prompt) {
    for (int index = 0; index < 3; ++index)
      prompt.push_back(3 + static_cast<int>(rng() % 490));
    return prompt;
  };

  for (int step = 0; step < 14; ++step) {
    const std::size_t conversation = rng() % conversations.size();
    // stories260K's context is 512 tokens: a long conversation starts over.
    if (conversations[conversation].size() > 400) conversations[conversation] = context_prompt(10 + step, 180);
    const std::size_t from = rng() % kNodes;
    const std::size_t to = (from + 1) % kNodes;
    const std::string route = route_into(to);
    const std::string push_medium = kMedia[rng() % 4];
    const std::string lookup_medium = kMedia[rng() % 4];
    const std::string label =
        "step " + std::to_string(step) + " (" + route + ", push " + push_medium + ", lookup " + lookup_medium + ")";
    INFO(label);
    ring.sidecars[from]->force_medium(route, push_medium);
    ring.sidecars[to]->force_medium(route, lookup_medium);

    // A answers; its publish is pushed to B with push_medium (waited for, so B's lookup sees it).
    const double pushes_before =
        ring.sidecars[from]->metric_sum("kvrelay_kv_pushes_total", {"route=\"" + route + "\""});
    auto context = answer(from, follow_up(conversations[conversation]), label);
    wait_until(
        [&] {
          return ring.sidecars[from]->metric_sum("kvrelay_kv_pushes_total", {"route=\"" + route + "\""}) >
                 pushes_before;
        },
        std::chrono::seconds(10));
    // B takes the handoff with lookup_medium and publishes what it computed over that import.
    conversations[conversation] = answer(to, follow_up(context), label);

    // And a lookup of our own on a random node, through the real data plane, with a lossless
    // medium forced on the route into that node.
    const std::size_t node = rng() % kNodes;
    const std::string medium = kMedia[rng() % 2];
    ring.sidecars[node]->force_medium(route_into(node), medium);
    const auto probe = token_ids(follow_up(conversations[rng() % conversations.size()]));
    kvrelay::shm::ResolveRequest request;
    request.model_id = model_id;
    request.block_tokens = kBlockTokens;
    request.prompt_tokens = probe.size();
    const auto hashes = kvrelay::hash_blocks(model_id, probe, kBlockTokens);
    request.block_hashes.assign(hashes.begin(), hashes.end());
    request.params_json = json{{"agent", agent(node)}, {"route", route_into(node)}}.dump();
    auto resolved = clients[node].resolve(request);
    if (resolved) {
      CHECK(resolved.value().meta.medium == medium);
      CHECK(resolved.value().meta.fidelity.is_exact());
      const auto kv = entry_floats(resolved.value().entry);
      check_blocks(probe, kv, resolved.value().entry.info.layout.tokens, resolved.value().meta.blocks,
                   label + " probe on n" + std::to_string(node) + " with " + medium);
    } else {
      CHECK(resolved.error().code == kvrelay::ErrorCode::kNotFound);
    }
  }
  // The sequence did what it is for: lossy imports happened, and lossless ones were checked.
  CHECK(lossy_imports >= 3);
  CHECK(checked_lookups >= 8);
  CHECK(checked_blocks >= 40);
}

TEST_CASE("a worker client older than data-plane version 4 is never served lossy KV",
          "[proxy][kv_path][fidelity][process]") {
  // One sidecar, two agents on it (no workers needed: the test's clients are the workers).
  Sidecar sidecar("n0");
  const json agents = json::array(
      {agent_json("writer", "", 1, stories_model_json()), agent_json("reader", "", 1, stories_model_json())});
  const json routes = json::array({{{"id", "writer-to-reader"}, {"from", "writer"}, {"to", "reader"}}});
  sidecar.start(sidecar_policy(sidecar, agents, routes));
  const kvrelay::ModelFingerprint model{"llama", 5, 4, 8, kvrelay::DType::kFloat32, "stories260K"};
  std::vector<kvrelay::TokenId> tokens(40);
  for (std::size_t index = 0; index < tokens.size(); ++index)
    tokens[index] = static_cast<kvrelay::TokenId>(3 + index);
  const auto hashes = kvrelay::hash_blocks(model.id(), tokens, kBlockTokens);  // 2 full blocks
  const auto layout = model.layout(32);
  std::vector<float> kv(layout.total_bytes().value() / sizeof(float), 0.25F);
  auto writer = kvrelay::shm::ShmClient::connect(sidecar.socket_path());
  REQUIRE(writer.has_value());
  REQUIRE(writer.value()
              .publish_with_context({model.id(), hashes.back()}, layout, std::as_bytes(std::span(kv)),
                                    json{{"agent", "writer"}}.dump())
              .has_value());

  kvrelay::shm::ResolveRequest request;
  request.model_id = model.id();
  request.block_tokens = kBlockTokens;
  request.prompt_tokens = tokens.size();
  request.block_hashes.assign(hashes.begin(), hashes.end());
  request.params_json = json{{"agent", "reader"}, {"route", "writer-to-reader"}}.dump();
  sidecar.force_medium("writer-to-reader", "kv_int8");
  auto old_reader = kvrelay::shm::ShmClient::connect(sidecar.socket_path(), 3);
  REQUIRE(old_reader.has_value());
  const auto refused = old_reader.value().resolve(request);
  REQUIRE_FALSE(refused.has_value());
  CHECK(refused.error().code == kvrelay::ErrorCode::kNotFound);
  CHECK_THAT(refused.error().message, Catch::Contains("data-plane version 3"));
  CHECK(last_lookup(sidecar)["outcome"] == "tokens");
  // A current client gets the int8 copy, and is told so.
  auto reader = kvrelay::shm::ShmClient::connect(sidecar.socket_path());
  REQUIRE(reader.has_value());
  const auto lossy = reader.value().resolve(request);
  REQUIRE(lossy.has_value());
  CHECK(lossy.value().meta.medium == "kv_int8");
  CHECK(lossy.value().meta.fidelity == kvrelay::Fidelity::lossy("int8"));
  // Exact KV still reaches the old client.
  sidecar.force_medium("writer-to-reader", "kv_raw");
  const auto exact = old_reader.value().resolve(request);
  REQUIRE(exact.has_value());
  CHECK(exact.value().meta.blocks == 2);
}
