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

// Reads `into.size()` floats of a KvLayout buffer, starting `offset` floats in: where imported KV
// (a prefix, a span, or a sparse import's kept rows) comes from (memory, or a shared-memory segment
// read straight into the cache).
using KvReader = std::function<Status(std::uint64_t offset, std::span<float> into)>;

// One request's state: the KV cache of the tokens it attends over. Tokens are appended by
// prefill() (many at once, BLAS matrix-matrix products) or decode() (one). The cache is kept per
// layer as K [rows, kv_heads, head_dim] and V likewise, K after RoPE, so exporting a prefix in
// kvrelay's KvLayout is a copy of contiguous rows.
//
// Two counts describe a session. position() is the LOGICAL position: the RoPE position the next
// token gets. cached_rows() is how many K/V rows the cache holds, which new tokens attend over.
// In a dense session (everything except a position-sparse import) they are equal and row i is the
// token at position i. After import_sparse_kv() the cache holds only the kept positions of the
// first context_tokens tokens (rows in ascending position order, each K rotated at its original
// position), so cached_rows() < position(); tokens appended afterwards take rows after them and
// the positions from context_tokens on. The forward pass is the same for both: a new token at
// logical position p attends over every cached row before its own, and is rotated by angle p.
class InferenceSession {
 public:
  // The session allocates its own cache as it grows.
  explicit InferenceSession(const Model& model);
  // The session appends to `cache` (a worker's pre-allocated one; same layers and kv_dim as the
  // model), which must outlive it; whatever the cache held before is overwritten.
  InferenceSession(const Model& model, KvCache& cache);

  // Logical position: tokens of context seen (including those a sparse import dropped); the next
  // token runs at this RoPE position.
  [[nodiscard]] std::uint64_t position() const { return position_; }
  // K/V rows held; equal to position() unless sparse().
  [[nodiscard]] std::uint64_t cached_rows() const { return rows_; }
  // True while the cache lacks some positions below position(): after an import_sparse_kv() that
  // dropped any position (until a truncate() back below the first dropped one).
  [[nodiscard]] bool sparse() const { return rows_ != position_; }
  [[nodiscard]] const Model& model() const { return *model_; }
  [[nodiscard]] KvLayout layout(std::uint64_t tokens) const { return model_->fingerprint().layout(tokens); }

  // Runs `tokens` at positions position()..; returns the logits [vocab] after the last one.
  // With `capture`, also records the queries of the last capture->positions tokens.
  [[nodiscard]] Result<std::vector<float>> prefill(std::span<const std::int32_t> tokens,
                                                   QueryCapture* capture = nullptr);
  [[nodiscard]] Result<std::vector<float>> decode(std::int32_t token);

  // The KV of tokens 0..tokens-1 in KvLayout (per layer K then V), fp32. Fails (kUnsupported) on
  // a sparse session: its rows are not the KV of a chain prefix.
  [[nodiscard]] Result<std::vector<float>> export_kv(std::uint64_t tokens) const;

  // Appends the KV of `layout.tokens` tokens at the session's position: a session at position p
  // (empty, p = 0, or after prefilling or importing tokens 0..p-1) loads the KV of tokens
  // p..p+n-1 as another session computed it (KvLayout order; K rotated at positions p..), and the
  // next prefill continues at p+n. Refused (the session unchanged and usable) on a layout that is
  // not the model's, a buffer of the wrong size, a context beyond seq_len, a non-finite value, or
  // a sparse session (kUnsupported: import_sparse_kv is a whole context).
  [[nodiscard]] Status import_kv(const KvLayout& layout, std::span<const float> kv);
  // The same, reading each K and V tensor of the span straight into the cache with `read`.
  [[nodiscard]] Status import_kv(const KvLayout& layout, const KvReader& read);

  // Position-sparse import (the kv_sparse medium) into an EMPTY session: the KV of only the kept
  // token `positions` (strictly ascending, all < context_tokens <= seq_len) of a context of
  // `context_tokens` tokens, `layout.tokens == positions.size()` rows in KvLayout order, each K
  // rotated at its original position. Afterwards cached_rows() == positions.size(), position() ==
  // context_tokens, and new tokens attend over the kept rows and each other (never over the
  // dropped positions). Keeping every position is exactly import_kv(). Every refusal leaves the
  // session empty and usable: kInvalidArgument for a non-empty session or bad positions,
  // kLayoutMismatch for a layout that is not the model's or whose tokens != positions.size(),
  // kOutOfRange beyond seq_len, kCorrupt for a non-finite value, or the reader's error.
  [[nodiscard]] Status import_sparse_kv(const KvLayout& layout, std::span<const std::uint32_t> positions,
                                        std::uint64_t context_tokens, const KvReader& read);

  // Drops everything after the first `tokens` LOGICAL positions; the next token runs at position
  // `tokens`. On a sparse session the cache keeps the kept positions below `tokens` and the rows
  // appended after the import that are below it; when no dropped position remains below
  // `tokens`, the session is dense again (sparse() false, export_kv allowed).
  [[nodiscard]] Status truncate(std::uint64_t tokens);

 private:
  [[nodiscard]] Status check_tokens(std::span<const std::int32_t> tokens) const;
  // Reads `layout.tokens` rows of every K and V tensor into cache rows rows_.. and checks them.
  [[nodiscard]] Status read_rows(const KvLayout& layout, const KvReader& read);

  const Model* model_;
  std::uint64_t position_ = 0;  // logical position of the next token
  std::uint64_t rows_ = 0;      // cache rows 0..rows_-1 of every layer are this session's
  // Only while sparse(): the kept positions of a sparse import, ascending (row i holds
  // sparse_positions_[i]), and the import's context_tokens; rows past them continue at it.
  std::vector<std::uint32_t> sparse_positions_;
  std::uint64_t sparse_context_ = 0;
  std::unique_ptr<KvCache> owned_cache_;  // when no cache was lent
  KvCache* cache_;
};

}  // namespace kvrelay::refworker
