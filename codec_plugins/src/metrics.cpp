#include "kvrelay/codec_plugins/metrics.h"

#include <fmt/format.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <random>

#include "kvrelay/codec_plugins/builtin_codecs.h"
#include "kvrelay/codec_plugins/sparse.h"

#include "codec_common.h"

namespace kvrelay::codec {
namespace {

// Running sums behind TensorError, so per-layer and overall figures come from one pass.
struct ErrorSums {
  double ref_sq = 0;
  double test_sq = 0;
  double diff_sq = 0;
  double dot = 0;
  double max_abs = 0;

  void add(const float* ref, const float* test, std::size_t count) {
    for (std::size_t i = 0; i < count; ++i) {
      const double a = ref[i];
      const double b = test[i];
      const double d = b - a;
      ref_sq += a * a;
      test_sq += b * b;
      diff_sq += d * d;
      dot += a * b;
      max_abs = std::max(max_abs, std::fabs(d));
    }
  }
  void merge(const ErrorSums& other) {
    ref_sq += other.ref_sq;
    test_sq += other.test_sq;
    diff_sq += other.diff_sq;
    dot += other.dot;
    max_abs = std::max(max_abs, other.max_abs);
  }
  [[nodiscard]] TensorError finish() const {
    TensorError error;
    error.rel_l2 = ref_sq > 0 ? std::sqrt(diff_sq / ref_sq) : (diff_sq > 0 ? 1.0 : 0.0);
    error.snr_db = diff_sq > 0 ? 10.0 * std::log10(ref_sq / diff_sq) : std::numeric_limits<double>::infinity();
    error.cosine = ref_sq > 0 && test_sq > 0 ? dot / std::sqrt(ref_sq * test_sq) : (diff_sq == 0 ? 1.0 : 0.0);
    error.max_abs = max_abs;
    return error;
  }
};

std::vector<float> load_tensor(const KvLayout& layout, std::span<const std::uint8_t> kv, std::uint32_t layer,
                               bool is_value) {
  const std::size_t tensor_bytes = static_cast<std::size_t>(layout.tensor_bytes().value());
  const std::size_t offset = static_cast<std::size_t>(layout.tensor_offset(layer, is_value).value());
  std::vector<float> values(tensor_bytes / dtype_size(layout.dtype));
  detail::load_floats(kv.data() + offset, layout.dtype, values.size(), values.data());
  return values;
}

inline constexpr std::size_t kNoPosition = static_cast<std::size_t>(-1);

// Attention output of one query over one kv head: softmax(q K^T / sqrt(d)) V, masked positions
// skipped. Returns the most attended position (the first of equal scores; kNoPosition when every
// position is masked or no score is a number).
std::size_t attend(const float* query, const std::vector<float>& keys, const std::vector<float>& values,
                   std::size_t tokens, std::size_t row, std::size_t head_offset, std::size_t dim,
                   const std::uint8_t* mask, std::vector<double>& scores, std::vector<double>& out) {
  const double scale = 1.0 / std::sqrt(static_cast<double>(dim));
  double best = -std::numeric_limits<double>::infinity();
  std::size_t argmax = kNoPosition;
  for (std::size_t t = 0; t < tokens; ++t) {
    if (mask != nullptr && mask[t] == 0) {
      scores[t] = -std::numeric_limits<double>::infinity();
      continue;
    }
    const float* key = keys.data() + t * row + head_offset;
    double dot = 0;
    for (std::size_t d = 0; d < dim; ++d)
      dot += static_cast<double>(query[d]) * key[d];
    scores[t] = dot * scale;
    if (scores[t] > best) {
      best = scores[t];
      argmax = t;
    }
  }
  std::fill(out.begin(), out.end(), 0.0);
  if (best == -std::numeric_limits<double>::infinity()) return argmax;
  double total = 0;
  for (std::size_t t = 0; t < tokens; ++t) {
    const double weight = std::exp(scores[t] - best);  // exp(-inf) == 0 for masked positions
    total += weight;
    if (weight == 0) continue;
    const float* value = values.data() + t * row + head_offset;
    for (std::size_t d = 0; d < dim; ++d)
      out[d] += weight * value[d];
  }
  for (double& v : out)
    v /= total;
  return argmax;
}

}  // namespace

Result<QualityReport> compare_kv(const KvLayout& layout, std::span<const std::uint8_t> original,
                                 std::span<const std::uint8_t> decoded, const QuerySet& queries,
                                 std::span<const std::uint8_t> kept) {
  KVRELAY_TRY(auto total, layout.total_bytes());
  if (original.size() != total || decoded.size() != total) {
    return fail(ErrorCode::kLayoutMismatch, fmt::format("KV buffers of {} and {} bytes, layout {} needs {}",
                                                        original.size(), decoded.size(), layout.describe(), total));
  }
  const std::size_t tokens = static_cast<std::size_t>(layout.tokens);
  const std::size_t heads = layout.kv_heads;
  const std::size_t dim = layout.head_dim;
  const std::size_t row = heads * dim;
  if (!kept.empty() && kept.size() != layout.layers * heads * tokens) {
    return fail(ErrorCode::kLayoutMismatch, "kept mask size disagrees with the layout");
  }
  if (queries.count > 0) {
    if (queries.query_heads == 0 || queries.query_heads % heads != 0) {
      return fail(ErrorCode::kInvalidArgument,
                  fmt::format("query heads {} not a multiple of kv heads {}", queries.query_heads, heads));
    }
    if (queries.data.size() != static_cast<std::size_t>(layout.layers) * queries.count * queries.query_heads * dim) {
      return fail(ErrorCode::kLayoutMismatch, "query tensor size disagrees with layers x count x heads x head_dim");
    }
  }
  QualityReport report;
  report.layout = layout;
  report.raw_bytes = total;
  ErrorSums all_keys;
  ErrorSums all_values;
  double attn_diff = 0;
  double attn_ref = 0;
  std::size_t top1_same = 0;
  std::size_t top1_pairs = 0;
  std::vector<double> scores(tokens);
  std::vector<double> out_ref(dim);
  std::vector<double> out_test(dim);
  for (std::uint32_t layer = 0; layer < layout.layers; ++layer) {
    const auto k_ref = load_tensor(layout, original, layer, false);
    const auto v_ref = load_tensor(layout, original, layer, true);
    const auto k_test = load_tensor(layout, decoded, layer, false);
    const auto v_test = load_tensor(layout, decoded, layer, true);
    ErrorSums keys;
    ErrorSums values;
    keys.add(k_ref.data(), k_test.data(), k_ref.size());
    values.add(v_ref.data(), v_test.data(), v_ref.size());
    LayerQuality quality{keys.finish(), values.finish(), 0};
    all_keys.merge(keys);
    all_values.merge(values);
    double layer_diff = 0;
    double layer_ref = 0;
    std::size_t layer_same = 0;
    const std::size_t group = queries.count > 0 ? queries.query_heads / heads : 1;
    for (std::size_t n = 0; n < queries.count; ++n) {
      for (std::size_t qh = 0; qh < queries.query_heads; ++qh) {
        const std::size_t kv_head = qh / group;
        const float* query = queries.data.data() +
                             ((static_cast<std::size_t>(layer) * queries.count + n) * queries.query_heads + qh) * dim;
        const std::uint8_t* mask = kept.empty() ? nullptr : kept.data() + (layer * heads + kv_head) * tokens;
        const std::size_t top_ref =
            attend(query, k_ref, v_ref, tokens, row, kv_head * dim, dim, nullptr, scores, out_ref);
        const std::size_t top_test =
            attend(query, k_test, v_test, tokens, row, kv_head * dim, dim, mask, scores, out_test);
        if (top_test == top_ref && top_ref != kNoPosition) ++layer_same;
        for (std::size_t d = 0; d < dim; ++d) {
          layer_diff += (out_test[d] - out_ref[d]) * (out_test[d] - out_ref[d]);
          layer_ref += out_ref[d] * out_ref[d];
        }
      }
    }
    quality.attn_rel_err = layer_ref > 0 ? std::sqrt(layer_diff / layer_ref) : 0.0;
    const std::size_t pairs = static_cast<std::size_t>(queries.count) * queries.query_heads;
    quality.attention_top1_agreement = pairs > 0 ? static_cast<double>(layer_same) / static_cast<double>(pairs) : 1.0;
    attn_diff += layer_diff;
    attn_ref += layer_ref;
    top1_same += layer_same;
    top1_pairs += pairs;
    report.layers.push_back(quality);
  }
  report.keys = all_keys.finish();
  report.values = all_values.finish();
  report.attn_rel_err = attn_ref > 0 ? std::sqrt(attn_diff / attn_ref) : 0.0;
  report.attention_top1_agreement =
      top1_pairs > 0 ? static_cast<double>(top1_same) / static_cast<double>(top1_pairs) : 1.0;
  return report;
}

Result<QualityReport> evaluate(const CodecRegistry& registry, const CodecSpec& codec, const KvLayout& layout,
                               std::span<const std::uint8_t> kv, const QuerySet& queries,
                               const std::vector<std::uint8_t>& params) {
  if (codec.codec == nullptr) return fail(ErrorCode::kInvalidArgument, "no codec");
  EncodeOptions options;
  options.zstd_stage = codec.zstd_stage;
  options.params = params;
  KVRELAY_TRY(auto frame, encode_frame(*codec.codec, layout, kv, options));
  KVRELAY_TRY(auto total, layout.total_bytes());
  std::vector<std::uint8_t> decoded(total);
  KVRELAY_TRY(decode_frame(registry, frame, decoded));
  std::vector<std::uint8_t> kept;
  if (codec.codec->id() == kSparseCodecId) {
    // The kept positions are in the codec's payload; under a zstd stage, read them from the same
    // encode without it (the selection does not depend on the stage).
    std::vector<std::uint8_t> plain_frame;
    if (codec.zstd_stage) {
      EncodeOptions plain = options;
      plain.zstd_stage = false;
      KVRELAY_TRY(plain_frame, encode_frame(*codec.codec, layout, kv, plain));
    }
    const auto& unstaged = codec.zstd_stage ? plain_frame : frame;
    KVRELAY_TRY(auto header, inspect_frame(unstaged));
    const std::span<const std::uint8_t> payload(unstaged.data() + kFrameHeaderSize + header.params.size(),
                                                header.payload_length);
    KVRELAY_TRY(kept, sparse_kept_mask(layout, header.params, payload));
  }
  KVRELAY_TRY(auto report, compare_kv(layout, kv, decoded, queries, kept));
  report.codec = spec_name(codec);
  report.encoded_bytes = frame.size();
  report.ratio = frame.empty() ? 0.0 : static_cast<double>(total) / static_cast<double>(frame.size());
  return report;
}

Result<QuerySet> sample_queries(const KvLayout& layout, std::span<const std::uint8_t> kv, std::uint32_t count,
                                std::uint32_t query_heads, std::uint64_t seed) {
  KVRELAY_TRY(auto total, layout.total_bytes());
  if (kv.size() != total) return fail(ErrorCode::kLayoutMismatch, "KV buffer size disagrees with the layout");
  if (query_heads == 0 || query_heads % layout.kv_heads != 0) {
    return fail(ErrorCode::kInvalidArgument, "query heads must be a positive multiple of kv heads");
  }
  QuerySet queries;
  queries.count = layout.tokens == 0 ? 0 : count;
  queries.query_heads = query_heads;
  const std::size_t dim = layout.head_dim;
  const std::size_t heads = layout.kv_heads;
  const std::size_t row = heads * dim;
  queries.data.resize(static_cast<std::size_t>(layout.layers) * queries.count * query_heads * dim);
  std::mt19937_64 random(seed);
  std::uniform_int_distribution<std::uint64_t> pick(0, layout.tokens == 0 ? 0 : layout.tokens - 1);
  std::normal_distribution<float> noise(0.0F, 1.0F);
  const std::size_t group = query_heads / heads;
  for (std::uint32_t layer = 0; layer < layout.layers && queries.count > 0; ++layer) {
    const auto keys = load_tensor(layout, kv, layer, false);
    std::vector<float> spread(heads, 0.0F);
    for (std::size_t h = 0; h < heads; ++h) {
      double sum_sq = 0;
      for (std::size_t t = 0; t < layout.tokens; ++t) {
        for (std::size_t d = 0; d < dim; ++d)
          sum_sq += keys[t * row + h * dim + d] * keys[t * row + h * dim + d];
      }
      spread[h] = static_cast<float>(std::sqrt(sum_sq / static_cast<double>(layout.tokens * dim)));
    }
    for (std::size_t n = 0; n < queries.count; ++n) {
      for (std::size_t qh = 0; qh < query_heads; ++qh) {
        const std::size_t h = qh / group;
        const auto t = static_cast<std::size_t>(pick(random));
        float* query = queries.data.data() + ((layer * queries.count + n) * query_heads + qh) * dim;
        for (std::size_t d = 0; d < dim; ++d)
          query[d] = keys[t * row + h * dim + d] + 0.5F * spread[h] * noise(random);
      }
    }
  }
  return queries;
}

Result<std::vector<std::uint8_t>> synthetic_kv(const KvLayout& layout, std::uint64_t seed,
                                               std::uint32_t outlier_channels, float outlier_scale) {
  KVRELAY_TRY(auto total, layout.total_bytes());
  const std::size_t elements = total / dtype_size(layout.dtype);
  std::vector<float> values(elements);
  std::mt19937_64 random(seed);
  std::normal_distribution<float> normal(0.0F, 1.0F);
  const std::size_t dim = layout.head_dim;
  const std::size_t row = static_cast<std::size_t>(layout.kv_heads) * dim;
  const std::size_t tensor = row * layout.tokens;
  std::uniform_int_distribution<std::size_t> channel(0, dim - 1);
  for (std::uint32_t layer = 0; layer < layout.layers; ++layer) {
    // Fixed outlier channels per head and layer: large magnitude and a bias, as in real keys.
    std::vector<float> gain(row, 1.0F);
    std::vector<float> bias(row, 0.0F);
    for (std::size_t h = 0; h < layout.kv_heads; ++h) {
      for (std::uint32_t i = 0; i < outlier_channels; ++i) {
        const std::size_t c = h * dim + channel(random);
        gain[c] = outlier_scale;
        bias[c] = outlier_scale * 0.5F;
      }
    }
    float* keys = values.data() + 2 * static_cast<std::size_t>(layer) * tensor;
    float* vals = keys + tensor;
    for (std::size_t t = 0; t < layout.tokens; ++t) {
      for (std::size_t c = 0; c < row; ++c)
        keys[t * row + c] = normal(random) * gain[c] + bias[c];
      for (std::size_t c = 0; c < row; ++c)
        vals[t * row + c] = normal(random);
    }
  }
  std::vector<std::uint8_t> bytes(total);
  detail::store_floats(values.data(), layout.dtype, elements, bytes.data());
  return bytes;
}

}  // namespace kvrelay::codec
