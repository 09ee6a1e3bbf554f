#pragma once

// The offline audit runner: every context under every treatment, in a seeded random order per
// context and repeat, through the sidecars' front proxies. Agent A answers the context first
// (publishing its KV), then agent B receives A's whole context plus B's follow-up with the
// treatment in kv_transfer_params.kvrelay.treatment; B's time to first token is the first byte
// of its streamed answer. Trials sharing a context and repeat share a pair_id, so the analysis
// is paired. `kvrelay audit run` is its command line.

#include <cstddef>
#include <cstdint>
#include <string>
#include <vector>

#include "kvrelay/audit/trials.h"
#include "kvrelay/core/result.h"

namespace kvrelay::audit {

struct OfflineRunOptions {
  std::string contexts_file;          // JSON lines: {"prompt": [ids], "a_followup": [ids], "b_followup": [ids]}
  std::vector<std::string> sidecars;  // A's front proxy URL, then B's (one URL: both on one node)
  std::string agent_a;
  std::string agent_b;
  std::string route;  // recorded in the trials; "" is "<agent_a>-to-<agent_b>"
  std::vector<std::string> treatments{"T0", "T1", "T2", "T3"};
  std::string kv_medium = "kv_raw";
  std::size_t repeats = 1;
  std::uint64_t seed = 1;
  std::string out;  // trials file, written line by line as trials finish
  std::uint32_t a_max_tokens = 16;
  std::uint32_t b_max_tokens = 4;
  std::string sender_model;
  std::string receiver_model;
  double timeout_s = 120.0;
};

// Runs every trial and returns them (also written to options.out). The first failure (a bad
// option, an unreadable contexts file, a sidecar that fails or answers non-200) stops the run.
[[nodiscard]] Result<TrialSet> run_offline_audit(const OfflineRunOptions& options);

}  // namespace kvrelay::audit
