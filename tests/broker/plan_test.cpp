// The plan stage on its own: a store, a policy and a fixed engine in, a plan out, no I/O.

#include "plan.h"

#include <catch2/catch.hpp>

#include <cmath>
#include <memory>

#include "kvrelay/codec_plugins/registry.h"

#include "precision.h"
#include "stage_fixture.h"

using namespace kvrelay;
using namespace kvrelay::broker;
using namespace kvrelay::broker::stage_testing;

namespace {

struct PlanBench {
  explicit PlanBench(const std::string& route_extra = "", std::string engine_medium = "kv_raw")
      : policy(parsed_policy(route_extra)), engine(std::move(engine_medium)) {}
  std::uint64_t model_id() const { return policy.agents[0].model.id(); }
  LookupPlan plan(const shm::ResolveRequest& request) {
    auto parsed = parse_request_context(request.params_json);
    REQUIRE(parsed);
    context = parsed.value();
    PlanInputs inputs{policy, request, context, store, codecs, engine};
    inputs.longest_elsewhere = [this] { return elsewhere; };
    return plan_lookup(inputs, servable_blocks(request, context));
  }
  // What peers' summaries say they hold of the lookup's chain: blocks and product.
  std::optional<std::pair<std::size_t, double>> elsewhere;
  Policy policy;
  FixedEngine engine;
  kv_store::InMemoryEntryStore store{1 << 20};
  codec::CodecRegistry codecs = codec::CodecRegistry::with_builtins();
  RequestContext context;
};

constexpr const char* kToCoder = R"({"agent": "coder", "request_id": "r1"})";

}  // namespace

TEST_CASE("plan: the longest exact held prefix is served, and only the blocks the prompt allows", "[broker][plan]") {
  PlanBench bench;
  REQUIRE(bench.store.put({bench.model_id(), chain_of(4)[1]}, tiny_entry(2 * kBlockTokens)));
  REQUIRE(bench.store.put({bench.model_id(), chain_of(4)[2]}, tiny_entry(3 * kBlockTokens)));
  // 3 blocks held, but a 40-token prompt may take only 2 (its last token is prefilled).
  const auto plan = bench.plan(lookup_of(bench.model_id(), 3, 40, kToCoder));
  REQUIRE_FALSE(plan.stop);
  CHECK(plan.route != nullptr);
  CHECK(plan.choice.medium == "kv_raw");
  CHECK(plan.choice.source == "engine");
  CHECK(plan.held.blocks == 3);
  CHECK(plan.max_blocks == 2);
  CHECK(plan.codec == "raw");
  CHECK(plan.lossless);
  CHECK_FALSE(plan.ask_peers);  // held covers what may be served
  CHECK(bench.engine.last_shape.receiver_cached == 2 * kBlockTokens);
  CHECK(bench.engine.commits == 1);
}

TEST_CASE("plan: a longer entry holding the prompt's first blocks is the held prefix", "[broker][plan][prefix_index]") {
  PlanBench bench;
  // A 4-block entry with its token ids, filed under its last block (chains hash as kChainModel's).
  const auto chain = stage_chain(4);
  const auto kv = tiny_kv(4 * kBlockTokens);
  auto made = kv_store::make_stored_entry(tiny_layout(4 * kBlockTokens), std::as_bytes(std::span(kv)));
  REQUIRE(made);
  made.value()->chain = std::make_shared<const kv_store::EntryChain>(chain);
  const std::shared_ptr<const kv_store::StoredEntry> longer = made.value();
  REQUIRE(bench.store.put({kChainModel, chain_of(4)[3]}, longer));
  // A prompt that shares its first 2 blocks, then asks something else.
  auto branch = stage_chain(5);
  for (std::size_t token = 2 * kBlockTokens; token < branch.tokens.size(); ++token)
    branch.tokens[token] += 5000;
  auto request = lookup_of(kChainModel, 5, 5 * kBlockTokens + 3, kToCoder);
  request.block_hashes = kv_store::chain_keys(kChainModel, branch, kv_store::ChainScope::kUnscoped);
  const auto plan = bench.plan(request);
  REQUIRE_FALSE(plan.stop);
  CHECK(plan.held.blocks == 2);
  CHECK(plan.held.entry == longer);
  CHECK(plan.choice.medium == "kv_raw");
  CHECK(bench.engine.last_shape.receiver_cached == 2 * kBlockTokens);  // priced for what is held
  CHECK(plan.ask_peers);                                               // blocks 3 to 5 may still come from the peer
}

TEST_CASE("plan: a treatment decides the medium, and span none is a tokens stop", "[broker][plan]") {
  PlanBench bench;
  const auto tokens =
      bench.plan(lookup_of(bench.model_id(), 3, 60,
                           R"({"agent": "coder", "treatment": {"name": "T0", "medium": "tokens", "span": "none"}})"));
  REQUIRE(tokens.stop);
  CHECK(tokens.stop->outcome == "tokens");
  CHECK(tokens.choice.source == "treatment");
  CHECK(bench.engine.commits == 0);  // priced, not decided
  CHECK(bench.engine.calls == 1);

  const auto int8 =
      bench.plan(lookup_of(bench.model_id(), 3, 60,
                           R"({"agent": "coder", "treatment": {"name": "T3", "medium": "kv_int8", "span": "all"}})"));
  CHECK(int8.choice.medium == "kv_int8");
  CHECK(int8.codec == "int8");
  CHECK_FALSE(int8.lossless);
  CHECK_FALSE(int8.stop);
  CHECK(int8.ask_peers);  // nothing held here: the peer may hold it
}

TEST_CASE("plan: a lossy held prefix serves only a lookup with the same codec", "[broker][plan]") {
  PlanBench bench("", "kv_int8");
  REQUIRE(bench.store.put({bench.model_id(), chain_of(4)[0]}, tiny_entry(kBlockTokens)));
  REQUIRE(bench.store.put({bench.model_id(), chain_of(4)[2]}, tiny_entry(3 * kBlockTokens, Fidelity::lossy("int8"))));
  const auto same = bench.plan(lookup_of(bench.model_id(), 4, 70, kToCoder));
  CHECK(same.held.blocks == 3);
  CHECK(same.held_already_encoded);

  PlanBench other("", "kv_int4");
  REQUIRE(other.store.put({other.model_id(), chain_of(4)[0]}, tiny_entry(kBlockTokens)));
  REQUIRE(other.store.put({other.model_id(), chain_of(4)[2]}, tiny_entry(3 * kBlockTokens, Fidelity::lossy("int8"))));
  const auto different = other.plan(lookup_of(other.model_id(), 4, 70, kToCoder));
  CHECK(different.held.blocks == 1);
  CHECK_FALSE(different.held_already_encoded);
}

TEST_CASE("plan: what asks peers, and what stops", "[broker][plan]") {
  PlanBench bench;
  // Nothing held, a route and a peer: ask.
  const auto empty = bench.plan(lookup_of(bench.model_id(), 4, 70, kToCoder));
  CHECK_FALSE(empty.stop);
  CHECK(empty.ask_peers);
  // Three of four blocks held: the peer would add too little for the join.
  REQUIRE(bench.store.put({bench.model_id(), chain_of(4)[2]}, tiny_entry(3 * kBlockTokens)));
  const auto mostly = bench.plan(lookup_of(bench.model_id(), 4, 70, kToCoder));
  CHECK_FALSE(mostly.ask_peers);
  CHECK(mostly.held.blocks == 3);
  // No route: served as stored, never fetched.
  const auto routeless = bench.plan(lookup_of(bench.model_id(), 4, 70));
  CHECK(routeless.route == nullptr);
  CHECK(routeless.choice.source == "default");
  CHECK_FALSE(routeless.ask_peers);
  // A prompt of one block serves nothing.
  const auto short_prompt = bench.plan(lookup_of(bench.model_id(), 1, 16, kToCoder));
  REQUIRE(short_prompt.stop);
  CHECK(short_prompt.stop->outcome == "miss");
}

TEST_CASE("plan: routes that cannot move KV fall back to tokens", "[broker][plan]") {
  PlanBench disabled(R"(, "enabled": false)");
  const auto off = disabled.plan(lookup_of(disabled.model_id(), 3, 60, kToCoder));
  REQUIRE(off.stop);
  CHECK(off.choice.medium == "tokens");
  CHECK(off.choice.reason.find("disabled") != std::string::npos);

  PlanBench forced(R"(, "forced_medium": "kv_int4")");
  const auto int4 = forced.plan(lookup_of(forced.model_id(), 3, 60, kToCoder));
  CHECK(int4.choice.source == "forced");
  CHECK(int4.codec == "int4");

  // An old worker cannot carry lossy KV's fidelity: it prefills.
  auto old_client = lookup_of(forced.model_id(), 3, 60, kToCoder);
  old_client.client_version = shm::kFidelityDataPlaneVersion - 1;
  const auto refused = forced.plan(old_client);
  REQUIRE(refused.stop);
  CHECK(refused.stop->outcome == "tokens");
  CHECK(refused.choice.reason.find("data plane") != std::string::npos);
}

TEST_CASE("plan: the engine's tokens still serves the exact held prefix", "[broker][plan]") {
  PlanBench bench("", "tokens");
  REQUIRE(bench.store.put({bench.model_id(), chain_of(4)[1]}, tiny_entry(2 * kBlockTokens)));
  const auto plan = bench.plan(lookup_of(bench.model_id(), 4, 70, kToCoder));
  REQUIRE_FALSE(plan.stop);
  CHECK(plan.choice.serve_held_prefix);
  CHECK(plan.codec == "raw");
  CHECK_FALSE(plan.ask_peers);
}

TEST_CASE("plan: a span prompt that names A's prompt length caps the servable blocks", "[broker][plan]") {
  RequestContext context;
  context.treatment = Treatment{"T1", "kv_raw", KvSpan::kPrompt, std::nullopt};
  const auto request = lookup_of(1, 4, 70);
  CHECK(servable_blocks(request, context) == 4);  // the served entry's boundary cuts it later
  context.treatment->prompt_tokens = 35;
  CHECK(servable_blocks(request, context) == 2);
  context.treatment.reset();
  CHECK(servable_blocks(request, context) == 4);
}

TEST_CASE("plan: fp8 KV is never served through a lossy medium, forced or drawn", "[broker][plan]") {
  const auto fp8_bench = [](const std::string& route_extra) {
    auto bench = std::make_unique<PlanBench>(route_extra);
    for (auto& agent : bench->policy.agents)
      agent.model.dtype = DType::kFp8E4M3;  // an engine with an fp8 kv_cache_dtype
    return bench;
  };
  auto engine_chose = fp8_bench("");
  const auto decided = engine_chose->plan(lookup_of(engine_chose->model_id(), 3, 60, kToCoder));
  REQUIRE(engine_chose->engine.last_shape.dtype == DType::kFp8E4M3);  // the engine is told the KV's dtype
  CHECK(decided.choice.medium == "kv_raw");
  CHECK(decided.choice.reason.find("fp8_e4m3 KV moves as bytes") != std::string::npos);

  auto treated = fp8_bench("");
  const auto drawn = treated->plan(
      lookup_of(treated->model_id(), 3, 60,
                R"({"agent": "coder", "treatment": {"name": "T3", "medium": "kv_int8", "span": "all"}})"));
  CHECK(drawn.choice.medium == "kv_raw");
  CHECK(drawn.choice.reason.find("kv_int8 would convert fp8_e4m3 KV") != std::string::npos);
  CHECK(drawn.codec == "raw");
  CHECK(drawn.lossless);

  auto forced = fp8_bench(R"(, "forced_medium": "kv_int4")");
  const auto held = forced->plan(lookup_of(forced->model_id(), 3, 60, kToCoder));
  CHECK(held.choice.medium == "kv_raw");
  CHECK(held.codec == "raw");

  // The same forced route with fp32 KV keeps its lossy medium.
  PlanBench floats(R"(, "forced_medium": "kv_int4")");
  CHECK(floats.plan(lookup_of(floats.model_id(), 3, 60, kToCoder)).choice.medium == "kv_int4");
}

// Precision refresh (issue #27): int8's factor calibrated to 0.9, a floor of 0.75 on the route.
namespace {

constexpr const char* kFloorRoute = R"(, "quality_floor": 0.75)";
constexpr const char* kForcedInt8 = R"(, "quality_floor": 0.75, "forced_medium": "kv_int8")";

void calibrate_int8(Policy& policy, double fidelity = 0.9) {
  policy.cost_model.media.emplace_back("kv_int8", MediumCostModel{fidelity, std::nullopt});
}

// The chain of the three-hop scenario in one store: the first agent's exact 2 blocks, the second
// agent's int8-fed 4 blocks (product 0.9), the third's 6 (0.81).
struct Chain {
  std::shared_ptr<const kv_store::StoredEntry> exact = tiny_entry(2 * kBlockTokens);
  std::shared_ptr<const kv_store::StoredEntry> hop1 = tiny_entry(4 * kBlockTokens, Fidelity::lossy("int8", 0, 0.9));
  std::shared_ptr<const kv_store::StoredEntry> hop2 = tiny_entry(6 * kBlockTokens, Fidelity::lossy("int8", 0, 0.81));
  void file(PlanBench& bench, bool with_exact = true, bool with_hop2 = true) const {
    if (with_exact) REQUIRE(bench.store.put({bench.model_id(), chain_of(7)[1]}, exact));
    REQUIRE(bench.store.put({bench.model_id(), chain_of(7)[3]}, hop1));
    if (with_hop2) REQUIRE(bench.store.put({bench.model_id(), chain_of(7)[5]}, hop2));
  }
};

}  // namespace

TEST_CASE("precision: factors, effective products and the crossing", "[broker][plan][precision]") {
  Policy policy = parsed_policy(kFloorRoute);
  const auto codecs = codec::CodecRegistry::with_builtins();
  // The catalogue's defaults until the policy calibrates a medium; lossless media are exact.
  CHECK(codec_factor(policy, codecs, "int8") == Approx(0.996));
  CHECK(medium_factor(policy, codecs, "kv_int4") == Approx(0.921));
  CHECK(medium_factor(policy, codecs, "kv_raw") == 1.0);
  CHECK(medium_factor(policy, codecs, "kv_lossless") == 1.0);
  CHECK(medium_factor(policy, codecs, "tokens") == 1.0);
  CHECK(codec_factor(policy, codecs, "lossless") == 1.0);
  calibrate_int8(policy);
  CHECK(codec_factor(policy, codecs, "int8") == 0.9);
  CHECK(codec_factor(policy, codecs, "int8+zstd") == 0.9);  // the zstd stage loses nothing
  CHECK(medium_factor(policy, codecs, "kv_int8") == 0.9);

  // Exact is 1; an unstamped lossy entry is worth its codec's factor; a stamp below it counts.
  CHECK(effective_product(Fidelity::exact(), policy, codecs) == 1.0);
  CHECK(effective_product(Fidelity::lossy("int8"), policy, codecs) == 0.9);
  CHECK(effective_product(Fidelity::lossy("int8", 0, 0.81), policy, codecs) == 0.81);
  CHECK(effective_product(Fidelity::lossy("int8", 0, 0.95), policy, codecs) == 0.9);
  CHECK(effective_product(Fidelity::lossy("int8", 0, std::nan("")), policy, codecs) == 0.9);

  // Floor 0.75, factor 0.9: 1 -> 0.9 and 0.9 -> 0.81 pass, 0.81 -> 0.729 refreshes.
  const RoutePolicy& route = policy.routes[0];
  CHECK_FALSE(needs_refresh(route, 1.0, 0.9));
  CHECK_FALSE(needs_refresh(route, 0.9, 0.9));
  const auto crossing = needs_refresh(route, 0.81, 0.9);
  REQUIRE(crossing);
  CHECK(crossing->chain_product == 0.81);
  CHECK(crossing->factor == 0.9);
  CHECK(crossing->floor == 0.75);
  CHECK(crossing->after() == Approx(0.729));
  CHECK_FALSE(needs_refresh(route, 0.5, 1.0));  // a lossless hop never refreshes
  // Exactly at the floor (up to the rounding of the products) passes.
  RoutePolicy at_floor = route;
  at_floor.quality_floor = 0.81;
  CHECK_FALSE(needs_refresh(at_floor, 0.9, 0.9));
  // No floor, no refresh.
  RoutePolicy no_floor = route;
  no_floor.quality_floor = 0.0;
  CHECK_FALSE(needs_refresh(no_floor, 0.01, 0.5));
  // A peer's answer is stamped after its hop: it may carry down to the floor itself.
  CHECK(min_reply_product(route) == Approx(0.75));
  CHECK(min_reply_product(no_floor) == 0.0);
}

TEST_CASE("precision: a forced lossy medium is served while the product stays above the floor, then refreshed",
          "[broker][plan][precision]") {
  PlanBench bench(kForcedInt8);
  calibrate_int8(bench.policy);
  const Chain chain;
  chain.file(bench, true, false);
  // Hop 2: the best source is the 4-block int8 entry (0.9); 0.9 x 0.9 = 0.81 stays above 0.75.
  const auto second = bench.plan(lookup_of(bench.model_id(), 6, 6 * kBlockTokens, kToCoder));
  REQUIRE_FALSE(second.stop);
  CHECK(second.chain_product == 0.9);
  CHECK(bench.engine.last_shape.chain_fidelity == 0.9);  // the engine is told the chain too
  CHECK(second.choice.medium == "kv_int8");
  CHECK(second.choice.source == "forced");
  CHECK_FALSE(second.choice.refresh);
  CHECK(second.held.entry == chain.hop1);
  CHECK(second.held_already_encoded);
  CHECK(second.min_fidelity_product == Approx(0.75));

  // Hop 3: the best source is the 6-block entry (0.81); 0.81 x 0.9 = 0.729 crosses the floor.
  REQUIRE(bench.store.put({bench.model_id(), chain_of(7)[5]}, chain.hop2));
  const auto third = bench.plan(lookup_of(bench.model_id(), 7, 7 * kBlockTokens + 1, kToCoder));
  REQUIRE_FALSE(third.stop);
  CHECK(third.chain_product == 0.81);
  CHECK(third.choice.medium == "kv_raw");
  CHECK(third.choice.source == "refresh");
  CHECK_THAT(third.choice.reason, Catch::Contains("0.81") && Catch::Contains("0.9") && Catch::Contains("0.75") &&
                                      Catch::Contains("forces kv_int8"));
  REQUIRE(third.choice.refresh);
  CHECK(third.choice.refresh->hop.chain_product == 0.81);
  CHECK(third.choice.refresh->hop.factor == 0.9);
  CHECK(third.choice.refresh->hop.floor == 0.75);
  CHECK(third.choice.refresh->replaced_medium == "kv_int8");
  CHECK(third.choice.refresh->forced == RefreshForced::kLossless);
  CHECK(third.choice.refresh->exact_source);
  // The lossless plan serves exact KV only: the first agent's 2 blocks.
  CHECK(third.lossless);
  CHECK(third.codec == "raw");
  CHECK(third.held.entry == chain.exact);
  CHECK(third.held.blocks == 2);
  CHECK_FALSE(third.held_already_encoded);
}

TEST_CASE("precision: a longer lossy chain on a peer is the one a fetch extends, so its product decides",
          "[broker][plan][precision]") {
  PlanBench bench(kForcedInt8);
  calibrate_int8(bench.policy);
  const Chain chain;
  chain.file(bench, true, false);  // here: the exact 2 blocks and the 4-block int8 entry (0.9)
  // A peer's summary lists a 6-block entry of this chain at 0.81: int8 would make 0.729.
  bench.elsewhere = std::pair{std::size_t{6}, 0.81};
  const auto refreshed = bench.plan(lookup_of(bench.model_id(), 7, 7 * kBlockTokens + 1, kToCoder));
  REQUIRE_FALSE(refreshed.stop);
  CHECK(refreshed.chain_product == 0.81);
  CHECK(refreshed.choice.source == "refresh");
  CHECK(refreshed.choice.medium == "kv_raw");
  CHECK(refreshed.lossless);
  CHECK(refreshed.held.entry == chain.exact);  // the exact prefix here; peers are asked for more
  // A peer's chain no longer than this node's best source changes nothing.
  bench.elsewhere = std::pair{std::size_t{4}, 0.5};
  const auto local = bench.plan(lookup_of(bench.model_id(), 7, 7 * kBlockTokens + 1, kToCoder));
  CHECK(local.chain_product == 0.9);
  CHECK(local.choice.medium == "kv_int8");
  // A longer exact chain elsewhere: nothing crosses the floor.
  bench.elsewhere = std::pair{std::size_t{6}, 1.0};
  CHECK(bench.plan(lookup_of(bench.model_id(), 7, 7 * kBlockTokens + 1, kToCoder)).chain_product == 1.0);
}

TEST_CASE("precision: a treatment's and the engine's lossy media are refreshed too", "[broker][plan][precision]") {
  PlanBench treated(kFloorRoute);
  calibrate_int8(treated.policy);
  Chain().file(treated);
  const auto drawn =
      treated.plan(lookup_of(treated.model_id(), 7, 7 * kBlockTokens + 1,
                             R"({"agent": "coder", "treatment": {"name": "T3", "medium": "kv_int8", "span": "all"}})"));
  CHECK(drawn.choice.medium == "kv_raw");
  CHECK(drawn.choice.source == "refresh");
  CHECK_THAT(drawn.choice.reason, Catch::Contains("treatment chose kv_int8"));

  PlanBench engine(kFloorRoute, "kv_int8");
  calibrate_int8(engine.policy);
  Chain().file(engine);
  const auto decided = engine.plan(lookup_of(engine.model_id(), 7, 7 * kBlockTokens + 1, kToCoder));
  CHECK(engine.engine.last_shape.chain_fidelity == 0.81);
  CHECK(decided.choice.medium == "kv_raw");
  CHECK(decided.choice.source == "refresh");

  // A route that allows no kv_raw refreshes to kv_lossless.
  PlanBench lossless(R"(, "quality_floor": 0.75, "allowed_media": ["kv_int8", "kv_lossless", "tokens"],
                       "forced_medium": "kv_int8")");
  calibrate_int8(lossless.policy);
  Chain().file(lossless);
  const auto zstd = lossless.plan(lookup_of(lossless.model_id(), 7, 7 * kBlockTokens + 1, kToCoder));
  CHECK(zstd.choice.medium == "kv_lossless");
  CHECK(zstd.codec == "lossless");
  CHECK(zstd.held.entry != nullptr);
}

TEST_CASE("precision: with no exact source a refresh is tokens", "[broker][plan][precision]") {
  PlanBench bench(kForcedInt8);
  calibrate_int8(bench.policy);
  bench.policy.peers.clear();  // nobody else to ask for exact KV
  Chain().file(bench, false);
  const auto plan = bench.plan(lookup_of(bench.model_id(), 7, 7 * kBlockTokens + 1, kToCoder));
  REQUIRE(plan.stop);
  CHECK(plan.stop->outcome == "tokens");
  CHECK(plan.choice.medium == "tokens");
  CHECK(plan.choice.source == "refresh");
  REQUIRE(plan.choice.refresh);
  CHECK(plan.choice.refresh->forced == RefreshForced::kTokens);
  CHECK_FALSE(plan.choice.refresh->exact_source);

  // A peer may still hold exact KV: it is asked, losslessly.
  PlanBench peered(kForcedInt8);
  calibrate_int8(peered.policy);
  Chain().file(peered, false);
  const auto asked = peered.plan(lookup_of(peered.model_id(), 7, 7 * kBlockTokens + 1, kToCoder));
  REQUIRE_FALSE(asked.stop);
  CHECK(asked.ask_peers);
  CHECK(asked.lossless);
  CHECK(asked.choice.refresh->forced == RefreshForced::kLossless);
  CHECK_FALSE(asked.choice.refresh->exact_source);

  // A route that allows only lossy media: tokens.
  PlanBench lossy_only(
      R"(, "quality_floor": 0.75, "allowed_media": ["kv_int8", "tokens"], "forced_medium": "kv_int8")");
  calibrate_int8(lossy_only.policy);
  Chain().file(lossy_only);
  const auto none = lossy_only.plan(lookup_of(lossy_only.model_id(), 7, 7 * kBlockTokens + 1, kToCoder));
  REQUIRE(none.stop);
  CHECK(none.choice.medium == "tokens");
  CHECK(none.choice.refresh->forced == RefreshForced::kTokens);
}

TEST_CASE("precision: a held entry of the medium's codec is not served when its own product would cross the floor",
          "[broker][plan][precision]") {
  PlanBench bench(kForcedInt8);
  calibrate_int8(bench.policy);
  const auto exact = tiny_entry(2 * kBlockTokens);
  REQUIRE(bench.store.put({bench.model_id(), chain_of(7)[1]}, exact));
  // An int8 entry at 0.81 (4 blocks), and a longer int4 one nobody stamped (int4: 0.921): the best
  // source is the int4 one, whose chain passes; the int8 copy alone would not.
  REQUIRE(bench.store.put({bench.model_id(), chain_of(7)[3]},
                          tiny_entry(4 * kBlockTokens, Fidelity::lossy("int8", 0, 0.81))));
  REQUIRE(bench.store.put({bench.model_id(), chain_of(7)[5]}, tiny_entry(6 * kBlockTokens, Fidelity::lossy("int4"))));
  const auto plan = bench.plan(lookup_of(bench.model_id(), 7, 7 * kBlockTokens + 1, kToCoder));
  REQUIRE_FALSE(plan.stop);
  CHECK(plan.chain_product == Approx(0.921));
  CHECK(plan.choice.medium == "kv_int8");
  CHECK(plan.held.entry == exact);  // encoded from the exact prefix instead
  CHECK_FALSE(plan.held_already_encoded);
}

TEST_CASE("precision: without a floor the best source is not scanned for", "[broker][plan][precision]") {
  PlanBench bench(R"(, "forced_medium": "kv_int8")");
  calibrate_int8(bench.policy);
  Chain().file(bench);
  const auto plan = bench.plan(lookup_of(bench.model_id(), 7, 7 * kBlockTokens + 1, kToCoder));
  CHECK(plan.chain_product == 1.0);
  CHECK(plan.choice.medium == "kv_int8");
  CHECK_FALSE(plan.choice.refresh);
}
