// fp8 KV moves as bytes: the engine never offers it a lossy or sparse medium, even where the same
// transfer of bf16 KV would go lossy.
#include <catch2/catch.hpp>
#include <nlohmann/json.hpp>

#include "kvrelay/decision/decision_engine.h"
#include "kvrelay/decision/decision_json.h"

using namespace kvrelay::decision;
using kvrelay::DType;

namespace {

// Two agents of one model of `dtype` on a 1 Gbit/s link, with a receiver whose prefill is slow
// enough that KV pays, and that accepts position-sparse KV (so kv_sparse is not excluded for that).
struct Fp8Engine {
  DecisionEngine engine;
  RouteId route = 0;

  explicit Fp8Engine(DType dtype) {
    AgentParams a;
    a.id = "a";
    a.fingerprint_id = 1;
    a.kv_bytes_per_token = 100e3;
    a.dtype = dtype;
    a.accepts_sparse = true;
    a.prefill_prior = PrefillCoefficients{0.01, 1e-3, 1e-8};
    a.decode_s_per_token = 0.01;
    AgentParams b = a;
    b.id = "b";
    (void)engine.add_agent(a).value();
    (void)engine.add_agent(b).value();
    const LinkId link = engine.add_link(LinkParams{"ab", false, 1.25e8, 1e-3}).value();
    kvrelay::RoutePolicy policy;
    policy.id = "ab";
    policy.from_agent = "a";
    policy.to_agent = "b";
    route = engine.add_route(policy, link).value();
  }
};

TransferShape long_context() {
  TransferShape shape;
  shape.tokens = 32768;
  shape.expected_output_tokens = 256;
  return shape;
}

}  // namespace

TEST_CASE("fp8 KV never gets a lossy medium, where bf16 KV of the same size would", "[decision][fp8]") {
  Fp8Engine bf16(DType::kBFloat16);
  const Decision lossy = bf16.engine.decide(bf16.route, long_context()).value();
  REQUIRE(bf16.engine.medium(lossy.chosen).needs_kv());
  CHECK_FALSE(bf16.engine.medium(lossy.chosen).lossless());  // the premise: bf16 goes lossy here

  for (const DType dtype : {DType::kFp8E4M3, DType::kFp8E5M2}) {
    INFO(kvrelay::dtype_name(dtype));
    Fp8Engine fp8(dtype);
    const Decision d = fp8.engine.decide(fp8.route, long_context()).value();
    CHECK(d.dtype == dtype);
    CHECK(fp8.engine.medium(d.chosen).needs_kv());
    CHECK(fp8.engine.medium(d.chosen).lossless());
    for (std::size_t i = 0; i < d.candidate_count; ++i) {
      const MediumSpec& medium = fp8.engine.medium(static_cast<MediumId>(i));
      INFO(medium.name);
      if (!medium.needs_kv() && !medium.lossless()) {
        // A summary converts no KV; this route does not name it (docs/summary.md).
        CHECK(d.candidates[i].excluded == Exclusion::kNotAllowed);
      } else if (medium.lossless()) {
        CHECK(d.candidates[i].excluded == Exclusion::kNone);
      } else {
        CHECK(d.candidates[i].excluded == Exclusion::kBytesOnlyDtype);
      }
    }
    const auto decision_json = decision_to_json(d, fp8.engine);
    CHECK(decision_json["dtype"] == std::string(kvrelay::dtype_name(dtype)));
    bool named = false;
    for (const auto& candidate : decision_json["candidates"]) {
      if (candidate["medium"] == "kv_int4") named = candidate.value("lost_because", "") == "fp8_moves_as_bytes";
    }
    CHECK(named);
  }
}

TEST_CASE("The KV's own dtype in the transfer shape overrides the sender's", "[decision][fp8]") {
  Fp8Engine bf16(DType::kBFloat16);
  TransferShape shape = long_context();
  shape.dtype = DType::kFp8E4M3;
  const Decision d = bf16.engine.predict(bf16.route, shape).value();
  CHECK(bf16.engine.medium(d.chosen).lossless());
  CHECK(d.cost_of(bf16.engine.find_medium("kv_int8").value()).excluded == Exclusion::kBytesOnlyDtype);
  CHECK(d.cost_of(bf16.engine.find_medium("kv_sparse").value()).excluded == Exclusion::kBytesOnlyDtype);
  CHECK(d.cost_of(bf16.engine.find_medium("kv_lossless").value()).excluded == Exclusion::kNone);
  // fp8 KV through lossless is priced with the fp8 ratio, not the bf16 one.
  const MediumSpec& lossless = bf16.engine.medium(bf16.engine.find_medium("kv_lossless").value());
  CHECK(d.cost_of(bf16.engine.find_medium("kv_lossless").value()).wire_bytes ==
        Approx(32768 * 100e3 * lossless.profile.ratio_for(DType::kFp8E4M3)));
}

TEST_CASE("A route forced to a lossy medium falls back to tokens for fp8 KV", "[decision][fp8]") {
  Fp8Engine fp8(DType::kFp8E4M3);
  kvrelay::RoutePolicy forced;
  forced.id = "forced";
  forced.from_agent = "a";
  forced.to_agent = "b";
  forced.forced_medium = "kv_int8";
  const RouteId route = fp8.engine.add_route(forced, fp8.engine.find_link("ab").value()).value();
  const Decision d = fp8.engine.decide(route, long_context()).value();
  CHECK(d.chosen == kTokensMedium);
  CHECK(d.cost_of(fp8.engine.find_medium("kv_int8").value()).excluded == Exclusion::kBytesOnlyDtype);
}
