#pragma once

// Stage one of a lookup: what to serve, decided from the policy, the request's context and what
// this node's store holds, with no I/O. The decision engine is reached through EngineAdvisor so
// a plan can be made (and tested) without one.

#include <nlohmann/json.hpp>

#include <cstddef>
#include <cstdint>
#include <functional>
#include <optional>
#include <string>
#include <utility>

#include "kvrelay/broker/engine_advisor.h"
#include "kvrelay/broker/request_context.h"
#include "kvrelay/codec_plugins/registry.h"
#include "kvrelay/core/policy.h"
#include "kvrelay/core/result.h"
#include "kvrelay/decision/decision_engine.h"
#include "kvrelay/kv_store/entry_store.h"
#include "kvrelay/kv_store/prefix_scan.h"
#include "kvrelay/shm_transport/control_protocol.h"

#include "precision.h"

namespace kvrelay::broker {

// Which medium carries a handoff, and why.
struct MediumChoice {
  std::string medium;
  std::string source;  // treatment, forced, engine, default, refresh
  std::string reason;
  nlohmann::json cost;  // the engine's breakdown (chosen vs alternatives), null without a route
  // The engine chose tokens for what the receiver lacks: the prefix this node already holds is
  // still served (the engine priced tokens as a prefill of the missing part only).
  bool serve_held_prefix = false;
  // Set when the chain's fidelity product would cross the route's quality_floor through the
  // lossy medium the choice would have been (source "refresh"; precision.h).
  std::optional<PrecisionRefresh> refresh;
};

// The route the request belongs to: the one it names, else the first of its candidates the
// policy has, else the first into its agent; null when none.
[[nodiscard]] const RoutePolicy* pick_route(const Policy& policy, const RequestContext& context);

// `held_tokens`: the leading part of the context the receiver already holds. `chain_product`:
// the fidelity product of the KV the hop would start from (effective_product of the best
// source). After the treatment, the forced medium and the engine, a lossy medium that would take
// it below the route's quality_floor becomes the route's first lossless medium (kv_raw, else
// kv_lossless), or tokens when it allows none: the floor is a safety rule.
[[nodiscard]] MediumChoice choose_medium(const Policy& policy, const RoutePolicy* route, const RequestContext& context,
                                         std::uint64_t context_tokens, std::uint64_t held_tokens,
                                         const codec::CodecRegistry& codecs, EngineAdvisor& engine,
                                         double chain_product = 1.0);

// Why a lookup serves nothing: its outcome ("tokens", "miss") and the worker's error.
struct PlanStop {
  std::string outcome;
  Error error;
};

struct LookupPlan {
  const RoutePolicy* route = nullptr;
  MediumChoice choice;
  std::size_t max_blocks = 0;  // blocks that may be served
  std::string codec;           // the medium's codec spec ("raw" for a held prefix under tokens)
  bool lossless = true;
  bool sparse = false;  // kv_sparse: exact KV ("raw") of the kept positions only (codec_plugins/sparse.h)
  // The local prefix: served as it is, or joined to what peers add.
  kv_store::HeldPrefix held;
  bool held_already_encoded = false;  // lossy KV of the plan's codec: what the medium delivers
  bool ask_peers = false;             // peers may add blocks after `held`
  // The effective fidelity product of the best source this node holds, of any fidelity (1 when
  // it is exact, or nothing is held): the chain the engine and the refresh rule start from.
  double chain_product = 1.0;
  // The least product a peer's lossy answer may carry for the floor to hold (0: any; the floor,
  // since answers are stamped after their hop); the fetch sends it (FetchInputs).
  double min_fidelity_product = 0.0;
  std::optional<PlanStop> stop;  // set when nothing is served
};

struct PlanInputs {
  const Policy& policy;
  const shm::ResolveRequest& request;
  const RequestContext& context;
  kv_store::EntryStore& store;
  const codec::CodecRegistry& codecs;
  EngineAdvisor& engine;
  // The longest prefix of the lookup's chain other nodes hold, in blocks, and its effective
  // fidelity product (peers' summaries); unset or nullopt: none known. A fetch would extend it,
  // so the refresh rule reads it when it is longer than this node's best source.
  std::function<std::optional<std::pair<std::size_t, double>>()> longest_elsewhere{};
};

// The blocks a lookup may serve: never the whole prompt (its last token is prefilled for
// logits), and for a "prompt" span treatment that names A's prompt length only the blocks inside
// it (otherwise the served entry's prompt boundary cuts the span: treatment_span.h).
[[nodiscard]] std::size_t servable_blocks(const shm::ResolveRequest& request, const RequestContext& context);

// `max_blocks` from servable_blocks().
[[nodiscard]] LookupPlan plan_lookup(const PlanInputs& inputs, std::size_t max_blocks);

}  // namespace kvrelay::broker
