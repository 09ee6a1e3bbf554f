#pragma once

#include <cstdint>
#include <functional>
#include <memory>
#include <span>
#include <vector>

#include "kvrelay/core/kv_layout.h"
#include "kvrelay/core/result.h"
#include "kvrelay/refworker/kv_cache.h"
#include "kvrelay/refworker/model.h"

namespace kvrelay::refworker {

// Query vectors (after RoPE) of the last `positions` tokens of a prefill, for every layer:
// [layers, positions, heads, head_dim] fp32. Codec evaluation needs real queries to measure the
// attention-output error that a lossy KV causes.
struct QueryCapture {
  std::uint32_t positions = 0;
  std::vector<float> data;
};

// Reads `into.size()` floats of a KvLayout buffer, starting `offset` floats in: where an imported
// prefix comes from (memory, or a shared-memory segment read straight into the cache).
using KvReader = std::function<Status(std::uint64_t offset, std::span<float> into)>;

// One request's state: the KV cache of every token seen so far. Tokens are appended by
// prefill() (many at once, BLAS matrix-matrix products) or decode() (one). The cache is kept per
// layer as K [tokens, kv_heads, head_dim] and V likewise, K after RoPE, so exporting a prefix in
// kvrelay's KvLayout is a copy of contiguous rows.
class InferenceSession {
 public:
  // The session allocates its own cache as it grows.
  explicit InferenceSession(const Model& model);
  // The session appends to `cache` (a worker's pre-allocated one; same layers and kv_dim as the
  // model), which must outlive it; whatever the cache held before is overwritten.
  InferenceSession(const Model& model, KvCache& cache);

  [[nodiscard]] std::uint64_t position() const { return position_; }
  [[nodiscard]] const Model& model() const { return *model_; }
  [[nodiscard]] KvLayout layout(std::uint64_t tokens) const { return model_->fingerprint().layout(tokens); }

  // Runs `tokens` at positions position()..; returns the logits [vocab] after the last one.
  // With `capture`, also records the queries of the last capture->positions tokens.
  [[nodiscard]] Result<std::vector<float>> prefill(std::span<const std::int32_t> tokens,
                                                   QueryCapture* capture = nullptr);
  [[nodiscard]] Result<std::vector<float>> decode(std::int32_t token);

  // The KV of tokens 0..tokens-1 in KvLayout (per layer K then V), fp32.
  [[nodiscard]] Result<std::vector<float>> export_kv(std::uint64_t tokens) const;
  // Loads a KV prefix into an empty session; the next prefill continues at position `tokens`.
  [[nodiscard]] Status import_kv(const KvLayout& layout, std::span<const float> kv);
  // The same, reading each K and V tensor of the prefix straight into the cache with `read`.
  [[nodiscard]] Status import_kv(const KvLayout& layout, const KvReader& read);

  // Drops everything after the first `tokens` tokens (cache rows beyond it are forgotten).
  [[nodiscard]] Status truncate(std::uint64_t tokens);

 private:
  [[nodiscard]] Status check_tokens(std::span<const std::int32_t> tokens) const;

  const Model* model_;
  std::uint64_t position_ = 0;
  std::unique_ptr<KvCache> owned_cache_;  // when no cache was lent
  KvCache* cache_;                        // rows 0..position_-1 of every layer are this session's
};

}  // namespace kvrelay::refworker
