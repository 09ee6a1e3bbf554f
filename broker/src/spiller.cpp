#include "kvrelay/broker/spiller.h"

#include <fmt/format.h>
#include <spdlog/spdlog.h>

#include <algorithm>
#include <chrono>
#include <random>

#include "kv_media.h"

namespace kvrelay::broker {

namespace {

using SpillClock = std::chrono::steady_clock;

std::string key_hex(const kv_store::EntryKey& key) {
  return fmt::format("{:016x}:{:016x}", key.model_id, key.context_hash);
}

}  // namespace

std::optional<std::string> choose_spill_target(
    const Policy& policy, std::uint64_t bytes,
    const std::function<std::optional<peer::NodeState>(const std::string&)>& state_of) {
  std::optional<std::string> best;
  std::uint64_t best_free = 0;
  for (const auto& peer : policy.peers) {
    if (peer.accept_spill_bytes == 0) continue;
    const auto state = state_of(peer.id);
    // Its own quota for this node, as it reported it: a peer not heard from yet is not asked.
    if (!state || state->spill_accept_left < bytes) continue;
    const std::uint64_t free = state->store_budget > state->store_used ? state->store_budget - state->store_used : 0;
    if (!best || free > best_free) {
      best = peer.id;
      best_free = free;
    }
  }
  return best;
}

Spiller::Spiller(std::shared_ptr<PolicySource> policy, std::shared_ptr<kv_store::EntryStore> store,
                 std::shared_ptr<const codec::CodecRegistry> codecs, std::shared_ptr<PeerLinks> peers,
                 metrics::Registry& registry, DecisionLog& log)
    : policy_(std::move(policy)),
      store_(std::move(store)),
      codecs_(std::move(codecs)),
      peers_(std::move(peers)),
      log_(log),
      spills_(registry.counter("kvrelay_kv_spills_total",
                               "Store victims spilled to a peer, by peer and outcome (spilled, failed, no_target)",
                               {"peer", "outcome"})),
      spill_bytes_(
          registry.counter("kvrelay_kv_spill_bytes_total", "Encoded bytes of spills pushed, by peer", {"peer"})) {}

Spiller::~Spiller() {
  stop();
}

void Spiller::start() {
  std::lock_guard lock(mutex_);
  if (worker_.joinable() || stopping_) return;
  worker_ = std::thread([this] { run(); });
}

void Spiller::stop() {
  std::deque<Job> abandoned;
  {
    std::lock_guard lock(mutex_);
    stopping_ = true;
    abandoned.swap(queue_);
  }
  wake_.notify_all();
  if (worker_.joinable()) worker_.join();
  for (const auto& job : abandoned)
    finish(job, {}, false);
}

bool Spiller::wants(const kv_store::EntryKey& /*key*/, const kv_store::StoredEntry& entry,
                    std::optional<double> utility) {
  const auto policy = policy_->current();
  const auto& settings = policy->kv_store;
  // Without a utility (LRU eviction) every victim qualifies; a peer checks a spill's token ids,
  // so KV published without them stays here.
  if (utility && *utility < settings.spill_min_utility) return false;
  if (!entry.chain || entry.info.layout.layers == 0 || !policy->any_peer_accepts_spills()) return false;
  // Lossy KV through a lossless codec would be filed as exact at the peer: such victims go.
  const auto codec = codec_for_medium(settings.spill_medium);
  if (!codec || (!entry.fidelity.is_exact() && codec::fidelity_of(*codecs_, *codec).is_exact())) return false;
  std::uint64_t held = in_flight_bytes_.load();
  do {
    if (held + entry.info.bytes > settings.spill_inflight_bytes) return false;
  } while (!in_flight_bytes_.compare_exchange_weak(held, held + entry.info.bytes));
  return true;
}

void Spiller::offer(const kv_store::EntryKey& key, std::shared_ptr<const kv_store::StoredEntry> entry) {
  Job job{key, std::move(entry)};
  {
    std::lock_guard lock(mutex_);
    if (!stopping_) {
      queue_.push_back(std::move(job));
      wake_.notify_one();
      return;
    }
  }
  finish(job, {}, false);
}

void Spiller::run() {
  while (true) {
    Job job;
    {
      std::unique_lock lock(mutex_);
      wake_.wait(lock, [this] { return stopping_ || !queue_.empty(); });
      if (queue_.empty()) return;
      job = std::move(queue_.front());
      queue_.pop_front();
    }
    spill(job);
  }
}

void Spiller::spill(const Job& job) {
  const auto policy = policy_->current();
  const auto started = SpillClock::now();
  const kv_store::StoredEntry& entry = *job.entry;
  nlohmann::json record{{"kind", "spill"},
                        {"time_unix_ms", std::chrono::duration_cast<std::chrono::milliseconds>(
                                             std::chrono::system_clock::now().time_since_epoch())
                                             .count()},
                        {"key", key_hex(job.key)},
                        {"bytes", entry.info.bytes},
                        {"tokens", entry.info.layout.tokens},
                        {"medium", policy->kv_store.spill_medium}};
  const auto target =
      choose_spill_target(*policy, entry.info.bytes, [this](const std::string& peer) -> std::optional<peer::NodeState> {
        auto state = peers_->node_state(peer);
        if (!state) return state;
        QuotaMark& mark = quota_marks_[peer];
        if (mark.reported_left != state->spill_accept_left) mark = {state->spill_accept_left, 0};
        state->spill_accept_left -= std::min(state->spill_accept_left, mark.sent_since);
        return state;
      });
  if (!target) {
    record["outcome"] = "no_target";
    record["reason"] = "no peer with accept_spill_bytes reported room for it";
    spills_.with({"", "no_target"}).inc();
    log_.record(std::move(record));
    finish(job, {}, false);
    return;
  }
  record["peer"] = *target;
  const auto codec = codec_for_medium(policy->kv_store.spill_medium);
  auto frame =
      codec
          ? encode_entry(*codecs_, *codec, entry)
          : Result<std::vector<std::uint8_t>>(fail(
                ErrorCode::kUnknownCodec, fmt::format("spill medium {} has no codec", policy->kv_store.spill_medium)));
  peer::PushOptions options;
  options.purpose = peer::PushPurpose::kSpill;
  options.source = entry.fidelity;
  options.codec = codec.value_or("");
  const Status pushed = frame ? peers_->push(*target, options, std::random_device{}(), job.key, *entry.chain,
                                             frame.value(), policy->limits.read_timeout)
                              : Status(frame.error());
  record["seconds"] = std::chrono::duration<double>(SpillClock::now() - started).count();
  if (pushed) {
    record["outcome"] = "spilled";
    record["frame_bytes"] = frame.value().size();
    spill_bytes_.with({*target}).inc(static_cast<double>(frame.value().size()));
    quota_marks_[*target].sent_since += entry.info.bytes;
  } else {
    record["outcome"] = "failed";
    record["error"] = pushed.error().to_string();
    spdlog::warn("KV store: spill of {} bytes to {} failed, the entry is dropped: {}", entry.info.bytes, *target,
                 pushed.error().to_string());
  }
  spills_.with({*target, pushed ? "spilled" : "failed"}).inc();
  log_.record(std::move(record));
  finish(job, *target, static_cast<bool>(pushed), codec.value_or(""));
}

void Spiller::finish(const Job& job, const std::string& peer, bool ok, const std::string& codec) {
  in_flight_bytes_.fetch_sub(job.entry->info.bytes);
  store_->spill_done(job.key, peer, ok, codec);
}

}  // namespace kvrelay::broker
