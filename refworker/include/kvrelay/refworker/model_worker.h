#pragma once

#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <deque>
#include <functional>
#include <mutex>
#include <thread>

#include "kvrelay/core/result.h"
#include "kvrelay/refworker/completion_api.h"
#include "kvrelay/refworker/kv_cache.h"
#include "kvrelay/refworker/kv_connector.h"
#include "kvrelay/refworker/model.h"
#include "kvrelay/refworker/worker_metrics.h"

namespace kvrelay::refworker {

struct CompletionJob {
  CompletionRequest request;
  std::chrono::steady_clock::time_point arrival = std::chrono::steady_clock::now();
  // Both run on the model thread. on_token returning false cancels the request (client gone).
  std::function<bool(std::int32_t token)> on_token;
  std::function<void(Result<CompletionOutcome> outcome)> on_done;
};

// The one thread that runs the model. Requests are served one at a time in arrival order from
// a bounded queue, so vllm:num_requests_waiting counts real waiting requests and a request's
// prefill time is never inflated by another running alongside it.
class ModelWorker {
 public:
  // `kv_cache_tokens` rows of KV cache are allocated and written before the first request and
  // lent to every request's session (0: each session allocates its own as it grows).
  ModelWorker(const Model& model, KvConnector& connector, WorkerMetrics& metrics, std::uint32_t max_waiting,
              std::size_t kv_cache_tokens = 0);
  ~ModelWorker();
  ModelWorker(const ModelWorker&) = delete;
  ModelWorker& operator=(const ModelWorker&) = delete;

  // kResourceExhausted when max_waiting requests already wait; kCancelled after stop().
  [[nodiscard]] Status submit(CompletionJob job);

  // Finishes the running request, fails the waiting ones with kCancelled, joins the thread.
  void stop();

 private:
  void run();
  [[nodiscard]] Result<CompletionOutcome> serve(CompletionJob& job);
  // vllm:kv_cache_usage_perc: `tokens` rows held by the running session over the worker's KV
  // capacity, one session of seq_len tokens (requests run one at a time and a session refuses
  // to grow past seq_len, whatever --kv-cache-tokens pre-allocated).
  void report_kv_held(std::uint64_t tokens);

  const Model& model_;
  KvConnector& connector_;
  WorkerMetrics& metrics_;
  std::uint32_t max_waiting_;
  KvCache kv_cache_;
  std::mutex mutex_;
  std::condition_variable wake_;
  std::deque<CompletionJob> queue_;
  bool stopping_ = false;
  std::thread thread_;
};

}  // namespace kvrelay::refworker
