// decision_sim: discrete-event simulations that drive the real decision code. The decision part
// runs the DecisionEngine over workloads (agent chains, fan-out, fan-in, and all of them mixed)
// and compares it with fixed policies and an oracle that knows every transfer's true cost; the
// scheduler part runs LinkScheduler in WRR and FIFO mode on one loaded link (sched_sim.h); the
// store part runs the daemon's entry store with utility and LRU eviction (store_sim.h).
// Prints one JSON object.
//
//   decision_sim [--transfers N] [--seed S] [--parts decision,scheduler,store] [--check]
// --check: exit status 1 when a goal is missed (used by ctest).

#include <nlohmann/json.hpp>

#include <algorithm>
#include <chrono>
#include <cstdlib>
#include <fstream>
#include <iostream>
#include <map>
#include <numeric>
#include <string>
#include <thread>

#include "policies.h"
#include "sched_sim.h"
#include "store_sim.h"
#include "trace.h"

namespace {

using kvrelay::sim::PolicyRun;

double mean(const std::vector<double>& v) {
  return v.empty() ? 0.0 : std::accumulate(v.begin(), v.end(), 0.0) / static_cast<double>(v.size());
}

double p99(std::vector<double> v) {
  if (v.empty()) {
    return 0.0;
  }
  const auto index = static_cast<std::size_t>(0.99 * static_cast<double>(v.size() - 1));
  std::nth_element(v.begin(), v.begin() + static_cast<std::ptrdiff_t>(index), v.end());
  return v[index];
}

std::string cpu_model() {
  std::ifstream cpuinfo("/proc/cpuinfo");
  std::string line;
  while (std::getline(cpuinfo, line)) {
    if (line.rfind("model name", 0) == 0) {
      return line.substr(line.find(':') + 2);
    }
  }
  return "unknown";
}

// Other work on the host inflates timings; recorded so results can be read accordingly.
double load_average() {
  std::ifstream loadavg("/proc/loadavg");
  double one_minute = 0.0;
  loadavg >> one_minute;
  return one_minute;
}

nlohmann::json run_workload(const std::string& kind, std::size_t transfers, std::uint64_t seed) {
  const auto started = std::chrono::steady_clock::now();
  const kvrelay::sim::Workload w = kvrelay::sim::build_workload(kind, transfers, seed);
  std::vector<PolicyRun> runs;
  runs.push_back(kvrelay::sim::run_oracle(w));
  runs.push_back(kvrelay::sim::run_engine(w));
  runs.push_back(kvrelay::sim::run_always(w, "always_tokens", 0));
  runs.push_back(kvrelay::sim::run_always(w, "always_kv_raw", 1));
  runs.push_back(kvrelay::sim::run_always(w, "always_kv_int8", 4));
  runs.push_back(kvrelay::sim::run_threshold(w, 512));

  const double oracle_mean = mean(runs[0].latency_s);
  nlohmann::json policies = nlohmann::json::object();
  for (const PolicyRun& run : runs) {
    const double m = mean(run.latency_s);
    std::size_t agree = 0;
    for (std::size_t i = 0; i < run.chosen.size(); ++i) {
      agree += run.chosen[i] == runs[0].chosen[i] ? 1U : 0U;
    }
    policies[run.name] = {
        {"mean_s", m},
        {"p99_s", p99(run.latency_s)},
        {"regret_mean_s", m - oracle_mean},
        {"regret_pct", oracle_mean > 0 ? 100.0 * (m - oracle_mean) / oracle_mean : 0.0},
        {"switches", run.switches},
        {"same_choice_as_oracle_pct", 100.0 * static_cast<double>(agree) / static_cast<double>(run.chosen.size())},
    };
  }
  // Where the engine's regret comes from: (its choice, the oracle's choice) pairs.
  {
    const PolicyRun& engine = runs[1];
    std::map<std::string, std::pair<std::size_t, double>> pairs;
    for (std::size_t i = 0; i < engine.chosen.size(); ++i) {
      if (engine.chosen[i] != runs[0].chosen[i]) {
        auto& slot = pairs[w.true_media[static_cast<std::size_t>(engine.chosen[i])].name + " instead of " +
                           w.true_media[static_cast<std::size_t>(runs[0].chosen[i])].name];
        ++slot.first;
        slot.second += engine.latency_s[i] - runs[0].latency_s[i];
      }
    }
    nlohmann::json breakdown = nlohmann::json::object();
    for (const auto& [pair, stats] : pairs) {
      breakdown[pair] = {{"transfers", stats.first}, {"regret_s", stats.second}};
    }
    policies["kvrelay"]["regret_by_choice"] = breakdown;
  }
  const double engine_mean = policies["kvrelay"]["mean_s"];
  double best_fixed = 1e300;
  for (const char* name : {"always_tokens", "always_kv_raw", "always_kv_int8", "threshold_512"}) {
    best_fixed = std::min(best_fixed, policies[name]["mean_s"].get<double>());
  }
  const auto oracle_switches = policies["oracle"]["switches"].get<std::uint64_t>();
  const auto engine_switches = policies["kvrelay"]["switches"].get<std::uint64_t>();
  const nlohmann::json goals = {
      {"within_5pct_of_oracle", engine_mean <= 1.05 * oracle_mean},
      {"beats_every_fixed_policy", engine_mean < best_fixed},
      {"switches_at_most_2x_oracle", engine_switches <= 2 * oracle_switches},
  };
  return {
      {"workload", kind},
      {"transfers", w.transfers.size()},
      {"routes", w.routes.size()},
      {"links", w.links.size()},
      {"simulated_s", w.transfers.empty() ? 0.0 : w.transfers.back().time_s},
      {"policies", policies},
      {"goals", goals},
      {"wall_s", std::chrono::duration<double>(std::chrono::steady_clock::now() - started).count()},
  };
}

constexpr const char* kUsage =
    "usage: decision_sim [--transfers N] [--seed S] [--parts decision,scheduler,store] [--check]\n";

bool all_true(const nlohmann::json& goals) {
  for (const auto& met : goals) {
    if (!met.get<bool>()) return false;
  }
  return true;
}

}  // namespace

int main(int argc, char** argv) {
  std::size_t transfers = 40'000;
  std::uint64_t seed = 1;
  bool check = false;
  std::string parts = "decision,scheduler,store";
  for (int i = 1; i < argc; i += 2) {
    const std::string flag = argv[i];
    if (flag == "--check") {
      check = true;
      --i;
    } else if (i + 1 >= argc) {
      std::cerr << kUsage;
      return 2;
    } else if (flag == "--transfers") {
      transfers = std::strtoull(argv[i + 1], nullptr, 10);
    } else if (flag == "--seed") {
      seed = std::strtoull(argv[i + 1], nullptr, 10);
    } else if (flag == "--parts") {
      parts = argv[i + 1];
    } else {
      std::cerr << kUsage;
      return 2;
    }
  }
  const auto wanted = [&](const std::string& part) {
    return ("," + parts + ",").find("," + part + ",") != std::string::npos;
  };
  nlohmann::json out;
  out["bench"] = "decision_sim";
  out["machine"] = {{"cpu", cpu_model()},
                    {"hardware_threads", std::thread::hardware_concurrency()},
                    {"load_average_1m", load_average()}};
  out["seed"] = seed;
  bool all_goals = true;
  if (wanted("decision")) {
    bool decision_goals = true;
    out["physical_limit"] = "oracle: per-transfer argmin of the true costs (zero regret by definition)";
    for (const char* kind : {"chain_shm", "fanout_10g", "fanin_1g", "mixed"}) {
      nlohmann::json result = run_workload(kind, transfers, seed);
      const bool mixed = std::string(kind) == "mixed";
      const auto& g = result["goals"];
      decision_goals = decision_goals && g["within_5pct_of_oracle"].get<bool>() &&
                       g["switches_at_most_2x_oracle"].get<bool>() &&
                       (!mixed || g["beats_every_fixed_policy"].get<bool>());
      out["workloads"].push_back(std::move(result));
    }
    out["decision_goals_met"] = decision_goals;
    all_goals = all_goals && decision_goals;
  }
  if (wanted("scheduler")) {
    const auto started = std::chrono::steady_clock::now();
    out["scheduler"] = kvrelay::sim::run_scheduler_comparison(seed);
    out["scheduler"]["wall_s"] = std::chrono::duration<double>(std::chrono::steady_clock::now() - started).count();
    bool scheduler_goals = true;
    for (const auto& load : out["scheduler"]["loads"])
      scheduler_goals = scheduler_goals && all_true(load["goals"]);
    out["scheduler_goals_met"] = scheduler_goals;
    all_goals = all_goals && scheduler_goals;
  }
  if (wanted("store")) {
    const auto started = std::chrono::steady_clock::now();
    out["store"] = kvrelay::sim::run_store_comparison(seed);
    out["store"]["wall_s"] = std::chrono::duration<double>(std::chrono::steady_clock::now() - started).count();
    out["store_goals_met"] = all_true(out["store"]["goals"]);
    all_goals = all_goals && out["store_goals_met"].get<bool>();
  }
  out["all_goals_met"] = all_goals;
  std::cout << out.dump(2) << '\n';
  return check && !all_goals ? 1 : 0;
}
