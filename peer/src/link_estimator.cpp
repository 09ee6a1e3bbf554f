#include "kvrelay/peer/link_estimator.h"

#include <algorithm>
#include <vector>

namespace kvrelay::peer {

namespace {

constexpr std::uint64_t kMinBandwidthSampleBytes = 64 * 1024;

}  // namespace

void LinkEstimator::add_rtt(const std::string& peer, std::chrono::microseconds rtt) {
  std::lock_guard lock(mutex_);
  auto& samples = peers_[peer].rtts;
  samples.push_back(rtt);
  while (samples.size() > window_)
    samples.pop_front();
}

void LinkEstimator::add_transfer(const std::string& peer, std::uint64_t bytes, std::chrono::microseconds elapsed) {
  if (bytes < kMinBandwidthSampleBytes || elapsed.count() <= 0) return;
  std::lock_guard lock(mutex_);
  auto& samples = peers_[peer].transfers;
  samples.emplace_back(bytes, elapsed);
  while (samples.size() > window_)
    samples.pop_front();
}

std::optional<LinkEstimate> LinkEstimator::estimate(const std::string& peer) const {
  std::lock_guard lock(mutex_);
  const auto found = peers_.find(peer);
  if (found == peers_.end()) return std::nullopt;
  LinkEstimate estimate;
  const auto& samples = found->second;
  if (!samples.rtts.empty()) {
    std::vector<std::chrono::microseconds> sorted(samples.rtts.begin(), samples.rtts.end());
    std::nth_element(sorted.begin(), sorted.begin() + static_cast<std::ptrdiff_t>(sorted.size() / 2), sorted.end());
    estimate.rtt = sorted[sorted.size() / 2];
    estimate.rtt_samples = sorted.size();
  }
  std::uint64_t bytes = 0;
  std::chrono::microseconds elapsed{0};
  for (const auto& [sample_bytes, sample_time] : samples.transfers) {
    bytes += sample_bytes;
    elapsed += sample_time;
  }
  if (elapsed.count() > 0) {
    estimate.throughput_bytes_per_s = static_cast<double>(bytes) * 1e6 / static_cast<double>(elapsed.count());
  }
  estimate.transfer_samples = samples.transfers.size();
  return estimate;
}

}  // namespace kvrelay::peer
