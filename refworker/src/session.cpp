// The forward pass follows llama2.c's run.c step by step (same RMSNorm, RoPE and SwiGLU
// formulas, float accumulation) so the trained checkpoint reproduces its reference output, but
// processes all prompt tokens at once: every projection is one sgemm over [tokens, dim], and
// attention per head is two sgemm calls with a causal mask.

#include "kvrelay/refworker/session.h"

#include <cblas.h>

#include <fmt/format.h>

#include <algorithm>
#include <bit>
#include <cmath>
#include <cstring>

namespace kvrelay::refworker {

namespace {

constexpr float kRmsEpsilon = 1e-5F;
constexpr float kRopeTheta = 10000.0F;
// Query rows per attention block: bounds the score matrix to kAttentionBlock x context floats.
constexpr std::size_t kAttentionBlock = 256;

int blas_int(std::size_t value) {
  return static_cast<int>(value);
}

// out[tokens, n_out] = in[tokens, n_in] * W^T, with W row-major [n_out, n_in].
void project(float* out, std::size_t ld_out, const float* in, const float* weight, std::size_t tokens, std::size_t n_in,
             std::size_t n_out) {
  if (tokens == 1) {
    cblas_sgemv(CblasRowMajor, CblasNoTrans, blas_int(n_out), blas_int(n_in), 1.0F, weight, blas_int(n_in), in, 1, 0.0F,
                out, 1);
    return;
  }
  cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasTrans, blas_int(tokens), blas_int(n_out), blas_int(n_in), 1.0F, in,
              blas_int(n_in), weight, blas_int(n_in), 0.0F, out, blas_int(ld_out));
}

void rmsnorm(float* out, const float* x, const float* weight, std::size_t size) {
  float sum_squares = 0.0F;
  for (std::size_t i = 0; i < size; ++i)
    sum_squares += x[i] * x[i];
  sum_squares /= static_cast<float>(size);
  sum_squares += kRmsEpsilon;
  const float scale = 1.0F / std::sqrt(sum_squares);
  for (std::size_t i = 0; i < size; ++i)
    out[i] = weight[i] * (scale * x[i]);
}

// Rotates adjacent pairs of every head of `vec` ([heads, head_dim]) by the angles of `pos`.
void apply_rope(float* vec, std::size_t heads, std::size_t head_dim, const float* cos_table, const float* sin_table) {
  for (std::size_t h = 0; h < heads; ++h) {
    float* head = vec + h * head_dim;
    for (std::size_t i = 0; i < head_dim; i += 2) {
      const float fcr = cos_table[i / 2];
      const float fci = sin_table[i / 2];
      const float v0 = head[i];
      const float v1 = head[i + 1];
      head[i] = v0 * fcr - v1 * fci;
      head[i + 1] = v0 * fci + v1 * fcr;
    }
  }
}

// Branch-free (vectorizes): an fp32 value is NaN or infinite exactly when its exponent bits are all set.
bool all_finite(std::span<const float> values) {
  std::uint32_t non_finite = 0;
  for (const float value : values) {
    non_finite |= static_cast<std::uint32_t>((std::bit_cast<std::uint32_t>(value) & 0x7F800000U) == 0x7F800000U);
  }
  return non_finite == 0;
}

void softmax(float* x, std::size_t size) {
  float max_value = x[0];
  for (std::size_t i = 1; i < size; ++i)
    max_value = std::max(max_value, x[i]);
  float sum = 0.0F;
  for (std::size_t i = 0; i < size; ++i) {
    x[i] = std::exp(x[i] - max_value);
    sum += x[i];
  }
  for (std::size_t i = 0; i < size; ++i)
    x[i] /= sum;
}

}  // namespace

InferenceSession::InferenceSession(const Model& model)
    : model_(&model),
      owned_cache_(std::make_unique<KvCache>(model.config().layers, model.config().kv_dim())),
      cache_(owned_cache_.get()) {}

InferenceSession::InferenceSession(const Model& model, KvCache& cache) : model_(&model), cache_(&cache) {}

Status InferenceSession::check_tokens(std::span<const std::int32_t> tokens) const {
  const auto& config = model_->config();
  if (tokens.empty()) return fail(ErrorCode::kInvalidArgument, "no tokens to run");
  for (const std::int32_t token : tokens) {
    if (token < 0 || static_cast<std::uint32_t>(token) >= config.vocab_size) {
      return fail(ErrorCode::kOutOfRange,
                  fmt::format("token id {} outside vocabulary 0..{}", token, config.vocab_size - 1));
    }
  }
  if (position_ + tokens.size() > config.seq_len) {
    return fail(ErrorCode::kOutOfRange, fmt::format("context of {} tokens exceeds the model's seq_len {}",
                                                    position_ + tokens.size(), config.seq_len));
  }
  return ok();
}

Result<std::vector<float>> InferenceSession::decode(std::int32_t token) {
  return prefill(std::span<const std::int32_t>(&token, 1));
}

Result<std::vector<float>> InferenceSession::prefill(std::span<const std::int32_t> tokens, QueryCapture* capture) {
  KVRELAY_TRY(check_tokens(tokens));
  const auto& config = model_->config();
  const std::size_t count = tokens.size();
  if (capture != nullptr && (capture->positions == 0 || capture->positions > count)) {
    return fail(
        ErrorCode::kInvalidArgument,
        fmt::format("cannot capture {} query positions from a prefill of {} tokens", capture->positions, count));
  }
  const std::size_t dim = config.dim;
  const std::size_t kv_dim = config.kv_dim();
  const std::size_t hidden = config.hidden_dim;
  const std::size_t heads = config.heads;
  const std::size_t kv_heads = config.kv_heads;
  const std::size_t head_dim = config.head_dim();
  const std::size_t group = heads / kv_heads;
  // New tokens take RoPE positions start.. and cache rows first_row..; the two are equal except
  // in a sparse session, which holds fewer rows than positions.
  const std::size_t start = position_;
  const std::size_t first_row = rows_;
  const std::size_t context = first_row + count;  // rows the last new token attends over
  KVRELAY_TRY(cache_->reserve(context, first_row));

  // RoPE angles for the new positions, computed as llama2.c does (float pos * float freq).
  const std::size_t half = head_dim / 2;
  std::vector<float> cos_table(count * half);
  std::vector<float> sin_table(count * half);
  for (std::size_t t = 0; t < count; ++t) {
    for (std::size_t i = 0; i < half; ++i) {
      const float freq = 1.0F / std::pow(kRopeTheta, static_cast<float>(2 * i) / static_cast<float>(head_dim));
      const float angle = static_cast<float>(start + t) * freq;
      cos_table[t * half + i] = std::cos(angle);
      sin_table[t * half + i] = std::sin(angle);
    }
  }

  std::vector<float> x(count * dim);
  for (std::size_t t = 0; t < count; ++t) {
    const float* row = model_->token_embedding() + static_cast<std::size_t>(tokens[t]) * dim;
    std::memcpy(x.data() + t * dim, row, dim * sizeof(float));
  }
  std::vector<float> xb(count * dim);
  std::vector<float> q(count * dim);
  std::vector<float> attention_out(count * dim);
  std::vector<float> hb(count * hidden);
  std::vector<float> hb2(count * hidden);
  std::vector<float> scores(std::min(count, kAttentionBlock) * context);
  if (capture != nullptr) capture->data.assign(config.layers * capture->positions * dim, 0.0F);
  const float inv_sqrt_head = 1.0F / std::sqrt(static_cast<float>(head_dim));

  for (std::size_t l = 0; l < config.layers; ++l) {
    const LayerWeights& w = model_->layer(l);
    float* key_cache = cache_->keys(l);
    float* value_cache = cache_->values(l);
    float* new_keys = key_cache + first_row * kv_dim;
    float* new_values = value_cache + first_row * kv_dim;

    for (std::size_t t = 0; t < count; ++t)
      rmsnorm(xb.data() + t * dim, x.data() + t * dim, w.rms_att, dim);
    project(q.data(), dim, xb.data(), w.wq, count, dim, dim);
    project(new_keys, kv_dim, xb.data(), w.wk, count, dim, kv_dim);
    project(new_values, kv_dim, xb.data(), w.wv, count, dim, kv_dim);
    for (std::size_t t = 0; t < count; ++t) {
      apply_rope(q.data() + t * dim, heads, head_dim, &cos_table[t * half], &sin_table[t * half]);
      apply_rope(new_keys + t * kv_dim, kv_heads, head_dim, &cos_table[t * half], &sin_table[t * half]);
    }
    if (capture != nullptr) {
      const std::size_t first = count - capture->positions;
      std::memcpy(capture->data.data() + l * capture->positions * dim, q.data() + first * dim,
                  capture->positions * dim * sizeof(float));
    }

    // Causal attention in blocks of query rows; row t sees cache rows 0..first_row+t.
    for (std::size_t block = 0; block < count; block += kAttentionBlock) {
      const std::size_t rows = std::min(kAttentionBlock, count - block);
      const std::size_t visible = first_row + block + rows;  // keys the last row of the block sees
      for (std::size_t h = 0; h < heads; ++h) {
        const std::size_t kv_head = h / group;
        cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasTrans, blas_int(rows), blas_int(visible), blas_int(head_dim),
                    inv_sqrt_head, q.data() + block * dim + h * head_dim, blas_int(dim), key_cache + kv_head * head_dim,
                    blas_int(kv_dim), 0.0F, scores.data(), blas_int(visible));
        for (std::size_t r = 0; r < rows; ++r) {
          float* row = scores.data() + r * visible;
          const std::size_t row_visible = first_row + block + r + 1;
          softmax(row, row_visible);
          std::fill(row + row_visible, row + visible, 0.0F);
        }
        cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasNoTrans, blas_int(rows), blas_int(head_dim), blas_int(visible),
                    1.0F, scores.data(), blas_int(visible), value_cache + kv_head * head_dim, blas_int(kv_dim), 0.0F,
                    attention_out.data() + block * dim + h * head_dim, blas_int(dim));
      }
    }

    project(xb.data(), dim, attention_out.data(), w.wo, count, dim, dim);
    for (std::size_t i = 0; i < count * dim; ++i)
      x[i] += xb[i];

    for (std::size_t t = 0; t < count; ++t)
      rmsnorm(xb.data() + t * dim, x.data() + t * dim, w.rms_ffn, dim);
    project(hb.data(), hidden, xb.data(), w.w1, count, dim, hidden);
    project(hb2.data(), hidden, xb.data(), w.w3, count, dim, hidden);
    for (std::size_t i = 0; i < count * hidden; ++i) {
      float value = hb[i];
      value *= 1.0F / (1.0F + std::exp(-value));
      hb[i] = value * hb2[i];
    }
    project(xb.data(), dim, hb.data(), w.w2, count, hidden, dim);
    for (std::size_t i = 0; i < count * dim; ++i)
      x[i] += xb[i];
  }
  position_ = start + count;
  rows_ = context;

  std::vector<float> last(dim);
  rmsnorm(last.data(), x.data() + (count - 1) * dim, model_->rms_final(), dim);
  std::vector<float> logits(config.vocab_size);
  project(logits.data(), config.vocab_size, last.data(), model_->classifier(), 1, dim, config.vocab_size);
  return logits;
}

Result<std::vector<float>> InferenceSession::export_kv(std::uint64_t tokens) const {
  if (sparse()) {
    return fail(ErrorCode::kUnsupported,
                fmt::format("cannot export KV from a position-sparse session ({} rows for {} positions): it is not "
                            "the KV of a token prefix",
                            rows_, position_));
  }
  if (tokens > position_) {
    return fail(ErrorCode::kOutOfRange,
                fmt::format("cannot export KV of {} tokens from a session holding {}", tokens, position_));
  }
  const KvLayout kv_layout = layout(tokens);
  KVRELAY_TRY(const std::uint64_t total, kv_layout.total_bytes());
  std::vector<float> out(total / sizeof(float));
  const std::size_t row_floats = static_cast<std::size_t>(tokens) * model_->config().kv_dim();
  float* cursor = out.data();
  for (std::size_t l = 0; l < cache_->layers(); ++l) {
    std::memcpy(cursor, cache_->keys(l), row_floats * sizeof(float));
    cursor += row_floats;
    std::memcpy(cursor, cache_->values(l), row_floats * sizeof(float));
    cursor += row_floats;
  }
  return out;
}

Status InferenceSession::import_kv(const KvLayout& kv_layout, std::span<const float> kv) {
  KVRELAY_TRY(const std::uint64_t total, kv_layout.total_bytes());
  if (kv.size_bytes() != total) {
    return fail(ErrorCode::kLayoutMismatch, fmt::format("KV buffer has {} bytes, layout {} needs {}", kv.size_bytes(),
                                                        kv_layout.describe(), total));
  }
  return import_kv(kv_layout, [kv](std::uint64_t offset, std::span<float> into) -> Status {
    if (!into.empty()) std::memcpy(into.data(), kv.data() + offset, into.size_bytes());  // never from null
    return ok();
  });
}

Status InferenceSession::read_rows(const KvLayout& kv_layout, const KvReader& read) {
  KVRELAY_TRY(kv_layout.validate());
  if (kv_layout != layout(kv_layout.tokens)) {
    return fail(ErrorCode::kLayoutMismatch, fmt::format("KV layout {} does not match the model's {}",
                                                        kv_layout.describe(), layout(kv_layout.tokens).describe()));
  }
  if (kv_layout.tokens > model_->config().seq_len - position_) {  // position_ <= seq_len always
    return fail(ErrorCode::kOutOfRange, fmt::format("KV of {} tokens at position {} exceeds the model's seq_len {}",
                                                    kv_layout.tokens, position_, model_->config().seq_len));
  }
  const std::size_t first_row = static_cast<std::size_t>(rows_);
  const std::size_t tokens = static_cast<std::size_t>(kv_layout.tokens);
  KVRELAY_TRY(cache_->reserve(first_row + tokens, first_row));
  const std::size_t kv_dim = model_->config().kv_dim();
  const std::size_t row_floats = tokens * kv_dim;
  for (std::size_t tensor = 0; tensor < 2 * cache_->layers(); ++tensor) {
    float* into = (tensor % 2 == 0 ? cache_->keys(tensor / 2) : cache_->values(tensor / 2)) + first_row * kv_dim;
    KVRELAY_TRY(read(tensor * row_floats, std::span<float>(into, row_floats)));
    if (!all_finite(std::span<const float>(into, row_floats))) {  // checked where it landed, still in cache
      return fail(ErrorCode::kCorrupt, "imported KV contains a non-finite value");
    }
  }
  return ok();
}

Status InferenceSession::import_kv(const KvLayout& kv_layout, const KvReader& read) {
  if (sparse()) {
    return fail(
        ErrorCode::kUnsupported,
        fmt::format("cannot append KV to a position-sparse session ({} rows for {} positions)", rows_, position_));
  }
  // Rows beyond rows_ are not the session's until the counts move, so a failed read leaves it as it was.
  KVRELAY_TRY(read_rows(kv_layout, read));
  position_ += kv_layout.tokens;
  rows_ += kv_layout.tokens;
  return ok();
}

Status InferenceSession::import_sparse_kv(const KvLayout& kv_layout, std::span<const std::uint32_t> positions,
                                          std::uint64_t context_tokens, const KvReader& read) {
  if (position_ != 0) {
    return fail(ErrorCode::kInvalidArgument,
                fmt::format("sparse KV must be imported into an empty session (it holds {} tokens)", position_));
  }
  if (kv_layout.tokens != positions.size()) {
    return fail(ErrorCode::kLayoutMismatch, fmt::format("sparse KV layout {} holds {} rows for {} kept positions",
                                                        kv_layout.describe(), kv_layout.tokens, positions.size()));
  }
  if (context_tokens > model_->config().seq_len) {
    return fail(ErrorCode::kOutOfRange, fmt::format("sparse KV context of {} tokens exceeds the model's seq_len {}",
                                                    context_tokens, model_->config().seq_len));
  }
  for (std::size_t i = 0; i < positions.size(); ++i) {
    if (positions[i] >= context_tokens) {
      return fail(ErrorCode::kInvalidArgument,
                  fmt::format("kept position {} is outside the context of {} tokens", positions[i], context_tokens));
    }
    if (i > 0 && positions[i] <= positions[i - 1]) {
      return fail(ErrorCode::kInvalidArgument,
                  fmt::format("kept positions must be strictly ascending: {} follows {} at index {}", positions[i],
                              positions[i - 1], i));
    }
  }
  KVRELAY_TRY(read_rows(kv_layout, read));
  rows_ = positions.size();
  position_ = context_tokens;
  if (sparse()) {
    sparse_positions_.assign(positions.begin(), positions.end());
    sparse_context_ = context_tokens;
  }
  return ok();
}

Status InferenceSession::truncate(std::uint64_t tokens) {
  if (tokens > position_) {
    return fail(ErrorCode::kOutOfRange, fmt::format("cannot truncate a session of {} tokens to {}", position_, tokens));
  }
  if (!sparse()) {
    position_ = tokens;  // rows beyond it are overwritten by the next prefill
    rows_ = tokens;
    return ok();
  }
  if (tokens >= sparse_context_) {
    // Only rows appended after the import go: the logical-to-row offset is unchanged.
    rows_ -= position_ - tokens;
  } else {
    // Into the imported context: keep the kept positions below `tokens`.
    const auto kept = std::lower_bound(sparse_positions_.begin(), sparse_positions_.end(), tokens);
    sparse_positions_.erase(kept, sparse_positions_.end());
    sparse_context_ = tokens;
    rows_ = sparse_positions_.size();
  }
  position_ = tokens;
  if (!sparse()) {  // every position below `tokens` is held: a dense chain prefix again
    sparse_positions_.clear();
    sparse_context_ = 0;
  }
  return ok();
}

}  // namespace kvrelay::refworker
