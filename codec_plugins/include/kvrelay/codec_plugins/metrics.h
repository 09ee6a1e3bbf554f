#pragma once

// Quality of a lossy codec on a KV sample: tensor-level errors per layer for K and V and the
// error it causes in attention outputs, the figure that decides whether a model notices.

#include <cstdint>
#include <optional>
#include <span>
#include <string>
#include <vector>

#include "kvrelay/codec_plugins/frame.h"
#include "kvrelay/codec_plugins/registry.h"
#include "kvrelay/core/kv_layout.h"
#include "kvrelay/core/result.h"

namespace kvrelay::codec {

struct TensorError {
  double rel_l2 = 0;   // |x' - x| / |x|
  double snr_db = 0;   // 10 log10(|x|^2 / |x' - x|^2); +inf when exact
  double cosine = 1;   // <x, x'> / (|x| |x'|)
  double max_abs = 0;  // max |x' - x|
};

struct LayerQuality {
  TensorError keys;
  TensorError values;
  double attn_rel_err = 0;
  double attention_top1_agreement = 1;  // see QualityReport
};

// Queries for the attention error, fp32 [layers][count][query_heads][head_dim]. query_heads is a
// multiple of kv_heads; query head h reads kv head h / (query_heads / kv_heads) (GQA).
struct QuerySet {
  std::uint32_t count = 0;
  std::uint32_t query_heads = 0;
  std::vector<float> data;
};

struct QualityReport {
  std::string codec;
  KvLayout layout;
  std::uint64_t raw_bytes = 0;
  std::uint64_t encoded_bytes = 0;  // whole frame
  double ratio = 0;                 // raw / encoded
  std::vector<LayerQuality> layers;
  TensorError keys;         // over all layers
  TensorError values;       // over all layers
  double attn_rel_err = 0;  // |O' - O| / |O| over all layers, queries and heads
  // Of the (layer, query, query head) triples, the fraction whose most attended key position
  // (argmax of q K^T / sqrt(d); the first of equal scores; positions a sparse codec dropped
  // excluded on the decoded side) is the same with the decoded KV as with the original. An
  // attention-level figure, not next-token agreement. 1 when there are no queries.
  double attention_top1_agreement = 1;
};

// Compares two KV buffers of `layout`. `kept` (optional, [layers][kv_heads][tokens], 1 = present)
// masks positions out of the decoded side's attention, as a position-sparse receiver would.
[[nodiscard]] Result<QualityReport> compare_kv(const KvLayout& layout, std::span<const std::uint8_t> original,
                                               std::span<const std::uint8_t> decoded, const QuerySet& queries,
                                               std::span<const std::uint8_t> kept = {});

// Encodes `kv` into a frame, decodes it and compares; sparse codecs get their kept mask applied.
[[nodiscard]] Result<QualityReport> evaluate(const CodecRegistry& registry, const CodecSpec& codec,
                                             const KvLayout& layout, std::span<const std::uint8_t> kv,
                                             const QuerySet& queries, const std::vector<std::uint8_t>& params = {});

// `count` queries per layer and query head: a key of a random position plus Gaussian noise of
// that head's key spread, which gives peaked attention like real queries.
[[nodiscard]] Result<QuerySet> sample_queries(const KvLayout& layout, std::span<const std::uint8_t> kv,
                                              std::uint32_t count, std::uint32_t query_heads, std::uint64_t seed);

// Synthetic KV: Gaussian values with a few key channels per head scaled up and offset, the
// outlier pattern observed in real models' keys.
[[nodiscard]] Result<std::vector<std::uint8_t>> synthetic_kv(const KvLayout& layout, std::uint64_t seed,
                                                             std::uint32_t outlier_channels = 2,
                                                             float outlier_scale = 12.0F);

}  // namespace kvrelay::codec
