#pragma once

// The daemon's online audit: for a route with an audit fraction, a share of the requests into
// its receiving agent get a uniformly random treatment from the route's list. The assignment is
// appended to the route's trials file (and flushed) before the request is forwarded, so no
// outcome can influence which trials exist; the outcome (time to first token and total latency
// as the front proxy measured them) is appended when the response ends and joined by request id.
// Trials stay in memory (bounded) for GET /admin/audit/report.

#include <nlohmann/json_fwd.hpp>

#include <cstdint>
#include <fstream>
#include <map>
#include <memory>
#include <mutex>
#include <optional>
#include <random>
#include <string>
#include <vector>

#include "kvrelay/audit/analysis.h"
#include "kvrelay/audit/trials.h"
#include "kvrelay/core/policy.h"
#include "kvrelay/core/treatment.h"

namespace kvrelay::proxy {

struct AuditOutcome {
  double ttft_ms = 0.0;
  double e2e_ms = 0.0;
  unsigned status = 0;
  std::optional<std::uint64_t> prompt_tokens;  // from the worker's kvrelay stats, when it sent them
  std::optional<std::uint64_t> cached_tokens;
  // What the request was actually delivered (a lookup missed, the receiver could not take a
  // span...); nullopt: delivered as assigned. The reason is recorded when they differ.
  // (Default member initializers keep the five-field aggregate initializations warning-free.)
  std::optional<std::string> delivered_treatment{};
  std::string delivery_reason{};
};

class OnlineAudit {
 public:
  // At most this many finished trials (and as many unfinished assignments) are kept in memory.
  explicit OnlineAudit(std::size_t max_trials_in_memory = 100'000, std::uint64_t seed = std::random_device{}());

  // Draws whether a request is audited (probability route.audit.fraction) and, if so, its
  // treatment, uniformly from the route's list.
  [[nodiscard]] std::optional<Treatment> draw(const RoutePolicy& route);
  // Records the assignment (trials file first, flushed); call before forwarding the request.
  void record_assignment(const RoutePolicy& route, const std::string& request_id, const Treatment& treatment,
                         audit::Trial covariates);

  // Appends the outcome record (with what was delivered) and finishes the trial in memory.
  void record_outcome(const std::string& request_id, const AuditOutcome& outcome);
  // Finished (2xx) trials delivered other than assigned, since start (not only those in memory).
  [[nodiscard]] std::size_t delivery_differing() const;

  // The in-memory trials analysed like `kvrelay audit analyze` (Welch: online trials are unpaired).
  [[nodiscard]] nlohmann::json report(const audit::AnalysisOptions& options) const;
  [[nodiscard]] audit::TrialSet snapshot() const;

 private:
  void append_line(const std::string& path, const std::string& line);

  std::size_t max_trials_;
  mutable std::mutex mutex_;
  std::mt19937_64 generator_;
  std::map<std::string, std::pair<audit::Trial, std::string>> pending_;  // request id -> trial, trials file
  std::vector<audit::Trial> finished_;
  std::size_t dropped_ = 0;
  std::size_t failed_ = 0;
  std::size_t differing_ = 0;
  std::map<std::string, std::unique_ptr<std::ofstream>> files_;
};

// Reads the flat `"kvrelay": {...}` stats object a reference worker puts at the end of a
// response (the JSON body or the last SSE event) from the response's tail; nullopt otherwise.
[[nodiscard]] std::optional<nlohmann::json> worker_stats_from_tail(std::string_view tail);

}  // namespace kvrelay::proxy
