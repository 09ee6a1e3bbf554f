// The model thread's connector contract, exercised in-process with a connector that keeps
// published KV in memory and hands back the longest published prefix: what any KvConnector
// implementation (the sidecar client included) relies on the worker to do.

#include "kvrelay/refworker/model_worker.h"

#include <catch2/catch.hpp>

#include <future>
#include <map>

#include "skip.h"
#include "support/test_paths.h"

namespace kr = kvrelay::refworker;

namespace {

class PrefixStoreConnector final : public kr::KvConnector {
 public:
  explicit PrefixStoreConnector(const kr::Model& model) : model_(model) {}

  kvrelay::Result<std::optional<kr::KvPrefix>> lookup(std::span<const std::int32_t> tokens,
                                                      const nlohmann::json& params) override {
    lookup_params.push_back(params);
    std::optional<kr::KvPrefix> best;
    for (const auto& [stored_tokens, kv] : store) {
      const std::size_t n = std::min(stored_tokens.size(), tokens.size());
      std::size_t common = 0;
      while (common < n && stored_tokens[common] == tokens[common])
        ++common;
      if (common == 0 || (best && best->layout.tokens >= common)) continue;
      // Slice the first `common` tokens out of the stored KvLayout buffer.
      kr::KvPrefix prefix;
      prefix.layout = model_.fingerprint().layout(common);
      const auto full = model_.fingerprint().layout(stored_tokens.size());
      const std::size_t rows = common * model_.config().kv_dim();
      for (std::uint32_t layer = 0; layer < full.layers; ++layer) {
        for (bool is_value : {false, true}) {
          const auto offset = full.tensor_offset(layer, is_value).value() / sizeof(float);
          prefix.kv.insert(prefix.kv.end(), kv.begin() + static_cast<std::ptrdiff_t>(offset),
                           kv.begin() + static_cast<std::ptrdiff_t>(offset + rows));
        }
      }
      best = std::move(prefix);
    }
    return best;
  }

  kvrelay::Status publish(std::span<const std::int32_t> tokens, const kvrelay::KvLayout& layout,
                          std::span<const float> kv, const nlohmann::json&, const kvrelay::Fidelity&,
                          std::uint64_t /*prompt_tokens*/) override {
    // Runs on the model thread: record, assert later on the test thread (Catch2 is not thread-safe).
    if (layout.tokens != tokens.size() || kv.size_bytes() != layout.total_bytes().value()) bad_publish = true;
    store[std::vector<std::int32_t>(tokens.begin(), tokens.end())] = std::vector<float>(kv.begin(), kv.end());
    return kvrelay::ok();
  }

  void report_prefill(std::span<const std::int32_t> computed, std::uint64_t context, double seconds,
                      const nlohmann::json& /*params*/) override {
    prefills.push_back({computed.size(), context});
    if (seconds < 0.0) bad_prefill_report = true;
  }

  std::map<std::vector<std::int32_t>, std::vector<float>> store;
  std::vector<std::pair<std::size_t, std::uint64_t>> prefills;
  std::vector<nlohmann::json> lookup_params;
  bool bad_publish = false;
  bool bad_prefill_report = false;

 private:
  const kr::Model& model_;
};

kr::CompletionOutcome run(kr::ModelWorker& worker, std::vector<std::int32_t> prompt, std::uint32_t max_tokens,
                          nlohmann::json params = nullptr) {
  std::promise<kvrelay::Result<kr::CompletionOutcome>> done;
  kr::CompletionJob job;
  job.request.prompt = std::move(prompt);
  job.request.generation.max_tokens = max_tokens;
  job.request.generation.stop_at_eos = false;
  job.request.kvrelay_params = std::move(params);
  job.on_done = [&done](kvrelay::Result<kr::CompletionOutcome> outcome) { done.set_value(std::move(outcome)); };
  REQUIRE(worker.submit(std::move(job)));
  auto outcome = done.get_future().get();
  REQUIRE(outcome);
  return outcome.value();
}

}  // namespace

TEST_CASE("refworker worker: B's request reuses A's published KV and prefills only the follow-up",
          "[refworker][worker]") {
  const auto path = kvrelay::test::stories_model_path();
  if (!path) KVRELAY_SKIP("stories260K.bin not found");
  auto model = kr::load_llama2c(*path);
  REQUIRE(model);
  kr::WorkerMetrics metrics;
  PrefixStoreConnector connector(model.value());
  kr::ModelWorker worker(model.value(), connector, metrics, 8);

  const std::vector<std::int32_t> prompt_a = {1, 'O' + 3, 'n' + 3, 'c' + 3, 'e' + 3, ' ' + 3, 'u' + 3, 'p' + 3};
  const auto a = run(worker, prompt_a, 10, {{"agent", "a"}});
  CHECK(a.stats.cached_tokens == 0);
  CHECK(a.stats.prefill_tokens == prompt_a.size());
  CHECK(a.stats.published_tokens == prompt_a.size() + 10 - 1);
  REQUIRE(connector.store.size() == 1);
  CHECK(connector.lookup_params[0]["agent"] == "a");

  // B: A's prompt + A's output + a follow-up.
  std::vector<std::int32_t> prompt_b = prompt_a;
  prompt_b.insert(prompt_b.end(), a.generation.tokens.begin(), a.generation.tokens.end());
  const std::vector<std::int32_t> follow_up = {'A' + 3, 'n' + 3, 'd' + 3};
  prompt_b.insert(prompt_b.end(), follow_up.begin(), follow_up.end());
  const auto b = run(worker, prompt_b, 12, {{"agent", "b"}});
  CHECK(b.stats.cached_tokens == a.stats.published_tokens);
  CHECK(b.stats.prefill_tokens == prompt_b.size() - a.stats.published_tokens);
  CHECK(connector.prefills.back() == std::pair<std::size_t, std::uint64_t>{b.stats.prefill_tokens, prompt_b.size()});

  // The same request on a worker whose connector never hits computes every token and answers the same.
  kr::NoKvConnector none;
  kr::ModelWorker cold(model.value(), none, metrics, 8);
  const auto b_cold = run(cold, prompt_b, 12);
  CHECK(b_cold.stats.cached_tokens == 0);
  CHECK(b_cold.stats.prefill_tokens == prompt_b.size());
  CHECK(b_cold.stats.published_tokens == 0);
  CHECK(b.generation.tokens == b_cold.generation.tokens);

  // A prompt entirely covered by published KV still recomputes its last token for the logits.
  std::vector<std::int32_t> covered(prompt_b.begin(), prompt_b.begin() + 12);
  const auto c = run(worker, covered, 4);
  CHECK(c.stats.cached_tokens == covered.size() - 1);
  CHECK(c.stats.prefill_tokens == 1);
  CHECK(c.generation.tokens == run(cold, covered, 4).generation.tokens);
  CHECK_FALSE(connector.bad_publish);
  CHECK_FALSE(connector.bad_prefill_report);
}

TEST_CASE("refworker worker: an unusable prefix is a miss, never a failed request", "[refworker][worker]") {
  const auto path = kvrelay::test::stories_model_path();
  if (!path) KVRELAY_SKIP("stories260K.bin not found");
  auto model = kr::load_llama2c(*path);
  REQUIRE(model);
  kr::WorkerMetrics metrics;
  PrefixStoreConnector connector(model.value());
  kr::ModelWorker worker(model.value(), connector, metrics, 8);
  const std::vector<std::int32_t> prompt = {1, 40, 41, 42, 43, 44};
  const auto first = run(worker, prompt, 3);
  // Corrupt what was published: the next lookup returns a non-finite KV.
  for (auto& [tokens, kv] : connector.store)
    kv[0] = std::numeric_limits<float>::infinity();
  const auto second = run(worker, prompt, 3);
  CHECK(second.stats.cached_tokens == 0);
  CHECK(second.stats.prefill_tokens == prompt.size());
  CHECK(second.generation.tokens == first.generation.tokens);
}

TEST_CASE("refworker worker: stop() cancels waiting requests and refuses new ones", "[refworker][worker]") {
  auto model = kr::make_synthetic(kr::parse_shape("layers=2,dim=64,heads=4,kv_heads=2,ffn=128,vocab=300").value(), 1);
  REQUIRE(model);
  kr::WorkerMetrics metrics;
  kr::NoKvConnector none;
  kr::ModelWorker worker(model.value(), none, metrics, 2);
  worker.stop();
  kr::CompletionJob job;
  job.request.prompt = {1, 2, 3};
  job.on_done = [](kvrelay::Result<kr::CompletionOutcome>) {};
  CHECK(worker.submit(std::move(job)).error().code == kvrelay::ErrorCode::kCancelled);
}

namespace {

// The value of vllm:kv_cache_usage_perc on a rendered metrics page; -1 when it is missing.
double kv_usage_on(const std::string& page) {
  const std::string series = "vllm:kv_cache_usage_perc{model_name=\"m\"} ";
  const auto at = page.find(series);
  return at == std::string::npos ? -1.0 : std::stod(page.substr(at + series.size()));
}

}  // namespace

TEST_CASE("refworker worker: kv_cache_usage_perc is the running session's KV over one seq_len session",
          "[refworker][worker]") {
  auto model =
      kr::make_synthetic(kr::parse_shape("layers=2,dim=64,heads=4,kv_heads=2,ffn=128,vocab=300,seq_len=64").value(), 1);
  REQUIRE(model);
  kr::WorkerMetrics metrics;
  kr::NoKvConnector none;
  kr::ModelWorker worker(model.value(), none, metrics, 2);
  CHECK(kv_usage_on(metrics.render("m")) == 0.0);  // idle: no session holds KV

  std::vector<double> seen;  // filled on the model thread, read after the request is done
  std::promise<kvrelay::Result<kr::CompletionOutcome>> done;
  kr::CompletionJob job;
  job.request.prompt = std::vector<std::int32_t>(16, 7);
  job.request.generation.max_tokens = 8;
  job.request.generation.stop_at_eos = false;
  job.on_token = [&](std::int32_t) {
    seen.push_back(kv_usage_on(metrics.render("m")));
    return true;
  };
  job.on_done = [&done](kvrelay::Result<kr::CompletionOutcome> outcome) { done.set_value(std::move(outcome)); };
  REQUIRE(worker.submit(std::move(job)));
  REQUIRE(done.get_future().get());

  // At answer token i the session holds the prompt and the i tokens decoded before it.
  REQUIRE(seen.size() == 8);
  for (std::size_t i = 0; i < seen.size(); ++i) {
    INFO("token " << i);
    CHECK(seen[i] > 0.0);
    CHECK(seen[i] <= 1.0);
    CHECK(seen[i] == Approx(static_cast<double>(16 + i) / 64.0));
  }
  CHECK(kv_usage_on(metrics.render("m")) == 0.0);  // the finished request's rows are free again
}
