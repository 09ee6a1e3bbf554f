#pragma once

// Windowed link estimates (RTT, throughput) per peer, fed by probes and finished transfers and
// read by the decision engine through LinkEstimateSource. Windowed rather than instantaneous
// so that one slow transfer does not flip a route's medium.

#include <chrono>
#include <cstdint>
#include <deque>
#include <map>
#include <mutex>
#include <optional>
#include <string>

namespace kvrelay::peer {

struct LinkEstimate {
  std::chrono::microseconds rtt{0};   // median of the window
  double throughput_bytes_per_s = 0;  // total bytes / total time of the windowed transfers
  std::size_t rtt_samples = 0;
  std::size_t transfer_samples = 0;
};

class LinkEstimateSource {
 public:
  virtual ~LinkEstimateSource() = default;
  [[nodiscard]] virtual std::optional<LinkEstimate> estimate(const std::string& peer) const = 0;
};

class LinkEstimator final : public LinkEstimateSource {
 public:
  explicit LinkEstimator(std::size_t window = 16) : window_(window == 0 ? 1 : window) {}
  void add_rtt(const std::string& peer, std::chrono::microseconds rtt);
  // Transfers too small to say anything about bandwidth (< 64 KiB) only count as RTT-bound.
  void add_transfer(const std::string& peer, std::uint64_t bytes, std::chrono::microseconds elapsed);
  [[nodiscard]] std::optional<LinkEstimate> estimate(const std::string& peer) const override;

 private:
  struct Samples {
    std::deque<std::chrono::microseconds> rtts;
    std::deque<std::pair<std::uint64_t, std::chrono::microseconds>> transfers;
  };
  std::size_t window_;
  mutable std::mutex mutex_;
  std::map<std::string, Samples, std::less<>> peers_;
};

}  // namespace kvrelay::peer
