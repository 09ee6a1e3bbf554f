#pragma once

#include <catch2/catch.hpp>

#include <string>

#include "kvrelay/decision/decision_engine.h"

namespace kvrelay::decision::testing {

// Two agents on one model, a 1 Gbit/s link and a route between them, with round numbers so
// expected costs can be worked out by hand in the tests.
struct EngineFixture {
  DecisionEngine engine;
  AgentId sender = 0;
  AgentId receiver = 0;
  LinkId link = 0;

  explicit EngineFixture(EngineConfig config = {}, bool same_model = true, bool accepts_sparse = false,
                         PrefillCoefficients prefill = {0.01, 1e-4, 1e-9})
      : engine(config) {
    AgentParams a;
    a.id = "a";
    a.fingerprint_id = 1;
    a.kv_bytes_per_token = 100e3;
    a.dtype = DType::kFloat16;
    a.prefill_prior = prefill;
    a.decode_s_per_token = 0.01;
    AgentParams b = a;
    b.id = "b";
    b.fingerprint_id = same_model ? 1 : 2;
    b.accepts_sparse = accepts_sparse;
    sender = engine.add_agent(a).value();
    receiver = engine.add_agent(b).value();
    link = engine.add_link(LinkParams{"ab", false, 1.25e8, 1e-3}).value();
  }

  RouteId route(RoutePolicy policy = {}) {
    if (policy.id.empty()) {
      policy.id = "r" + std::to_string(engine.route_count());
    }
    policy.from_agent = "a";
    policy.to_agent = "b";
    return engine.add_route(policy, link).value();
  }

  MediumId id(std::string_view name) const { return engine.find_medium(name).value(); }

  // A route over its own link, for tests that need another bandwidth.
  RouteId route_over(const std::string& link_id, double bytes_per_s) {
    const LinkId other = engine.add_link(LinkParams{link_id, false, bytes_per_s, 1e-4}).value();
    RoutePolicy policy;
    policy.id = "over-" + link_id;
    policy.from_agent = "a";
    policy.to_agent = "b";
    return engine.add_route(policy, other).value();
  }
};

// A receiver whose prefill is attention-bound (large quadratic term), so on a 1 GB/s link short
// contexts are cheaper to recompute and long ones cheaper to move as KV.
inline constexpr PrefillCoefficients kAttentionBound{0.001, 1e-5, 1e-8};

}  // namespace kvrelay::decision::testing
