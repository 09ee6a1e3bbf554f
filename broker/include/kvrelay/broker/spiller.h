#pragma once

// The store's spill sink (issue #27). A budget victim worth keeping (utility at least
// kv_store.spill_min_utility) is encoded with kv_store.spill_medium's codec and pushed, as a
// transfer of no route (the link scheduler's lowest normal weight), to the peer with the most free store among those
// that take spills: its policy entry has accept_spill_bytes, and its last summary says it would take this many bytes
// from this node. The store keeps a stub; a lookup that meets it fetches the entry back from
// that peer through the normal fetch stage. At most kv_store.spill_inflight_bytes of victims wait
// at once; others are dropped as before. One thread, started by the daemon.

#include <atomic>
#include <condition_variable>
#include <cstdint>
#include <deque>
#include <functional>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <thread>
#include <unordered_map>

#include "kvrelay/broker/decision_log.h"
#include "kvrelay/broker/peer_links.h"
#include "kvrelay/broker/policy_source.h"
#include "kvrelay/codec_plugins/registry.h"
#include "kvrelay/core/metrics.h"
#include "kvrelay/kv_store/entry_store.h"

namespace kvrelay::broker {

// Where a spill of `bytes` goes: of the policy's peers with accept_spill_bytes, those whose last
// reported state would take `bytes` from this node, the one with the most free store; nullopt
// when none would. `state_of`: a peer's last reported NodeState (PeerLinks::node_state).
[[nodiscard]] std::optional<std::string> choose_spill_target(
    const Policy& policy, std::uint64_t bytes,
    const std::function<std::optional<peer::NodeState>(const std::string&)>& state_of);

class Spiller final : public kv_store::SpillSink {
 public:
  Spiller(std::shared_ptr<PolicySource> policy, std::shared_ptr<kv_store::EntryStore> store,
          std::shared_ptr<const codec::CodecRegistry> codecs, std::shared_ptr<PeerLinks> peers,
          metrics::Registry& registry, DecisionLog& log);
  ~Spiller() override;
  Spiller(const Spiller&) = delete;
  Spiller& operator=(const Spiller&) = delete;

  void start();
  // Victims still queued fail (their stubs go); a push in progress finishes first.
  void stop();

  [[nodiscard]] bool wants(const kv_store::EntryKey& key, const kv_store::StoredEntry& entry,
                           std::optional<double> utility) override;
  void offer(const kv_store::EntryKey& key, std::shared_ptr<const kv_store::StoredEntry> entry) override;

 private:
  struct Job {
    kv_store::EntryKey key;
    std::shared_ptr<const kv_store::StoredEntry> entry;
  };
  void run();
  void spill(const Job& job);
  void finish(const Job& job, const std::string& peer, bool ok, const std::string& codec = {});

  std::shared_ptr<PolicySource> policy_;
  std::shared_ptr<kv_store::EntryStore> store_;
  std::shared_ptr<const codec::CodecRegistry> codecs_;
  std::shared_ptr<PeerLinks> peers_;
  DecisionLog& log_;
  metrics::Family<metrics::Counter>& spills_;       // {peer, outcome}
  metrics::Family<metrics::Counter>& spill_bytes_;  // {peer}: encoded bytes pushed
  std::atomic<std::uint64_t> in_flight_bytes_{0};
  // What this spiller pushed each peer since the quota its summary last reported changed (a
  // summary comes each peer_summary_interval; spills between two must not all assume the old
  // room). The spill thread's alone.
  struct QuotaMark {
    std::uint64_t reported_left = 0;
    std::uint64_t sent_since = 0;
  };
  std::unordered_map<std::string, QuotaMark> quota_marks_;

  std::mutex mutex_;
  std::condition_variable wake_;
  std::deque<Job> queue_;
  bool stopping_ = false;
  std::thread worker_;
};

}  // namespace kvrelay::broker
