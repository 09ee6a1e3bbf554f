#pragma once

#include <nlohmann/json.hpp>

#include <cstdint>
#include <optional>
#include <span>
#include <vector>

#include "kvrelay/core/fidelity.h"
#include "kvrelay/core/kv_layout.h"
#include "kvrelay/core/kv_tokens.h"
#include "kvrelay/core/result.h"
#include "kvrelay/refworker/session.h"

namespace kvrelay::refworker {

// KV for `layout.tokens` tokens of a prompt, in KvLayout order, fp32: either a copy in `kv`, or,
// when `read` is set, left where the connector found it (a shared-memory segment the sidecar
// handed over) and read straight into the session's KV cache on import. Usually the leading
// tokens; a span (issue #28, audit span "generated") starts at `start_tokens`, after tokens the
// worker prefills itself; sparse KV (kv_sparse) keeps only the positions `kept` names.
struct KvPrefix {
  KvLayout layout;
  std::vector<float> kv;
  KvReader read;
  Fidelity fidelity;  // how faithful to the source's KV (a lossy medium makes it lossy)
  std::uint64_t start_tokens = 0;
  std::vector<TokenRun> kept;        // empty: every position; else layout.tokens of them
  std::uint64_t context_tokens = 0;  // sparse: the positions the kept ones were chosen from
};

// The fidelity of KV a session computed after importing a prefix of `imported_tokens` tokens
// with `imported` fidelity: exactness ends where the import's does, since every later position
// attends over the imported KV.
[[nodiscard]] inline Fidelity computed_fidelity(const Fidelity& imported, std::uint64_t imported_tokens) {
  if (imported.exact_through(imported_tokens)) return Fidelity::exact();
  return Fidelity::lossy(imported.lossy_codec, imported.exact_tokens);
}

// What the worker does around each request, exactly where a vLLM KV connector hooks in: ask for
// a KV prefix before prefill, hand over the KV after generation, report what prefill cost. The
// implementation over the sidecar client library is wired in by the sidecar integration; the
// worker treats every connector failure as a miss and never fails a request because of it.
class KvConnector {
 public:
  virtual ~KvConnector() = default;

  // `params` is the request's kv_transfer_params.kvrelay object (null when absent).
  // nullopt: miss, the worker prefills every token.
  [[nodiscard]] virtual Result<std::optional<KvPrefix>> lookup(std::span<const std::int32_t> tokens,
                                                               const nlohmann::json& params) = 0;

  // `kv` holds the KV of exactly `tokens` (layout.tokens == tokens.size()), as faithful to the
  // source's KV as `fidelity` says (computed_fidelity of what the request imported). The first
  // `prompt_tokens` of them were the request's prompt, the rest its answer (issue #28).
  [[nodiscard]] virtual Status publish(std::span<const std::int32_t> tokens, const KvLayout& layout,
                                       std::span<const float> kv, const nlohmann::json& params,
                                       const Fidelity& fidelity, std::uint64_t prompt_tokens) = 0;

  // One prefill: the tokens actually computed (the prompt minus any imported prefix) and the
  // wall time it took, for the sidecar's prefill cost model; `params` as for lookup.
  virtual void report_prefill(std::span<const std::int32_t> computed_tokens, std::uint64_t context_tokens,
                              double seconds, const nlohmann::json& params) = 0;

  // false: publish() would discard the KV, so the worker skips exporting it.
  [[nodiscard]] virtual bool wants_publish() const { return true; }
};

// A worker without a sidecar: every lookup misses and nothing is published.
class NoKvConnector final : public KvConnector {
 public:
  Result<std::optional<KvPrefix>> lookup(std::span<const std::int32_t>, const nlohmann::json&) override {
    return std::optional<KvPrefix>{};
  }
  Status publish(std::span<const std::int32_t>, const KvLayout&, std::span<const float>, const nlohmann::json&,
                 const Fidelity&, std::uint64_t) override {
    return ok();
  }
  void report_prefill(std::span<const std::int32_t>, std::uint64_t, double, const nlohmann::json&) override {}
  [[nodiscard]] bool wants_publish() const override { return false; }
};

}  // namespace kvrelay::refworker
