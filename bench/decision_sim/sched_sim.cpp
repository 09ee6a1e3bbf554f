#include "sched_sim.h"

#include <cstddef>
#include <random>
#include <string>
#include <vector>

#include "kvrelay/decision/link_scheduler.h"

#include "sim_stats.h"

namespace kvrelay::sim {

namespace {

using decision::LinkScheduler;
using decision::SchedulerConfig;
using decision::SchedulerMode;
using decision::TransferSpec;

constexpr double kSchedLinkBytesPerS = 1.25e9;      // 10 Gbit/s
constexpr std::uint64_t kUrgentBytes = 1ULL << 20;  // a short context's KV
constexpr std::uint64_t kBulkBytes = 64ULL << 20;   // a long context moving in the background
constexpr double kUrgentPerS = 100.0;               // about 8% of the link
constexpr std::size_t kUrgentTransfers = 2000;      // 20 s of simulated time
constexpr std::uint64_t kBulkIdBase = 1ULL << 32;   // bulk ids never meet urgent ones
constexpr int kUrgentPriority = 7;                  // role priorities of both agents and the route's

struct SchedRun {
  std::vector<double> urgent_delay_s;  // completion - arrival, per urgent transfer
  std::uint64_t bulk_bytes = 0;
  std::uint64_t bulk_completed = 0;
  double simulated_s = 0.0;
  std::uint64_t preemptions = 0;
  std::uint64_t resumes = 0;
};

TransferSpec urgent_spec(std::uint64_t id) {
  TransferSpec spec;
  spec.id = id;
  spec.bytes = kUrgentBytes;
  spec.src_priority = kUrgentPriority;
  spec.dst_priority = kUrgentPriority;
  spec.route_priority = kUrgentPriority;
  return spec;
}

TransferSpec bulk_spec(std::uint64_t id) {
  TransferSpec spec;
  spec.id = id;
  spec.bytes = kBulkBytes;
  return spec;
}

// Poisson arrivals: the same instants for every mode.
std::vector<double> urgent_arrivals(std::uint64_t seed) {
  std::mt19937_64 rng(seed * 7919 + 17);
  std::exponential_distribution<double> gap(kUrgentPerS);
  std::vector<double> at(kUrgentTransfers);
  double t = 0.05;  // the bulk transfers have the link first
  for (double& a : at) {
    t += gap(rng);
    a = t;
  }
  return at;
}

// Transfers arriving between chunks are submitted at the next chunk boundary, as the daemon's
// gate sees them: grants are only ever decided there.
SchedRun simulate_link(SchedulerMode mode, std::size_t bulk_in_flight, const std::vector<double>& arrivals) {
  SchedulerConfig config;  // the policy's defaults: 256 KiB chunks, 10 ms slices, window 4
  config.mode = mode;
  config.link_bytes_per_s = kSchedLinkBytesPerS;
  LinkScheduler link(config);
  SchedRun run;
  std::uint64_t next_bulk = kBulkIdBase;
  for (std::size_t i = 0; i < bulk_in_flight; ++i)
    (void)link.submit(bulk_spec(next_bulk++), 0.0);
  std::size_t next = 0;
  std::size_t done = 0;
  while (done < arrivals.size()) {
    while (next < arrivals.size() && arrivals[next] <= link.now()) {
      (void)link.submit(urgent_spec(next), link.now());
      ++next;
    }
    if (link.queued() == 0) {
      link.advance_to(arrivals[next]);
      continue;
    }
    const auto chunk = link.step();
    if (!chunk) break;  // not reached: something is queued
    if (chunk->transfer >= kBulkIdBase) {
      run.bulk_bytes += chunk->bytes;
      if (chunk->completed) {
        ++run.bulk_completed;
        (void)link.submit(bulk_spec(next_bulk++), link.now());
      }
    } else if (chunk->completed) {
      run.urgent_delay_s.push_back(chunk->end_s - arrivals[chunk->transfer]);
      ++done;
    }
  }
  run.simulated_s = link.now();
  run.preemptions = link.stats().preemptions;
  run.resumes = link.stats().resumes;
  return run;
}

nlohmann::json describe_run(const SchedRun& run) {
  const auto ms = [&](double q) { return 1e3 * sim_quantile(run.urgent_delay_s, q); };
  return {
      {"urgent_p50_ms", ms(0.5)},
      {"urgent_p99_ms", ms(0.99)},
      {"urgent_max_ms", ms(1.0)},
      {"bulk_gbit_per_s", run.simulated_s > 0 ? 8e-9 * static_cast<double>(run.bulk_bytes) / run.simulated_s : 0.0},
      {"bulk_completed", run.bulk_completed},
      {"preemptions", run.preemptions},
      {"resumes", run.resumes},
      {"simulated_s", run.simulated_s},
  };
}

}  // namespace

nlohmann::json run_scheduler_comparison(std::uint64_t seed) {
  const std::vector<double> arrivals = urgent_arrivals(seed);
  const SchedRun idle = simulate_link(SchedulerMode::kWrr, 0, arrivals);
  const double idle_p99 = sim_quantile(idle.urgent_delay_s, 0.99);
  const SchedulerConfig defaults;
  nlohmann::json loads = nlohmann::json::array();
  // The bulk transfers always queued: each finished one is replaced at once.
  for (const std::size_t bulk_in_flight : {std::size_t{1}, std::size_t{2}}) {
    const SchedRun wrr = simulate_link(SchedulerMode::kWrr, bulk_in_flight, arrivals);
    const SchedRun fifo = simulate_link(SchedulerMode::kFifo, bulk_in_flight, arrivals);
    const double wrr_p99 = sim_quantile(wrr.urgent_delay_s, 0.99);
    const double fifo_p99 = sim_quantile(fifo.urgent_delay_s, 0.99);
    loads.push_back({
        {"bulk_in_flight", bulk_in_flight},
        {"wrr", describe_run(wrr)},
        {"fifo", describe_run(fifo)},
        {"wrr_p99_over_idle", wrr_p99 / idle_p99},
        {"wrr_p99_over_fifo", wrr_p99 / fifo_p99},
        // The design's bound: an urgent transfer waits at most the rest of the running one's slice.
        {"goals",
         {{"wrr_p99_within_one_slice_of_idle", wrr_p99 <= idle_p99 + defaults.time_slice_s},
          {"wrr_p99_at_most_quarter_of_fifo", wrr_p99 <= 0.25 * fifo_p99}}},
    });
  }
  return {
      {"what",
       "decision::LinkScheduler::step() on a virtual 10 Gbit/s link: bulk 64 MiB transfers (priority 0) always "
       "queued, urgent 1 MiB transfers (role and route priority 7) arriving as a Poisson process"},
      {"link_gbit_per_s", 8e-9 * kSchedLinkBytesPerS},
      {"chunk_bytes", defaults.chunk_bytes},
      {"time_slice_ms", 1e3 * defaults.time_slice_s},
      {"urgent_transfers", arrivals.size()},
      {"urgent_per_s", kUrgentPerS},
      {"physical_limit_ms", 1e3 * static_cast<double>(kUrgentBytes) / kSchedLinkBytesPerS},
      {"idle_link", describe_run(idle)},
      {"loads", loads},
  };
}

}  // namespace kvrelay::sim
