// Plugin codecs as media: one catalogue with the built-ins, built from a policy that names them,
// priced from their measured ratio and speed, and never chosen where the codec is not loaded.
#include <catch2/catch.hpp>
#include <nlohmann/json.hpp>

#include "kvrelay/decision/engine_from_policy.h"

#include "policy_fixture.h"

using namespace kvrelay::decision;
using nlohmann::json;

namespace {

// plan-code may use kv_raw or the xor plugin; the planner's chain floor forces lossless hops.
kvrelay::Policy plugin_policy() {
  json document = json::parse(testing::two_node_policy());
  document["routes"][0]["allowed_media"] = {"tokens", "kv_raw", "kv_int8", "codec:xor"};
  auto policy = kvrelay::parse_policy(document.dump(), "test.json");
  REQUIRE(policy);
  return std::move(policy).value();
}

constexpr PluginCodec kXor{"xor", true};

}  // namespace

TEST_CASE("the media catalogue holds every built-in medium in policy order and maps codecs both ways",
          "[decision][media]") {
  const auto catalogue = builtin_media();
  REQUIRE(catalogue.size() == std::size(kvrelay::kBuiltinMedia));
  for (std::size_t index = 0; index < catalogue.size(); ++index) {
    CHECK(catalogue[index].name == kvrelay::kBuiltinMedia[index]);
    if (const auto codec = prefix_codec_for(catalogue[index].name)) {
      CHECK(medium_for_codec_spec(*codec) == catalogue[index].name);
    }
  }
  CHECK(*prefix_codec_for("kv_int8") == "int8");
  CHECK_FALSE(prefix_codec_for("tokens"));
  CHECK_FALSE(prefix_codec_for("kv_sparse"));  // drops positions: cannot fill a prefix cache
  CHECK(*prefix_codec_for("codec:xor") == "xor");
  CHECK_FALSE(prefix_codec_for("codec:"));
  CHECK(medium_for_codec_spec("xor") == "codec:xor");
  CHECK(plugin_medium("xor", true).kind == MediumKind::kKvLossless);
  CHECK(plugin_medium("q3", false).kind == MediumKind::kKvLossy);
}

TEST_CASE("a plugin medium in allowed_media builds an engine, and the engine chooses it once measured cheap",
          "[decision][media]") {
  const kvrelay::Policy policy = plugin_policy();
  const PluginCodec loaded[] = {kXor};
  auto built = engine_from_policy(policy, LinkPriors{}, {}, loaded);
  INFO((built ? std::string() : built.error().message));
  REQUIRE(built);
  DecisionEngine& engine = built.value();
  const MediumId xor_medium = engine.find_medium("codec:xor").value();
  CHECK(engine.medium(xor_medium).kind == MediumKind::kKvLossless);  // the codec's lossless flag
  const RouteId route = engine.find_route("plan-code").value();
  const TransferShape shape{8000, 0, 1.0, 0.0, 0, {}};

  // Unmeasured, a plugin is priced as no compression on a slow host path: not chosen.
  const Decision unmeasured = engine.predict(route, shape).value();
  CHECK(unmeasured.cost_of(xor_medium).excluded == Exclusion::kNone);
  CHECK(unmeasured.argmin != xor_medium);

  // Measured (what the sidecar's own encodes and decodes report): a tenth of the bytes, fast.
  for (int i = 0; i < 64; ++i)
    engine.observe_codec(xor_medium, kvrelay::DType::kFloat16, 1e8, 1e7, 1e-3, 1e-3);
  const Decision measured = engine.decide(route, shape).value();
  CHECK(measured.cost_of(xor_medium).wire_bytes ==
        Approx(0.1 * measured.cost_of(engine.find_medium("kv_raw").value()).wire_bytes));
  CHECK(measured.argmin == xor_medium);
  CHECK(measured.chosen == xor_medium);

  // Lossless by kind: still eligible when the chain's fidelity forces a precision refresh.
  json document = json::parse(testing::two_node_policy());
  document["routes"][0]["allowed_media"] = {"tokens", "kv_raw", "kv_int8", "codec:xor"};
  document["routes"][0]["quality_floor"] = 0.9;
  auto floored = kvrelay::parse_policy(document.dump(), "test.json");
  REQUIRE(floored);
  REQUIRE(apply_policy_settings(engine, floored.value()));
  const Decision refresh = engine.predict(route, TransferShape{8000, 0, 0.5, 0.0, 0, {}}).value();
  CHECK(refresh.cost_of(engine.find_medium("kv_int8").value()).excluded == Exclusion::kPrecisionRefresh);
  CHECK(refresh.cost_of(xor_medium).excluded == Exclusion::kNone);
  CHECK(refresh.argmin == xor_medium);
}

TEST_CASE("a plugin medium whose codec is not loaded is listed and never chosen, the rest still works",
          "[decision][media]") {
  auto built = engine_from_policy(plugin_policy(), LinkPriors{});
  REQUIRE(built);
  DecisionEngine& engine = built.value();
  const MediumId xor_medium = engine.find_medium("codec:xor").value();
  CHECK_FALSE(engine.medium(xor_medium).available);
  for (int i = 0; i < 64; ++i)
    engine.observe_codec(xor_medium, kvrelay::DType::kFloat16, 1e8, 1e6, 1e-4, 1e-4);
  const Decision d =
      engine.predict(engine.find_route("plan-code").value(), TransferShape{8000, 0, 1.0, 0.0, 0, {}}).value();
  CHECK(d.cost_of(xor_medium).excluded == Exclusion::kCodecUnavailable);
  CHECK(d.argmin != xor_medium);
  CHECK(d.cost_of(engine.find_medium("kv_int8").value()).excluded == Exclusion::kNone);
}
