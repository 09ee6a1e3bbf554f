#include <catch2/catch.hpp>
#include <nlohmann/json.hpp>

#include <limits>

#include "kvrelay/decision/decision_json.h"

#include "engine_fixture.h"

using namespace kvrelay::decision;
using kvrelay::DType;
using kvrelay::ErrorCode;
using kvrelay::RoutePolicy;
using testing::EngineFixture;

TEST_CASE("Cost terms follow the model over the blocks the receiver lacks") {
  EngineFixture f;
  const RouteId r = f.route();
  TransferShape shape;
  shape.tokens = 4096;
  shape.receiver_cached = 1024;
  shape.expected_output_tokens = 100;
  const Decision d = f.engine.predict(r, shape).value();
  CHECK(d.missing_tokens == 3072);

  const double missing = 3072.0;
  const double cached = 1024.0;
  const auto& tokens = d.cost_of(kTokensMedium);
  CHECK(tokens.comm_s == Approx(missing * 4 / 1.25e8 + 1e-3));
  CHECK(tokens.comp_s == Approx(0.01 + 1e-4 * missing + 1e-9 * missing * (missing + 2 * cached)));
  CHECK(tokens.codec_s == 0.0);
  CHECK(tokens.loss_s == 0.0);

  const auto& raw = d.cost_of(f.id("kv_raw"));
  CHECK(raw.wire_bytes == Approx(missing * 100e3));
  CHECK(raw.comm_s == Approx(missing * 100e3 / 1.25e8 + 1e-3));
  CHECK(raw.comp_s == 0.0);
  CHECK(raw.codec_s == 0.0);

  const MediumSpec& int8 = f.engine.medium(f.id("kv_int8"));
  const auto& q = d.cost_of(f.id("kv_int8"));
  const double raw_bytes = missing * 100e3;
  CHECK(q.wire_bytes == Approx(raw_bytes * int8.profile.ratio_for(DType::kFloat16)));
  CHECK(q.codec_s == Approx(raw_bytes / int8.profile.encode_bytes_per_s + raw_bytes / int8.profile.decode_bytes_per_s));
  CHECK(q.loss_s == Approx(int8.profile.extra_decode_fraction * 100 * 0.01));
  CHECK(q.total_s == Approx(q.comm_s + q.codec_s + q.comp_s + q.loss_s));

  // The argmin is the cheapest eligible candidate.
  for (std::size_t i = 0; i < d.candidate_count; ++i) {
    if (d.candidates[i].excluded == Exclusion::kNone) {
      CHECK(d.cost_of(d.argmin).total_s <= d.candidates[i].total_s);
    }
  }
}

TEST_CASE("A receiver that already holds the whole context costs only a round trip") {
  EngineFixture f;
  const RouteId r = f.route();
  const Decision d = f.engine.predict(r, TransferShape{2048, 4096, 1.0, 0.0, 0, {}}).value();
  CHECK(d.missing_tokens == 0);
  CHECK(d.cost_of(f.id("kv_raw")).wire_bytes == 0.0);
  CHECK(d.cost_of(f.id("kv_raw")).total_s == Approx(1e-3));
}

TEST_CASE("Short contexts go as tokens and long ones as KV when prefill is attention-bound") {
  EngineFixture f(EngineConfig{}, true, false, testing::kAttentionBound);
  const RouteId r = f.route_over("1GBps", 1e9);
  // 16 tokens: recompute ~1.2 ms vs 1.6 MB of KV at 1 GB/s; 16k tokens: ~2.9 s vs ~1.6 s.
  const Decision shorter = f.engine.predict(r, TransferShape{16, 0, 1.0, 0.0, 0, {}}).value();
  CHECK(shorter.argmin == kTokensMedium);
  const Decision longer = f.engine.predict(r, TransferShape{16384, 0, 1.0, 0.0, 0, {}}).value();
  CHECK(f.engine.medium(longer.argmin).needs_kv());
  // The same long context over a 10x slower link is cheaper to recompute.
  const RouteId slow = f.route_over("100MBps", 1e8);
  CHECK(f.engine.predict(slow, TransferShape{16384, 0, 1.0, 0.0, 0, {}}).value().argmin == kTokensMedium);
}

TEST_CASE("KV media are excluded between different fingerprints") {
  EngineFixture f(EngineConfig{}, /*same_model=*/false);
  const RouteId r = f.route();
  const Decision d = f.engine.predict(r, TransferShape{32768, 0, 1.0, 0.0, 256, {}}).value();
  CHECK(d.argmin == kTokensMedium);
  for (std::size_t i = 1; i < d.candidate_count; ++i) {
    // A summary moves no KV; this route does not name it (docs/summary.md).
    if (!f.engine.medium(static_cast<MediumId>(i)).needs_kv()) continue;
    CHECK(d.candidates[i].excluded == Exclusion::kFingerprintMismatch);
  }
}

TEST_CASE("kv_sparse is a candidate only for receivers that declared support") {
  EngineFixture without;
  const Decision d1 = without.engine.predict(without.route(), TransferShape{8192, 0, 1.0, 0.0, 0, {}}).value();
  CHECK(d1.cost_of(without.id("kv_sparse")).excluded == Exclusion::kSparseUnsupported);
  EngineFixture with(EngineConfig{}, true, /*accepts_sparse=*/true);
  const Decision d2 = with.engine.predict(with.route(), TransferShape{8192, 0, 1.0, 0.0, 0, {}}).value();
  CHECK(d2.cost_of(with.id("kv_sparse")).excluded == Exclusion::kNone);
}

TEST_CASE("Route policy: allowed media, forced medium, disabled route") {
  EngineFixture f;
  RoutePolicy allowed;
  allowed.allowed_media = {"tokens", "kv_raw"};
  const Decision d = f.engine.predict(f.route(allowed), TransferShape{32768, 0, 1.0, 0.0, 0, {}}).value();
  CHECK(d.cost_of(f.id("kv_int8")).excluded == Exclusion::kNotAllowed);
  CHECK(d.cost_of(f.id("kv_raw")).excluded == Exclusion::kNone);
  CHECK((d.argmin == kTokensMedium || d.argmin == f.id("kv_raw")));

  RoutePolicy forced;
  forced.forced_medium = "kv_int4";
  const RouteId fr = f.route(forced);
  Decision fd = f.engine.decide(fr, TransferShape{16, 0, 1.0, 0.0, 0, {}}).value();
  CHECK(fd.chosen == f.id("kv_int4"));
  CHECK(fd.reason == DecisionReason::kForced);
  CHECK(fd.cost_of(kTokensMedium).excluded == Exclusion::kNotForced);

  RoutePolicy disabled;
  disabled.enabled = false;
  const Decision dd = f.engine.decide(f.route(disabled), TransferShape{32768, 0, 1.0, 0.0, 0, {}}).value();
  CHECK(dd.chosen == kTokensMedium);
  CHECK(dd.reason == DecisionReason::kRouteDisabled);
  CHECK(dd.cost_of(f.id("kv_raw")).excluded == Exclusion::kRouteDisabled);
}

TEST_CASE("A forced KV medium on an incompatible model pair falls back to tokens") {
  EngineFixture f(EngineConfig{}, false);
  RoutePolicy forced;
  forced.forced_medium = "kv_raw";
  const Decision d = f.engine.decide(f.route(forced), TransferShape{4096, 0, 1.0, 0.0, 0, {}}).value();
  CHECK(d.chosen == kTokensMedium);
  CHECK(d.cost_of(f.id("kv_raw")).excluded == Exclusion::kFingerprintMismatch);
}

TEST_CASE("Quality floor excludes weak codecs and forces a lossless hop once the chain decays") {
  EngineFixture f;
  RoutePolicy policy;
  policy.quality_floor = 0.97;
  policy.allowed_media = {"kv_raw", "kv_fp8", "kv_int8", "kv_int4"};  // keep it on KV
  const RouteId r = f.route(policy);
  const Decision fresh = f.engine.predict(r, TransferShape{32768, 0, 1.0, 0.0, 0, {}}).value();
  CHECK(fresh.cost_of(f.id("kv_int4")).excluded == Exclusion::kBelowQualityFloor);  // fidelity 0.95
  CHECK(fresh.cost_of(f.id("kv_int8")).excluded == Exclusion::kNone);               // fidelity 0.99
  CHECK_FALSE(f.engine.medium(fresh.argmin).lossless());

  // Walk a context along hops: fidelity multiplies on lossy hops; once one more lossy hop would
  // cross the floor, the engine must pick a lossless medium instead.
  double chain = 1.0;
  int lossy_hops = 0;
  int lossless_hops = 0;
  for (int hop = 0; hop < 12; ++hop) {
    const Decision d = f.engine.decide(r, TransferShape{32768, 0, chain, static_cast<double>(hop) * 10, 0, {}}).value();
    CHECK(d.chain_fidelity_after >= policy.quality_floor);
    const MediumSpec& chosen = f.engine.medium(d.chosen);
    if (chosen.lossless()) {
      ++lossless_hops;
      CHECK(chain * f.engine.medium(f.id("kv_fp8")).profile.fidelity < policy.quality_floor);
    } else {
      ++lossy_hops;
    }
    chain = d.chain_fidelity_after;
  }
  CHECK(lossy_hops >= 1);
  CHECK(lossless_hops >= 1);

  const Decision refresh = f.engine.predict(r, TransferShape{32768, 0, 0.96, 0.0, 0, {}}).value();
  for (const char* lossy : {"kv_fp8", "kv_int8", "kv_int4"}) {
    CHECK(refresh.cost_of(f.id(lossy)).excluded == Exclusion::kPrecisionRefresh);
  }
  CHECK(refresh.argmin == f.id("kv_raw"));
}

TEST_CASE("Plugin codecs take part under their codec: name") {
  EngineFixture f;
  MediumSpec plugin;
  plugin.name = "codec:tiny";
  plugin.kind = MediumKind::kKvLossless;
  plugin.profile = CodecProfile{{0.05, 0.05, 0.05, 0.05}, 50e9, 50e9, 1.0, 0.0};
  const MediumId id = f.engine.add_medium(plugin).value();
  CHECK(f.engine.add_medium(plugin).error().code == ErrorCode::kAlreadyExists);
  const Decision d = f.engine.predict(f.route(), TransferShape{32768, 0, 1.0, 0.0, 0, {}}).value();
  CHECK(d.argmin == id);
}

TEST_CASE("Codec observations move the expected ratio used by the cost model") {
  EngineFixture f;
  const RouteId r = f.route();
  const MediumId int8 = f.id("kv_int8");
  for (int i = 0; i < 64; ++i) {
    f.engine.observe_codec(int8, DType::kFloat16, 1e6, 0.75e6, 1e-3, 1e-3);
  }
  const Decision d = f.engine.predict(r, TransferShape{1000, 0, 1.0, 0.0, 0, {}}).value();
  CHECK(d.cost_of(int8).wire_bytes == Approx(1000 * 100e3 * 0.75));
  CHECK(d.cost_of(int8).codec_s == Approx(1000 * 100e3 / 1e9 * 2));
}

TEST_CASE("A codec observation that timed one side (a sidecar's encode or its decode) moves only that side") {
  EngineFixture f;
  const RouteId r = f.route();
  const MediumId int8 = f.id("kv_int8");
  const double raw = 1000 * 100e3;
  const double not_timed = std::numeric_limits<double>::quiet_NaN();
  for (int i = 0; i < 64; ++i) {
    f.engine.observe_codec(int8, DType::kFloat16, 1e6, 0.5e6, 1e-3, not_timed);  // encode at 1 GB/s
  }
  const double encode_only = f.engine.predict(r, TransferShape{1000, 0, 1.0, 0.0, 0, {}}).value().cost_of(int8).codec_s;
  CHECK(encode_only > raw / 1e9);  // the decode prior is still in
  for (int i = 0; i < 64; ++i) {
    f.engine.observe_codec(int8, DType::kFloat16, 1e6, 0.5e6, not_timed, 0.5e-3);  // decode at 2 GB/s
  }
  const Decision d = f.engine.predict(r, TransferShape{1000, 0, 1.0, 0.0, 0, {}}).value();
  CHECK(d.cost_of(int8).codec_s == Approx(raw / 1e9 + raw / 2e9));
  CHECK(d.cost_of(int8).wire_bytes == Approx(raw * 0.5));
  CHECK(encode_only != Approx(d.cost_of(int8).codec_s));
}

TEST_CASE("Setup rejects unknown names and bad parameters") {
  EngineFixture f;
  RoutePolicy unknown_medium;
  unknown_medium.id = "x";
  unknown_medium.from_agent = "a";
  unknown_medium.to_agent = "b";
  unknown_medium.allowed_media = {"kv_nonexistent"};
  CHECK(f.engine.add_route(unknown_medium, f.link).error().code == ErrorCode::kNotFound);
  RoutePolicy unknown_agent;
  unknown_agent.id = "y";
  unknown_agent.from_agent = "nobody";
  unknown_agent.to_agent = "b";
  CHECK(f.engine.add_route(unknown_agent, f.link).error().code == ErrorCode::kNotFound);
  CHECK(f.engine.add_link(LinkParams{"bad", false, 0.0, 0.0}).error().code == ErrorCode::kInvalidArgument);
  CHECK(f.engine.decide(999, TransferShape{}).error().code == ErrorCode::kNotFound);
  MediumSpec bad;
  bad.name = "codec:bad";
  bad.kind = MediumKind::kKvLossy;
  bad.profile.fidelity = 1.5;
  CHECK(f.engine.add_medium(bad).error().code == ErrorCode::kInvalidArgument);
}

TEST_CASE("The decision log record carries every term, the winner and why the others lost") {
  EngineFixture f(EngineConfig{}, true, true);
  RoutePolicy policy;
  policy.id = "logged";
  policy.allowed_media = {"tokens", "kv_raw", "kv_int8", "kv_sparse"};
  const RouteId r = f.route(policy);
  const Decision d = f.engine.decide(r, TransferShape{8192, 0, 1.0, 0.0, 64, {}}).value();
  const nlohmann::json j = decision_to_json(d, f.engine);
  CHECK(j.at("route") == "logged");
  CHECK(j.at("chosen") == f.engine.medium(d.chosen).name);
  CHECK(j.at("reason") == "first_decision");
  CHECK(j.at("hysteresis_held") == false);
  REQUIRE(j.at("candidates").size() == f.engine.media_count());
  int losers = 0;
  for (const auto& c : j.at("candidates")) {
    for (const char* key : {"c_comm_s", "c_codec_s", "c_comp_s", "c_loss_s", "total_s", "wire_bytes"}) {
      CHECK(c.contains(key));
    }
    CHECK(c.at("total_s").get<double>() == Approx(c.at("c_comm_s").get<double>() + c.at("c_codec_s").get<double>() +
                                                  c.at("c_comp_s").get<double>() + c.at("c_loss_s").get<double>()));
    if (c.at("medium") != j.at("chosen")) {
      CHECK(c.contains("lost_because"));
      ++losers;
    }
    if (c.at("medium") == "kv_fp8") {
      CHECK(c.at("lost_because") == "not_allowed");
    }
  }
  CHECK(losers == static_cast<int>(f.engine.media_count()) - 1);
}

TEST_CASE("A chosen medium predicted past the route deadline is flagged") {
  EngineFixture f;
  RoutePolicy tight;
  tight.deadline = std::chrono::milliseconds(5);
  const Decision late = f.engine.decide(f.route(tight), TransferShape{8192, 0, 1.0, 0.0, 0, {}}).value();
  CHECK(late.cost_of(late.chosen).total_s > 0.005);
  CHECK(late.deadline_miss);
  RoutePolicy loose;
  loose.deadline = std::chrono::milliseconds(60'000);
  CHECK_FALSE(f.engine.decide(f.route(loose), TransferShape{8192, 0, 1.0, 0.0, 0, {}}).value().deadline_miss);
  CHECK_FALSE(f.engine.decide(f.route(), TransferShape{8192, 0, 1.0, 0.0, 0, {}}).value().deadline_miss);
}

TEST_CASE("Receiver load stretches the re-prefill cost, not the KV media") {
  EngineFixture f;
  const RouteId r = f.route();
  TransferShape shape;
  shape.tokens = 2048;
  const Decision idle = f.engine.predict(r, shape).value();

  f.engine.observe_load(f.receiver, 3.0);
  const Decision loaded = f.engine.predict(r, shape).value();
  CHECK(loaded.cost_of(kTokensMedium).comp_s == Approx(4.0 * idle.cost_of(kTokensMedium).comp_s));
  CHECK(loaded.cost_of(f.id("kv_raw")).total_s == Approx(idle.cost_of(f.id("kv_raw")).total_s));
  // The fitted model itself is unchanged: load is a condition of the moment, not of the receiver.
  CHECK(f.engine.prefill_coefficients(f.receiver).b == Approx(1e-4));

  // Nonsense readings (they come from a scraped page) are ignored.
  f.engine.observe_load(f.receiver, -1.0);
  f.engine.observe_load(f.receiver, std::nan(""));
  CHECK(f.engine.predict(r, shape).value().cost_of(kTokensMedium).comp_s ==
        Approx(loaded.cost_of(kTokensMedium).comp_s));

  f.engine.observe_load(f.receiver, 0.0);
  CHECK(f.engine.predict(r, shape).value().cost_of(kTokensMedium).comp_s == Approx(idle.cost_of(kTokensMedium).comp_s));
}

TEST_CASE("Under load the break-even length moves toward shorter contexts") {
  EngineFixture f({}, true, false, testing::kAttentionBound);
  const RouteId r = f.route();
  // Find a length that goes as tokens when the receiver is idle.
  TransferShape shape;
  shape.tokens = 64;
  REQUIRE(f.engine.predict(r, shape).value().argmin == kTokensMedium);
  f.engine.observe_load(f.receiver, 50.0);
  CHECK(f.engine.predict(r, shape).value().argmin != kTokensMedium);
}
