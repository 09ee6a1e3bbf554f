#include "kvrelay/refworker/model_worker.h"

#include <fmt/format.h>
#include <spdlog/spdlog.h>

#include <cstring>

namespace kvrelay::refworker {

namespace {

using Clock = std::chrono::steady_clock;

double ms_between(Clock::time_point from, Clock::time_point to) {
  return std::chrono::duration<double, std::milli>(to - from).count();
}

// K and V, every layer, fp32: what one token's KV occupies in the worker's cache.
std::uint64_t kv_bytes_per_token(const ModelConfig& config) {
  return 2ULL * config.layers * config.kv_dim() * sizeof(float);
}

// Positions the runs keep, one per imported row.
std::vector<std::uint32_t> kept_positions(std::span<const TokenRun> runs) {
  std::vector<std::uint32_t> positions;
  positions.reserve(run_tokens(runs));
  for (const TokenRun& run : runs)
    for (std::uint32_t i = 0; i < run.length; ++i)
      positions.push_back(run.start + i);
  return positions;
}

// Loads what a lookup found into the empty `session`: a leading prefix; a span, after prefilling
// the prompt's tokens before it (their time goes to `span_prefill_ms`); or sparse KV.
Status import_prefix(InferenceSession& session, std::span<const std::int32_t> prompt, const KvPrefix& prefix,
                     double& span_prefill_ms) {
  if (!prefix.kept.empty()) {
    if (prefix.context_tokens > prompt.size()) {
      return fail(ErrorCode::kOutOfRange,
                  fmt::format("sparse KV of {} positions for a {}-token prompt", prefix.context_tokens, prompt.size()));
    }
    const auto positions = kept_positions(prefix.kept);
    if (prefix.read) return session.import_sparse_kv(prefix.layout, positions, prefix.context_tokens, prefix.read);
    return session.import_sparse_kv(prefix.layout, positions, prefix.context_tokens,
                                    [&prefix](std::uint64_t offset, std::span<float> into) -> Status {
                                      if (!into.empty()) {
                                        std::memcpy(into.data(), prefix.kv.data() + offset, into.size_bytes());
                                      }
                                      return ok();
                                    });
  }
  if (prefix.start_tokens + prefix.layout.tokens > prompt.size()) {
    return fail(ErrorCode::kOutOfRange, fmt::format("KV of tokens {}..{} for a {}-token prompt", prefix.start_tokens,
                                                    prefix.start_tokens + prefix.layout.tokens, prompt.size()));
  }
  if (prefix.start_tokens > 0) {
    const auto began = Clock::now();
    KVRELAY_TRY(session.prefill(prompt.first(prefix.start_tokens)));
    span_prefill_ms = ms_between(began, Clock::now());
  }
  return prefix.read ? session.import_kv(prefix.layout, prefix.read) : session.import_kv(prefix.layout, prefix.kv);
}

}  // namespace

ModelWorker::ModelWorker(const Model& model, KvConnector& connector, WorkerMetrics& metrics, std::uint32_t max_waiting,
                         std::size_t kv_cache_tokens)
    : model_(model),
      connector_(connector),
      metrics_(metrics),
      max_waiting_(max_waiting),
      kv_cache_(model.config().layers, model.config().kv_dim()) {
  if (auto reserved = kv_cache_.reserve(kv_cache_tokens, 0); !reserved) {
    spdlog::warn("no pre-allocated KV cache, sessions allocate their own: {}", reserved.error().to_string());
  }
  report_kv_held(0);
  thread_ = std::thread([this] { run(); });
}

void ModelWorker::report_kv_held(std::uint64_t tokens) {
  const auto per_token = kv_bytes_per_token(model_.config());
  metrics_.set_kv_cache(tokens * per_token, model_.config().seq_len * per_token);
}

ModelWorker::~ModelWorker() {
  stop();
}

Status ModelWorker::submit(CompletionJob job) {
  std::lock_guard lock(mutex_);
  if (stopping_) return fail(ErrorCode::kCancelled, "worker is shutting down");
  if (queue_.size() >= max_waiting_) {
    return fail(ErrorCode::kResourceExhausted, fmt::format("{} requests already waiting", queue_.size()));
  }
  queue_.push_back(std::move(job));
  metrics_.set_waiting(queue_.size());
  wake_.notify_one();
  return ok();
}

void ModelWorker::stop() {
  std::deque<CompletionJob> abandoned;
  {
    std::lock_guard lock(mutex_);
    if (stopping_ && !thread_.joinable()) return;
    stopping_ = true;
    abandoned.swap(queue_);
    metrics_.set_waiting(0);
    wake_.notify_all();
  }
  for (auto& job : abandoned)
    job.on_done(fail(ErrorCode::kCancelled, "worker shut down before the request ran"));
  if (thread_.joinable()) thread_.join();
}

void ModelWorker::run() {
  for (;;) {
    CompletionJob job;
    {
      std::unique_lock lock(mutex_);
      wake_.wait(lock, [this] { return stopping_ || !queue_.empty(); });
      if (queue_.empty()) return;
      job = std::move(queue_.front());
      queue_.pop_front();
      metrics_.set_waiting(queue_.size());
    }
    metrics_.set_running(1);
    auto outcome = serve(job);
    report_kv_held(0);  // the session is gone: its rows are free for the next request
    metrics_.set_running(0);
    if (outcome) {
      metrics_.add_request(outcome.value().stats.prompt_tokens, outcome.value().generation.tokens.size(),
                           outcome.value().stats.cached_tokens,
                           finish_reason_name(outcome.value().generation.finish_reason));
    } else {
      metrics_.add_request(0, 0, 0, "");
    }
    job.on_done(std::move(outcome));
  }
}

Result<CompletionOutcome> ModelWorker::serve(CompletionJob& job) {
  const auto& request = job.request;
  const std::span<const std::int32_t> prompt(request.prompt);
  CompletionOutcome outcome;
  auto& stats = outcome.stats;
  stats.prompt_tokens = prompt.size();
  const auto started = Clock::now();
  stats.queue_ms = ms_between(job.arrival, started);

  InferenceSession session(model_, kv_cache_);
  Fidelity imported_fidelity = Fidelity::exact();
  std::uint64_t imported_tokens = 0;
  std::vector<std::int32_t> computed_before;  // a span's leading tokens, prefilled before its import
  double span_prefill_ms = 0.0;
  // A connector failure or an unusable prefix is a miss: the request still gets served.
  auto found = connector_.lookup(prompt, request.kvrelay_params);
  const auto looked_up = Clock::now();
  stats.lookup_ms = ms_between(started, looked_up);
  if (!found) {
    spdlog::warn("kv lookup failed, prefilling everything: {}", found.error().to_string());
  } else if (found.value() && found.value()->layout.tokens > 0) {
    KvPrefix& prefix = *found.value();
    auto imported = import_prefix(session, prompt, prefix, span_prefill_ms);
    if (!imported) {
      spdlog::warn("kv import rejected, prefilling everything: {}", imported.error().to_string());
      session = InferenceSession(model_, kv_cache_);
    } else {
      imported_fidelity = prefix.fidelity;
      imported_tokens = prefix.layout.tokens;
      computed_before.assign(prompt.begin(), prompt.begin() + static_cast<std::ptrdiff_t>(prefix.start_tokens));
      if (session.position() == prompt.size()) {
        // The whole prompt is cached, but the first token needs the last position's logits:
        // recompute that one token, as vLLM does on a full prefix hit.
        KVRELAY_TRY(session.truncate(prompt.size() - 1));
        --imported_tokens;
      }
    }
  }
  report_kv_held(session.cached_rows());
  const Fidelity session_fidelity = computed_fidelity(imported_fidelity, session.position());
  stats.import_ms = ms_between(looked_up, Clock::now()) - span_prefill_ms;
  stats.cached_tokens = imported_tokens;
  const auto rest = prompt.subspan(session.position());
  std::vector<std::int32_t> computed(computed_before);
  computed.insert(computed.end(), rest.begin(), rest.end());
  stats.prefill_tokens = computed.size();

  const auto prefill_start = Clock::now();
  KVRELAY_TRY(auto logits, session.prefill(rest));
  const auto prefill_end = Clock::now();
  stats.prefill_ms = ms_between(prefill_start, prefill_end) + span_prefill_ms;
  report_kv_held(session.cached_rows());
  connector_.report_prefill(computed, prompt.size(), stats.prefill_ms / 1000.0, request.kvrelay_params);

  bool first = true;
  Clock::time_point previous_token;
  auto on_token = [&](std::int32_t token) {
    const auto now = Clock::now();
    if (first) {
      first = false;
      stats.ttft_ms = ms_between(job.arrival, now);
      metrics_.observe_ttft(stats.ttft_ms / 1000.0);
    } else {
      metrics_.observe_time_per_output_token(ms_between(previous_token, now) / 1000.0);
    }
    previous_token = now;
    report_kv_held(session.cached_rows());
    return !job.on_token || job.on_token(token);
  };
  KVRELAY_TRY(outcome.generation, generate(session, logits, request.generation, on_token));

  // The session holds the KV of the prompt and of every generated token but the last.
  std::vector<std::int32_t> context(request.prompt);
  context.insert(context.end(), outcome.generation.tokens.begin(), outcome.generation.tokens.end());
  context.resize(session.position());
  if (session.sparse()) {
    // Its KV attended over some of A's positions only: no chain prefix of this context.
    spdlog::debug("not publishing the KV of a request served position-sparse KV");
    stats.total_ms = ms_between(job.arrival, Clock::now());
    return outcome;
  }
  if (!connector_.wants_publish()) {
    stats.total_ms = ms_between(job.arrival, Clock::now());
    return outcome;
  }
  auto kv = session.export_kv(session.position());
  if (!kv) {
    spdlog::warn("kv export failed: {}", kv.error().to_string());
  } else if (auto published = connector_.publish(context, session.layout(context.size()), kv.value(),
                                                 request.kvrelay_params, session_fidelity, prompt.size());
             !published) {
    spdlog::warn("kv publish failed: {}", published.error().to_string());
  } else {
    stats.published_tokens = context.size();
  }
  stats.total_ms = ms_between(job.arrival, Clock::now());
  return outcome;
}

}  // namespace kvrelay::refworker
