// Position-sparse KV import (the kv_sparse medium): B receives only some of A's token positions and
// attends over those, at their original positions, plus its own new tokens. Checked against an
// independent naive forward pass (llama2.c's run.c, token by token) with an explicit attention mask.

#include <catch2/catch.hpp>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <functional>
#include <limits>
#include <numeric>
#include <set>
#include <string_view>
#include <vector>

#include "kvrelay/refworker/kv_cache.h"
#include "kvrelay/refworker/model.h"
#include "kvrelay/refworker/session.h"

#include "skip.h"
#include "support/test_paths.h"

// A namespace of its own: unity builds compile the refworker tests into one translation unit.
namespace sparse_import_test {

namespace kr = kvrelay::refworker;
using kvrelay::ErrorCode;

namespace {

const kr::Model* stories_model() {
  static const auto path = kvrelay::test::stories_model_path();
  if (!path) return nullptr;
  static auto model = kr::load_llama2c(*path);
  REQUIRE(model);
  return &model.value();
}

// BOS and the README's reference continuation, then text bytes: 40 tokens of real text.
std::vector<std::int32_t> prompt_tokens() {
  std::vector<std::int32_t> tokens{kr::kBosToken, 461, 461, 401, 401, 401, 461, 378, 455, 473, 456,
                                   435,           299, 362, 409, 283, 264, 283, 452, 288, 13};
  for (const char byte : std::string_view("Once upon a time, a "))
    tokens.push_back(byte + 3);
  tokens.resize(40);
  return tokens;
}

// Tokens B runs after the imported context: a prefill of these, then decode steps.
const std::vector<std::int32_t> kNewTokens = {'l' + 3, 'i' + 3, 't' + 3, 't' + 3, 'l' + 3, 'e' + 3};
const std::vector<std::int32_t> kDecodeTokens = {' ' + 3, 'g' + 3};

// An attention sink, a few scattered middle positions, and the recent window of a 40-token context.
const std::vector<std::uint32_t> kKept = {0,  1,  2,  3,  8,  11, 12, 17, 20, 21, 22,
                                          23, 31, 32, 33, 34, 35, 36, 37, 38, 39};

// ---- Naive reference: llama2.c's run.c forward, one token at a time, with an attention mask ----

// run.c's matmul: xout[d] = W[d, n] x[n], float accumulation in order.
void matmul(float* xout, const float* x, const float* w, std::size_t n, std::size_t d) {
  for (std::size_t i = 0; i < d; ++i) {
    float val = 0.0F;
    for (std::size_t j = 0; j < n; ++j)
      val += w[i * n + j] * x[j];
    xout[i] = val;
  }
}

void rmsnorm(float* o, const float* x, const float* weight, std::size_t size) {
  float ss = 0.0F;
  for (std::size_t j = 0; j < size; ++j)
    ss += x[j] * x[j];
  ss /= static_cast<float>(size);
  ss += 1e-5F;
  ss = 1.0F / std::sqrt(ss);
  for (std::size_t j = 0; j < size; ++j)
    o[j] = weight[j] * (ss * x[j]);
}

// Runs tokens[0..] at positions 0.. one by one. The token at position `query` attends over the
// earlier positions `key` for which visible(query, key) holds (and always itself). Returns the
// logits of every position from `logits_from` on.
std::vector<std::vector<float>> reference_logits(const kr::Model& model, const std::vector<std::int32_t>& tokens,
                                                 const std::function<bool(std::size_t, std::size_t)>& visible,
                                                 std::size_t logits_from) {
  const auto& c = model.config();
  const std::size_t dim = c.dim;
  const std::size_t kv_dim = c.kv_dim();
  const std::size_t head_size = c.head_dim();
  const std::size_t kv_mul = c.heads / c.kv_heads;
  const std::size_t hidden = c.hidden_dim;
  std::vector<float> key_cache(c.layers * tokens.size() * kv_dim);
  std::vector<float> value_cache(key_cache.size());
  std::vector<float> x(dim), xb(dim), xb2(dim), q(dim), hb(hidden), hb2(hidden), att(tokens.size());
  std::vector<std::vector<float>> out;
  for (std::size_t pos = 0; pos < tokens.size(); ++pos) {
    std::memcpy(x.data(), model.token_embedding() + static_cast<std::size_t>(tokens[pos]) * dim, dim * sizeof(float));
    for (std::size_t l = 0; l < c.layers; ++l) {
      const kr::LayerWeights& w = model.layer(l);
      float* keys = key_cache.data() + l * tokens.size() * kv_dim;
      float* values = value_cache.data() + l * tokens.size() * kv_dim;
      float* k = keys + pos * kv_dim;
      float* v = values + pos * kv_dim;
      rmsnorm(xb.data(), x.data(), w.rms_att, dim);
      matmul(q.data(), xb.data(), w.wq, dim, dim);
      matmul(k, xb.data(), w.wk, dim, kv_dim);
      matmul(v, xb.data(), w.wv, dim, kv_dim);
      for (std::size_t i = 0; i < dim; i += 2) {
        const std::size_t head_dim = i % head_size;
        const float freq = 1.0F / std::pow(10000.0F, static_cast<float>(head_dim) / static_cast<float>(head_size));
        const float val = static_cast<float>(pos) * freq;
        const float fcr = std::cos(val);
        const float fci = std::sin(val);
        const int rotn = i < kv_dim ? 2 : 1;
        for (int which = 0; which < rotn; ++which) {
          float* vec = which == 0 ? q.data() : k;
          const float v0 = vec[i];
          const float v1 = vec[i + 1];
          vec[i] = v0 * fcr - v1 * fci;
          vec[i + 1] = v0 * fci + v1 * fcr;
        }
      }
      for (std::size_t h = 0; h < c.heads; ++h) {
        const float* qh = q.data() + h * head_size;
        // Softmax over the visible keys only: masked positions take no weight at all.
        float max_score = -std::numeric_limits<float>::infinity();
        for (std::size_t t = 0; t <= pos; ++t) {
          if (t != pos && !visible(pos, t)) continue;
          const float* kt = keys + t * kv_dim + (h / kv_mul) * head_size;
          float score = 0.0F;
          for (std::size_t i = 0; i < head_size; ++i)
            score += qh[i] * kt[i];
          att[t] = score / std::sqrt(static_cast<float>(head_size));
          max_score = std::max(max_score, att[t]);
        }
        float sum = 0.0F;
        for (std::size_t t = 0; t <= pos; ++t) {
          if (t != pos && !visible(pos, t)) continue;
          att[t] = std::exp(att[t] - max_score);
          sum += att[t];
        }
        float* xbh = xb.data() + h * head_size;
        std::fill(xbh, xbh + head_size, 0.0F);
        for (std::size_t t = 0; t <= pos; ++t) {
          if (t != pos && !visible(pos, t)) continue;
          const float a = att[t] / sum;
          const float* vt = values + t * kv_dim + (h / kv_mul) * head_size;
          for (std::size_t i = 0; i < head_size; ++i)
            xbh[i] += a * vt[i];
        }
      }
      matmul(xb2.data(), xb.data(), w.wo, dim, dim);
      for (std::size_t i = 0; i < dim; ++i)
        x[i] += xb2[i];
      rmsnorm(xb.data(), x.data(), w.rms_ffn, dim);
      matmul(hb.data(), xb.data(), w.w1, dim, hidden);
      matmul(hb2.data(), xb.data(), w.w3, dim, hidden);
      for (std::size_t i = 0; i < hidden; ++i) {
        float val = hb[i];
        val *= 1.0F / (1.0F + std::exp(-val));
        hb[i] = val * hb2[i];
      }
      matmul(xb.data(), hb.data(), w.w2, hidden, dim);
      for (std::size_t i = 0; i < dim; ++i)
        x[i] += xb[i];
    }
    if (pos < logits_from) continue;
    std::vector<float> logits(c.vocab_size);
    rmsnorm(xb.data(), x.data(), model.rms_final(), dim);
    matmul(logits.data(), xb.data(), model.classifier(), dim, c.vocab_size);
    out.push_back(std::move(logits));
  }
  return out;
}

// The sparse medium's mask: positions before `context` ran densely (as A computed them); every
// later position sees the `kept` positions of the context and the positions from `context` on.
std::function<bool(std::size_t, std::size_t)> sparse_mask(std::size_t context, const std::vector<std::uint32_t>& kept) {
  const std::set<std::size_t> kept_set(kept.begin(), kept.end());
  return [context, kept_set](std::size_t query, std::size_t key) {
    if (query < context) return true;
    return key >= context || kept_set.count(key) > 0;
  };
}

// ---- Helpers ----

// The rows `positions` of a KvLayout buffer of `layout`, as a KvLayout buffer of positions.size() tokens.
std::vector<float> gather_rows(const std::vector<float>& kv, const kvrelay::KvLayout& layout,
                               const std::vector<std::uint32_t>& positions) {
  const std::size_t row = static_cast<std::size_t>(layout.elements_per_token_row().value());
  const std::size_t tokens = static_cast<std::size_t>(layout.tokens);
  std::vector<float> out;
  for (std::size_t tensor = 0; tensor < 2 * layout.layers; ++tensor) {
    for (const std::uint32_t position : positions) {
      const float* from = kv.data() + (tensor * tokens + position) * row;
      out.insert(out.end(), from, from + row);
    }
  }
  return out;
}

kr::KvReader reader_of(const std::vector<float>& kv) {
  return [&kv](std::uint64_t offset, std::span<float> into) -> kvrelay::Status {
    REQUIRE(offset + into.size() <= kv.size());
    std::memcpy(into.data(), kv.data() + offset, into.size_bytes());
    return kvrelay::ok();
  };
}

float max_abs_diff(const std::vector<float>& a, const std::vector<float>& b) {
  REQUIRE(a.size() == b.size());
  float diff = 0.0F;
  for (std::size_t i = 0; i < a.size(); ++i)
    diff = std::max(diff, std::fabs(a[i] - b[i]));
  return diff;
}

// BLAS sgemm against run.c's in-order float loops: same formulas, different summation order.
constexpr float kTolerance = 1e-4F;

struct Donor {
  std::vector<std::int32_t> prompt;
  std::vector<float> kv;  // A's export of the whole prompt
  kvrelay::KvLayout layout;
};

Donor donor(const kr::Model& model) {
  Donor d{prompt_tokens(), {}, {}};
  kr::InferenceSession a(model);
  REQUIRE(a.prefill(d.prompt));
  auto kv = a.export_kv(d.prompt.size());
  REQUIRE(kv);
  d.kv = std::move(kv).value();
  d.layout = a.layout(d.prompt.size());
  return d;
}

}  // namespace

TEST_CASE("refworker sparse import: B attends over A's kept positions at their original positions",
          "[refworker][stories][sparse]") {
  const kr::Model* model = stories_model();
  if (model == nullptr) KVRELAY_SKIP("stories260K.bin not found");
  const Donor d = donor(*model);
  const std::size_t context = d.prompt.size();
  const auto kept_kv = gather_rows(d.kv, d.layout, kKept);

  // B's cache is a worker's lent one that held another request before: the import overwrites it.
  kr::KvCache cache(model->config().layers, model->config().kv_dim());
  {
    kr::InferenceSession previous(*model, cache);
    REQUIRE(previous.prefill(std::vector<std::int32_t>(64, 300)));
  }
  kr::InferenceSession b(*model, cache);
  REQUIRE(b.import_sparse_kv(b.layout(kKept.size()), kKept, context, reader_of(kept_kv)));
  CHECK(b.position() == context);
  CHECK(b.cached_rows() == kKept.size());
  CHECK(b.sparse());

  std::vector<std::vector<float>> got;
  auto logits = b.prefill(kNewTokens);
  REQUIRE(logits);
  got.push_back(std::move(logits).value());
  for (const std::int32_t token : kDecodeTokens) {
    logits = b.decode(token);
    REQUIRE(logits);
    got.push_back(std::move(logits).value());
  }
  CHECK(b.position() == context + kNewTokens.size() + kDecodeTokens.size());
  CHECK(b.cached_rows() == kKept.size() + kNewTokens.size() + kDecodeTokens.size());

  // The reference: a dense pass over the prompt (A), then the new tokens under the sparse mask.
  std::vector<std::int32_t> all = d.prompt;
  all.insert(all.end(), kNewTokens.begin(), kNewTokens.end());
  all.insert(all.end(), kDecodeTokens.begin(), kDecodeTokens.end());
  const auto reference = reference_logits(*model, all, sparse_mask(context, kKept), context + kNewTokens.size() - 1);
  REQUIRE(reference.size() == got.size());
  float worst = 0.0F;
  for (std::size_t i = 0; i < got.size(); ++i)
    worst = std::max(worst, max_abs_diff(got[i], reference[i]));
  WARN("sparse import vs naive masked reference: max |logit diff| " << worst);
  CHECK(worst < kTolerance);

  // The dense session (A going on with the same tokens) computes something else: the test can fail.
  kr::InferenceSession a(*model);
  REQUIRE(a.prefill(std::span(all).first(all.size() - 1)));
  auto a_last = a.decode(all.back());
  REQUIRE(a_last);
  const auto dense_reference = reference_logits(
      *model, all, [](std::size_t, std::size_t) { return true; }, all.size() - 1);
  const float dense_vs_reference = max_abs_diff(a_last.value(), dense_reference.back());
  const float sparse_vs_dense = max_abs_diff(got.back(), a_last.value());
  WARN("dense session vs naive dense reference: " << dense_vs_reference
                                                  << "; sparse vs dense session: " << sparse_vs_dense);
  CHECK(dense_vs_reference < kTolerance);
  CHECK(sparse_vs_dense > 100 * kTolerance);
}

TEST_CASE("refworker sparse import keeping every position is the dense import exactly",
          "[refworker][stories][sparse]") {
  const kr::Model* model = stories_model();
  if (model == nullptr) KVRELAY_SKIP("stories260K.bin not found");
  const Donor d = donor(*model);
  std::vector<std::uint32_t> every(d.prompt.size());
  std::iota(every.begin(), every.end(), 0U);

  kr::InferenceSession dense(*model);
  REQUIRE(dense.import_kv(d.layout, d.kv));
  kr::InferenceSession sparse(*model);
  REQUIRE(sparse.import_sparse_kv(d.layout, every, d.prompt.size(), reader_of(d.kv)));
  CHECK_FALSE(sparse.sparse());
  CHECK(sparse.position() == d.prompt.size());
  CHECK(sparse.cached_rows() == d.prompt.size());
  auto exported = sparse.export_kv(d.prompt.size());
  REQUIRE(exported);
  CHECK(exported.value() == d.kv);

  auto dense_logits = dense.prefill(kNewTokens);
  auto sparse_logits = sparse.prefill(kNewTokens);
  REQUIRE(dense_logits);
  REQUIRE(sparse_logits);
  CHECK(sparse_logits.value() == dense_logits.value());
  dense_logits = dense.decode(kDecodeTokens[0]);
  sparse_logits = sparse.decode(kDecodeTokens[0]);
  REQUIRE(dense_logits);
  REQUIRE(sparse_logits);
  CHECK(sparse_logits.value() == dense_logits.value());
}

TEST_CASE("refworker sparse session: export and span import refused, truncate translates positions to rows",
          "[refworker][stories][sparse]") {
  const kr::Model* model = stories_model();
  if (model == nullptr) KVRELAY_SKIP("stories260K.bin not found");
  const Donor d = donor(*model);
  const std::size_t context = d.prompt.size();
  const auto kept_kv = gather_rows(d.kv, d.layout, kKept);
  kr::InferenceSession b(*model);
  REQUIRE(b.import_sparse_kv(b.layout(kKept.size()), kKept, context, reader_of(kept_kv)));
  REQUIRE(b.prefill(kNewTokens));

  auto exported = b.export_kv(4);
  REQUIRE_FALSE(exported);
  CHECK(exported.error().code == ErrorCode::kUnsupported);
  CHECK_THAT(exported.error().message, Catch::Contains("sparse"));
  auto appended = b.import_kv(d.layout.with_tokens(1),
                              std::span(d.kv).first(d.layout.with_tokens(1).total_bytes().value() / sizeof(float)));
  REQUIRE_FALSE(appended);
  CHECK(appended.error().code == ErrorCode::kUnsupported);
  CHECK(b.position() == context + kNewTokens.size());

  // Truncating rows appended after the import: a logical offset, the kept rows stay.
  REQUIRE(b.truncate(context + 3));
  CHECK(b.position() == context + 3);
  CHECK(b.cached_rows() == kKept.size() + 3);
  CHECK(b.sparse());
  auto logits = b.decode(kDecodeTokens[0]);
  REQUIRE(logits);
  {
    std::vector<std::int32_t> all = d.prompt;
    all.insert(all.end(), kNewTokens.begin(), kNewTokens.begin() + 3);
    all.push_back(kDecodeTokens[0]);
    const auto reference = reference_logits(*model, all, sparse_mask(context, kKept), all.size() - 1);
    const float diff = max_abs_diff(logits.value(), reference.back());
    WARN("after truncating appended rows: max |logit diff| " << diff);
    CHECK(diff < kTolerance);
  }

  // Truncating into the imported context: only the kept positions below it stay. Position 39 is
  // kept, so the last prompt token is recomputed at its own position (a worker's full-hit case).
  REQUIRE(b.truncate(context - 1));
  CHECK(b.position() == context - 1);
  CHECK(b.cached_rows() == kKept.size() - 1);
  CHECK(b.sparse());
  logits = b.decode(d.prompt.back());
  REQUIRE(logits);
  {
    std::vector<std::uint32_t> kept_below(kKept.begin(), kKept.end() - 1);
    const auto reference = reference_logits(*model, d.prompt, sparse_mask(context - 1, kept_below), context - 1);
    const float diff = max_abs_diff(logits.value(), reference.back());
    WARN("after truncating into the imported context: max |logit diff| " << diff);
    CHECK(diff < kTolerance);
  }

  // Below the first dropped position (4): dense again, a chain prefix that exports.
  REQUIRE(b.truncate(6));
  CHECK(b.cached_rows() == 4);
  CHECK(b.sparse());
  REQUIRE(b.truncate(4));
  CHECK_FALSE(b.sparse());
  CHECK(b.cached_rows() == 4);
  exported = b.export_kv(4);
  REQUIRE(exported);
  CHECK(exported.value() == gather_rows(d.kv, d.layout, {0, 1, 2, 3}));
  REQUIRE(b.import_kv(d.layout.with_tokens(2), gather_rows(d.kv, d.layout, {4, 5})));
  CHECK(b.position() == 6);
  CHECK(b.truncate(7).error().code == ErrorCode::kOutOfRange);
}

TEST_CASE("refworker sparse import refuses bad inputs clearly and leaves the session usable",
          "[refworker][stories][sparse]") {
  const kr::Model* model = stories_model();
  if (model == nullptr) KVRELAY_SKIP("stories260K.bin not found");
  const Donor d = donor(*model);
  const std::size_t context = d.prompt.size();
  const auto kept_kv = gather_rows(d.kv, d.layout, kKept);
  const auto layout = d.layout.with_tokens(kKept.size());
  kr::InferenceSession b(*model);
  std::size_t reads = 0;
  const kr::KvReader counting = [&](std::uint64_t offset, std::span<float> into) {
    ++reads;
    return reader_of(kept_kv)(offset, into);
  };

  auto refused = [&](const kvrelay::KvLayout& l, std::vector<std::uint32_t> positions, std::uint64_t context_tokens,
                     ErrorCode code, const char* says) {
    auto status = b.import_sparse_kv(l, positions, context_tokens, counting);
    REQUIRE_FALSE(status);
    CHECK(status.error().code == code);
    CHECK_THAT(status.error().message, Catch::Contains(says));
    CHECK(b.position() == 0);
    CHECK(b.cached_rows() == 0);
    CHECK_FALSE(b.sparse());
  };
  auto unsorted = kKept;
  std::swap(unsorted[4], unsorted[5]);
  refused(layout, unsorted, context, ErrorCode::kInvalidArgument, "strictly ascending");
  auto duplicate = kKept;
  duplicate[5] = duplicate[4];
  refused(layout, duplicate, context, ErrorCode::kInvalidArgument, "strictly ascending");
  refused(layout, kKept, 39, ErrorCode::kInvalidArgument, "outside the context");
  refused(d.layout.with_tokens(kKept.size() - 1), kKept, context, ErrorCode::kLayoutMismatch, "kept positions");
  refused(layout, kKept, model->config().seq_len + 1, ErrorCode::kOutOfRange, "seq_len");
  auto wrong = layout;
  wrong.head_dim = 16;
  refused(wrong, kKept, context, ErrorCode::kLayoutMismatch, "does not match");
  CHECK(reads == 0);  // all of the above are refused before reading
  auto poisoned_kv = kept_kv;
  poisoned_kv[poisoned_kv.size() / 2] = std::numeric_limits<float>::quiet_NaN();
  {
    auto status = b.import_sparse_kv(layout, kKept, context, reader_of(poisoned_kv));
    REQUIRE_FALSE(status);
    CHECK(status.error().code == ErrorCode::kCorrupt);
    CHECK(b.position() == 0);
    CHECK(b.cached_rows() == 0);
  }

  // Still usable: the good import goes in and runs as a fresh session's would.
  REQUIRE(b.import_sparse_kv(layout, kKept, context, counting));
  CHECK(reads == 2 * model->config().layers);
  kr::InferenceSession fresh(*model);
  REQUIRE(fresh.import_sparse_kv(layout, kKept, context, reader_of(kept_kv)));
  auto b_logits = b.prefill(kNewTokens);
  auto fresh_logits = fresh.prefill(kNewTokens);
  REQUIRE(b_logits);
  REQUIRE(fresh_logits);
  CHECK(b_logits.value() == fresh_logits.value());

  // A non-empty session (sparse or dense) takes no sparse import; it stays where it was.
  auto again = b.import_sparse_kv(layout, kKept, context, counting);
  REQUIRE_FALSE(again);
  CHECK(again.error().code == ErrorCode::kInvalidArgument);
  CHECK_THAT(again.error().message, Catch::Contains("empty session"));
  kr::InferenceSession dense(*model);
  REQUIRE(dense.prefill(std::span(d.prompt).first(10)));
  auto into_dense = dense.import_sparse_kv(layout, kKept, context, counting);
  REQUIRE_FALSE(into_dense);
  CHECK(into_dense.error().code == ErrorCode::kInvalidArgument);
  CHECK(dense.position() == 10);
  CHECK(dense.cached_rows() == 10);
  REQUIRE(dense.prefill(std::span(d.prompt).subspan(10)));
  kr::InferenceSession untouched(*model);
  REQUIRE(untouched.prefill(std::span(d.prompt).first(10)));
  REQUIRE(untouched.prefill(std::span(d.prompt).subspan(10)));
  CHECK(dense.export_kv(context).value() == untouched.export_kv(context).value());
}

}  // namespace sparse_import_test
