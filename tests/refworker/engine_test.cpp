// Forward-pass tests against the trained stories260K checkpoint: its README gives a reference
// greedy continuation that only a correct loader + forward pass reproduces.

#include <catch2/catch.hpp>

#include <algorithm>
#include <cmath>
#include <vector>

#include "kvrelay/refworker/generation.h"
#include "kvrelay/refworker/kv_dump.h"
#include "kvrelay/refworker/model.h"

#include "skip.h"
#include "support/test_paths.h"

namespace kr = kvrelay::refworker;

namespace {

const std::vector<std::int32_t> kReference = {461, 461, 401, 401, 401, 461, 378, 455, 473, 456, 435,
                                              299, 362, 409, 283, 264, 283, 452, 288, 13,  431, 431,
                                              431, 431, 431, 431, 431, 431, 431, 431, 431, 431};

const kr::Model* stories_model() {
  static const auto path = kvrelay::test::stories_model_path();
  if (!path) return nullptr;
  static auto model = kr::load_llama2c(*path);
  REQUIRE(model);
  return &model.value();
}

// Largest |a-b| relative to the largest |b|: logits are compared as a whole vector.
double relative_error(const std::vector<float>& a, const std::vector<float>& b) {
  REQUIRE(a.size() == b.size());
  double max_diff = 0.0;
  double max_ref = 0.0;
  for (std::size_t i = 0; i < a.size(); ++i) {
    max_diff = std::max(max_diff, static_cast<double>(std::fabs(a[i] - b[i])));
    max_ref = std::max(max_ref, static_cast<double>(std::fabs(b[i])));
  }
  return max_ref == 0.0 ? max_diff : max_diff / max_ref;
}

// A prompt of real text: BOS and the reference continuation, then a few byte tokens.
std::vector<std::int32_t> prompt_tokens() {
  std::vector<std::int32_t> tokens{kr::kBosToken};
  tokens.insert(tokens.end(), kReference.begin(), kReference.end());
  for (std::int32_t byte : {'O', 'n', 'c', 'e', ' ', 'u', 'p', 'o', 'n'})
    tokens.push_back(byte + 3);
  return tokens;
}

std::vector<std::int32_t> greedy(kr::InferenceSession& session, const std::vector<float>& logits, std::uint32_t n) {
  kr::GenerationOptions options;
  options.max_tokens = n;
  options.stop_at_eos = false;
  auto result = kr::generate(session, logits, options);
  REQUIRE(result);
  return result.value().tokens;
}

}  // namespace

TEST_CASE("refworker stories260K: greedy continuation from BOS matches the README reference", "[refworker][stories]") {
  const kr::Model* model = stories_model();
  if (model == nullptr) KVRELAY_SKIP("stories260K.bin not found");
  kr::InferenceSession session(*model);
  auto logits = session.decode(kr::kBosToken);
  REQUIRE(logits);
  CHECK(greedy(session, logits.value(), 32) == kReference);
}

TEST_CASE("refworker stories260K: top-2 probabilities at position 0", "[refworker][stories]") {
  const kr::Model* model = stories_model();
  if (model == nullptr) KVRELAY_SKIP("stories260K.bin not found");
  kr::InferenceSession session(*model);
  auto logits = session.decode(kr::kBosToken);
  REQUIRE(logits);
  std::vector<float> probabilities(logits.value().size());
  kr::softmax_into(logits.value(), probabilities);
  std::vector<std::size_t> order(probabilities.size());
  for (std::size_t i = 0; i < order.size(); ++i)
    order[i] = i;
  std::partial_sort(order.begin(), order.begin() + 2, order.end(),
                    [&](std::size_t a, std::size_t b) { return probabilities[a] > probabilities[b]; });
  CHECK(order[0] == 461);
  CHECK(order[1] == 306);
  CHECK(probabilities[461] == Approx(0.285).margin(0.0005));
  CHECK(probabilities[306] == Approx(0.256).margin(0.0005));
}

TEST_CASE("refworker stories260K: fingerprint describes the checkpoint", "[refworker][stories]") {
  const kr::Model* model = stories_model();
  if (model == nullptr) KVRELAY_SKIP("stories260K.bin not found");
  const auto& fingerprint = model->fingerprint();
  CHECK(fingerprint.architecture == "llama");
  CHECK(fingerprint.layers == 5);
  CHECK(fingerprint.kv_heads == 4);
  CHECK(fingerprint.head_dim == 8);
  CHECK(fingerprint.dtype == kvrelay::DType::kFloat32);
  CHECK(fingerprint.weights_identity.size() == 16);
  CHECK(model->fingerprint().layout(1).bytes_per_token().value() == 1280);
}

TEST_CASE("refworker batched prefill equals token-by-token decode", "[refworker][stories]") {
  const kr::Model* model = stories_model();
  if (model == nullptr) KVRELAY_SKIP("stories260K.bin not found");
  const auto tokens = prompt_tokens();
  kr::InferenceSession batched(*model);
  auto batched_logits = batched.prefill(tokens);
  REQUIRE(batched_logits);

  kr::InferenceSession stepwise(*model);
  std::vector<float> step_logits;
  for (const std::int32_t token : tokens) {
    auto logits = stepwise.decode(token);
    REQUIRE(logits);
    step_logits = std::move(logits.value());
  }
  CHECK(relative_error(batched_logits.value(), step_logits) < 1e-4);
  auto batched_kv = batched.export_kv(tokens.size());
  auto step_kv = stepwise.export_kv(tokens.size());
  REQUIRE(batched_kv);
  REQUIRE(step_kv);
  CHECK(relative_error(batched_kv.value(), step_kv.value()) < 1e-4);
  CHECK(greedy(batched, batched_logits.value(), 12) == greedy(stepwise, step_logits, 12));
}

TEST_CASE("refworker prefill after an imported KV prefix equals a full prefill", "[refworker][stories]") {
  const kr::Model* model = stories_model();
  if (model == nullptr) KVRELAY_SKIP("stories260K.bin not found");
  const auto tokens = prompt_tokens();
  const std::size_t prefix = GENERATE(std::size_t{1}, std::size_t{16}, std::size_t{33});

  kr::InferenceSession full(*model);
  auto full_logits = full.prefill(tokens);
  REQUIRE(full_logits);

  // The prefix's KV comes from another session that only ever saw the prefix.
  kr::InferenceSession donor(*model);
  REQUIRE(donor.prefill(std::span(tokens).first(prefix)));
  auto kv = donor.export_kv(prefix);
  REQUIRE(kv);
  const auto layout = donor.layout(prefix);
  REQUIRE(kv.value().size() * sizeof(float) == layout.total_bytes().value());

  kr::InferenceSession resumed(*model);
  REQUIRE(resumed.import_kv(layout, kv.value()));
  CHECK(resumed.position() == prefix);
  auto resumed_logits = resumed.prefill(std::span(tokens).subspan(prefix));
  REQUIRE(resumed_logits);
  CHECK(relative_error(resumed_logits.value(), full_logits.value()) < 1e-4);
  CHECK(greedy(resumed, resumed_logits.value(), 16) == greedy(full, full_logits.value(), 16));
}

TEST_CASE("refworker exported KV is in KvLayout order: per layer K then V, K after RoPE", "[refworker][stories]") {
  const kr::Model* model = stories_model();
  if (model == nullptr) KVRELAY_SKIP("stories260K.bin not found");
  const auto tokens = prompt_tokens();
  kr::InferenceSession session(*model);
  REQUIRE(session.prefill(tokens));
  auto all = session.export_kv(tokens.size());
  auto first = session.export_kv(5);
  REQUIRE(all);
  REQUIRE(first);
  // The 5-token export must be the first 5 rows of each K and V tensor of the full export.
  const auto full_layout = session.layout(tokens.size());
  const auto short_layout = session.layout(5);
  const std::size_t row = 4 * 8;
  for (std::uint32_t layer = 0; layer < 5; ++layer) {
    for (bool is_value : {false, true}) {
      const auto full_offset = full_layout.tensor_offset(layer, is_value).value() / sizeof(float);
      const auto short_offset = short_layout.tensor_offset(layer, is_value).value() / sizeof(float);
      for (std::size_t i = 0; i < 5 * row; ++i)
        REQUIRE(first.value()[short_offset + i] == all.value()[full_offset + i]);
    }
  }
  // Position 0 is not rotated, so layer 0's K row 0 is exactly wk * rmsnorm(embedding[BOS]).
  const auto& config = model->config();
  const float* embedding = model->token_embedding() + config.dim * kr::kBosToken;
  float sum = 0.0F;
  for (std::size_t i = 0; i < config.dim; ++i)
    sum += embedding[i] * embedding[i];
  const float scale = 1.0F / std::sqrt(sum / static_cast<float>(config.dim) + 1e-5F);
  const auto& layer0 = model->layer(0);
  for (std::size_t j = 0; j < config.kv_dim(); ++j) {
    double expected = 0.0;
    for (std::size_t i = 0; i < config.dim; ++i) {
      expected += static_cast<double>(layer0.wk[j * config.dim + i]) * layer0.rms_att[i] * scale * embedding[i];
    }
    CHECK(all.value()[j] == Approx(expected).margin(1e-4));
  }
  // At position 1 the rotation changes K but keeps each pair's norm.
  kr::InferenceSession unrotated(*model);
  REQUIRE(unrotated.prefill(std::vector<std::int32_t>{tokens[1]}));
  auto at_zero = unrotated.export_kv(1);
  REQUIRE(at_zero);
  kr::InferenceSession rotated(*model);
  REQUIRE(rotated.prefill(std::vector<std::int32_t>{tokens[1], tokens[1]}));
  auto at_one = rotated.export_kv(2);
  REQUIRE(at_one);
  const float* k0 = at_zero.value().data();
  const float* k1 = at_one.value().data() + row;  // row 1 of layer 0's K
  bool changed = false;
  for (std::size_t i = 0; i < row; i += 2) {
    CHECK(std::hypot(k1[i], k1[i + 1]) == Approx(std::hypot(k0[i], k0[i + 1])).epsilon(1e-4));
    changed = changed || std::fabs(k1[i] - k0[i]) > 1e-6F;
  }
  CHECK(changed);
}

TEST_CASE("refworker KV import rejects wrong layouts, sizes and non-empty sessions", "[refworker][stories]") {
  const kr::Model* model = stories_model();
  if (model == nullptr) KVRELAY_SKIP("stories260K.bin not found");
  kr::InferenceSession donor(*model);
  REQUIRE(donor.prefill(prompt_tokens()));
  auto kv = donor.export_kv(8);
  REQUIRE(kv);
  kr::InferenceSession target(*model);
  auto wrong_heads = donor.layout(8);
  wrong_heads.kv_heads = 2;
  CHECK(target.import_kv(wrong_heads, kv.value()).error().code == kvrelay::ErrorCode::kLayoutMismatch);
  CHECK(target.import_kv(donor.layout(9), kv.value()).error().code == kvrelay::ErrorCode::kLayoutMismatch);
  auto poisoned = kv.value();
  poisoned[17] = std::nanf("");
  CHECK(target.import_kv(donor.layout(8), poisoned).error().code == kvrelay::ErrorCode::kCorrupt);
  CHECK(target.position() == 0);
  REQUIRE(target.import_kv(donor.layout(8), kv.value()));
  REQUIRE(target.import_kv(donor.layout(8), kv.value()));  // issue #28: appends rows at positions 8..15
  CHECK(target.position() == 16);
  CHECK(donor.export_kv(1000).error().code == kvrelay::ErrorCode::kOutOfRange);
}

TEST_CASE("refworker prefill rejects out-of-vocabulary ids and contexts beyond seq_len", "[refworker][stories]") {
  const kr::Model* model = stories_model();
  if (model == nullptr) KVRELAY_SKIP("stories260K.bin not found");
  kr::InferenceSession session(*model);
  CHECK(session.prefill(std::vector<std::int32_t>{1, 512}).error().code == kvrelay::ErrorCode::kOutOfRange);
  CHECK(session.prefill(std::vector<std::int32_t>{1, -1}).error().code == kvrelay::ErrorCode::kOutOfRange);
  CHECK(session.prefill(std::vector<std::int32_t>(513, 5)).error().code == kvrelay::ErrorCode::kOutOfRange);
  CHECK(session.prefill(std::vector<std::int32_t>{}).error().code == kvrelay::ErrorCode::kInvalidArgument);
  CHECK(session.position() == 0);
}

TEST_CASE("refworker dump_kv returns the prompt's KV and the queries of its last positions", "[refworker][stories]") {
  const kr::Model* model = stories_model();
  if (model == nullptr) KVRELAY_SKIP("stories260K.bin not found");
  const auto tokens = prompt_tokens();
  constexpr std::uint32_t kQueries = 4;
  auto dump = kr::dump_kv(*model, tokens, kQueries);
  REQUIRE(dump);
  const auto& config = model->config();
  CHECK(dump.value().layout == model->fingerprint().layout(tokens.size()));
  CHECK(dump.value().kv.size() * sizeof(float) == dump.value().layout.total_bytes().value());
  REQUIRE(dump.value().queries.data.size() == std::size_t{config.layers} * kQueries * config.dim);

  // The same queries, captured one position at a time by a session that runs the tail stepwise.
  kr::InferenceSession session(*model);
  REQUIRE(session.prefill(std::span(tokens).first(tokens.size() - kQueries)));
  for (std::uint32_t m = 0; m < kQueries; ++m) {
    kr::QueryCapture one{1, {}};
    REQUIRE(session.prefill(std::span(tokens).subspan(tokens.size() - kQueries + m, 1), &one));
    for (std::size_t layer = 0; layer < config.layers; ++layer) {
      for (std::size_t i = 0; i < config.dim; ++i) {
        const float expected = one.data[layer * config.dim + i];
        const float got = dump.value().queries.data[(layer * kQueries + m) * config.dim + i];
        REQUIRE(got == Approx(expected).margin(1e-4));
      }
    }
  }
  kr::QueryCapture too_many{50, {}};
  kr::InferenceSession other(*model);
  CHECK(other.prefill(tokens, &too_many).error().code == kvrelay::ErrorCode::kInvalidArgument);
}

TEST_CASE("refworker seeded temperature sampling is reproducible and differs across seeds", "[refworker][stories]") {
  const kr::Model* model = stories_model();
  if (model == nullptr) KVRELAY_SKIP("stories260K.bin not found");
  auto run = [&](std::uint64_t seed) {
    kr::InferenceSession session(*model);
    auto logits = session.decode(kr::kBosToken);
    REQUIRE(logits);
    kr::GenerationOptions options;
    options.max_tokens = 24;
    options.stop_at_eos = false;
    options.sampling = {1.0F, 0, seed};
    auto result = kr::generate(session, logits.value(), options);
    REQUIRE(result);
    return result.value().tokens;
  };
  CHECK(run(7) == run(7));
  CHECK(run(7) != run(8));
  CHECK(run(7) != kReference);
}
