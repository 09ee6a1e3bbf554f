// `sparse`: keeps the sinks, the recent window and the middle tokens with the largest key L2
// norm (a fraction keep_permille / 1000, rounded up): by default one set of positions for every
// layer and kv head, ranked by the norms summed over all of them (sparse_keep_positions, the rule
// of the kv_sparse medium); with per_position false, a set per layer and kv head. Kept values are
// exact; dropped positions decode as zeros and are listed by sparse_kept_mask(), because the
// receiver must mask them out of attention (it declares position-sparse support first).
//
// Payload per layer: K sink rows, K recent rows, V sink rows, V recent rows (exact); then per
// kv head: a bitmap of the middle tokens (bit t%8 of byte t/8 set = kept, padding bits zero),
// the kept K head rows [kept][head_dim] and the kept V head rows [kept][head_dim], in token order.
// Both modes write the same format; per position, every head's bitmap is the same.

#include <fmt/format.h>

#include <algorithm>
#include <bit>
#include <cmath>
#include <cstring>
#include <limits>
#include <numeric>
#include <vector>

#include "kvrelay/codec_plugins/builtin_codecs.h"
#include "kvrelay/codec_plugins/sparse.h"

#include "codec_common.h"

namespace kvrelay::codec {
namespace {

using detail::Shape;
using detail::TokenSplit;

struct Plan {
  Shape shape;
  BuiltinParams params;
  TokenSplit split;
  std::size_t kept = 0;          // per head
  std::size_t bitmap_bytes = 0;  // per head
  std::size_t head_row_bytes = 0;
  std::size_t per_head = 0;
  std::size_t per_layer = 0;
  std::size_t total = 0;
};

int make_plan(const kvrelay_codec_layout* layout, const void* params, std::size_t params_size, Plan& plan) {
  if (const int code = detail::make_shape(layout, detail::ElementAccess::kFloats, plan.shape); code != KVRELAY_CODEC_OK)
    return code;
  if (const int code = detail::parse_params(params, params_size, plan.params); code != KVRELAY_CODEC_OK) return code;
  plan.split = detail::split_tokens(plan.shape.tokens, plan.params);
  // Rounded up, in 64-bit arithmetic: middle is below 2^53 here, so the product cannot overflow.
  plan.kept = static_cast<std::size_t>(
      (static_cast<unsigned __int128>(plan.split.middle) * plan.params.keep_permille + 999) / 1000);
  plan.bitmap_bytes = (plan.split.middle + 7) / 8;
  plan.head_row_bytes = static_cast<std::size_t>(plan.shape.layout.head_dim) * plan.shape.element_size;
  plan.per_head = plan.bitmap_bytes + 2 * plan.kept * plan.head_row_bytes;
  plan.per_layer =
      2 * (plan.split.sink + plan.split.recent) * plan.shape.row_bytes + plan.per_head * plan.shape.layout.kv_heads;
  plan.total = plan.per_layer * plan.shape.layout.layers;
  return KVRELAY_CODEC_OK;
}

bool kept_bit(const std::uint8_t* bitmap, std::size_t t) {
  return ((static_cast<unsigned>(bitmap[t / 8]) >> (t % 8)) & 1U) != 0;
}

// Sets bit t of `bitmap` (bitmap_bytes, zeroed here) for each middle position t among the
// `plan.kept` best by `better`, a strict order of positions (the first ones are kept).
template <class Better>
void mark_best(const Plan& plan, std::vector<std::size_t>& order, Better better, std::uint8_t* bitmap) {
  std::iota(order.begin(), order.end(), std::size_t{0});
  std::nth_element(order.begin(), order.begin() + static_cast<std::ptrdiff_t>(plan.kept), order.end(), better);
  if (plan.bitmap_bytes != 0) std::memset(bitmap, 0, plan.bitmap_bytes);
  for (std::size_t i = 0; i < plan.kept; ++i)
    bitmap[order[i] / 8] |= static_cast<std::uint8_t>(1U << (order[i] % 8));
}

// The per-position rule: scores each middle position by its key L2 norms summed over every layer
// and kv head (double; NaN when any element is NaN) and marks the best in `bitmap`.
void select_positions(const Plan& plan, const std::uint8_t* kv, std::uint8_t* bitmap) {
  const std::size_t middle = plan.split.middle;
  const std::size_t heads = plan.shape.layout.kv_heads;
  const std::size_t dim = plan.shape.layout.head_dim;
  std::vector<double> scores(middle, 0.0);
  std::vector<float> row(plan.shape.row_elements);
  for (std::uint32_t layer = 0; layer < plan.shape.layout.layers && middle > 0; ++layer) {
    const std::uint8_t* key_middle =
        kv + 2 * static_cast<std::size_t>(layer) * plan.shape.tensor_bytes + plan.split.sink * plan.shape.row_bytes;
    for (std::size_t t = 0; t < middle; ++t) {
      detail::load_floats(key_middle + t * plan.shape.row_bytes, plan.shape.layout.dtype, row.size(), row.data());
      double score = 0.0;
      for (std::size_t h = 0; h < heads; ++h) {
        double sum = 0.0;
        for (std::size_t d = 0; d < dim; ++d)
          sum += static_cast<double>(row[h * dim + d]) * row[h * dim + d];
        score += std::sqrt(sum);
      }
      scores[t] += score;
    }
  }
  // Norms are >= 0 (or +inf): -1 puts NaN below all of them.
  for (double& score : scores)
    if (std::isnan(score)) score = -1.0;
  std::vector<std::size_t> order(middle);
  mark_best(
      plan, order,
      [&](std::size_t a, std::size_t b) { return scores[a] > scores[b] || (scores[a] == scores[b] && a < b); }, bitmap);
}

std::uint64_t sparse_max_size(const kvrelay_codec_layout* layout, const void* params, std::size_t params_size) {
  Plan plan;
  return make_plan(layout, params, params_size, plan) == KVRELAY_CODEC_OK ? plan.total : 0;
}

// Copies sink and recent rows of one tensor to `out`, returns bytes written.
std::size_t put_exact(const Plan& plan, const std::uint8_t* tensor, std::uint8_t* out) {
  const std::size_t sink_bytes = plan.split.sink * plan.shape.row_bytes;
  const std::size_t recent_bytes = plan.split.recent * plan.shape.row_bytes;
  detail::copy_bytes(out, tensor, sink_bytes);
  detail::copy_bytes(out + sink_bytes, tensor + (plan.shape.tokens - plan.split.recent) * plan.shape.row_bytes,
                     recent_bytes);
  return sink_bytes + recent_bytes;
}

std::size_t get_exact(const Plan& plan, const std::uint8_t* in, std::uint8_t* tensor) {
  const std::size_t sink_bytes = plan.split.sink * plan.shape.row_bytes;
  const std::size_t recent_bytes = plan.split.recent * plan.shape.row_bytes;
  detail::copy_bytes(tensor, in, sink_bytes);
  detail::copy_bytes(tensor + (plan.shape.tokens - plan.split.recent) * plan.shape.row_bytes, in + sink_bytes,
                     recent_bytes);
  return sink_bytes + recent_bytes;
}

int sparse_encode(const kvrelay_codec_layout* layout, const void* params, std::size_t params_size, const void* input,
                  std::size_t input_size, void* output, std::size_t output_capacity, std::size_t* output_size) {
  return detail::guarded([&] {
    Plan plan;
    if (const int code = make_plan(layout, params, params_size, plan); code != KVRELAY_CODEC_OK) return code;
    if (input_size != plan.shape.total_bytes || output_capacity < plan.total || output_size == nullptr) {
      return KVRELAY_CODEC_E_INVALID_ARGUMENT;
    }
    const auto* in = static_cast<const std::uint8_t*>(input);
    auto* out = static_cast<std::uint8_t*>(output);
    const std::size_t dim = plan.shape.layout.head_dim;
    const std::size_t middle = plan.split.middle;
    std::vector<float> row(dim);
    std::vector<float> norms(middle);
    std::vector<std::size_t> order(middle);
    std::vector<std::uint8_t> shared(plan.bitmap_bytes);  // per position: every head's bitmap
    if (plan.params.per_position) select_positions(plan, in, shared.data());
    for (std::uint32_t layer = 0; layer < plan.shape.layout.layers; ++layer) {
      const std::uint8_t* keys = in + 2 * static_cast<std::size_t>(layer) * plan.shape.tensor_bytes;
      const std::uint8_t* values = keys + plan.shape.tensor_bytes;
      out += put_exact(plan, keys, out);
      out += put_exact(plan, values, out);
      const std::uint8_t* key_middle = keys + plan.split.sink * plan.shape.row_bytes;
      const std::uint8_t* value_middle = values + plan.split.sink * plan.shape.row_bytes;
      for (std::size_t h = 0; h < plan.shape.layout.kv_heads; ++h) {
        std::uint8_t* bitmap = out;
        if (plan.params.per_position) {
          detail::copy_bytes(bitmap, shared.data(), plan.bitmap_bytes);
        } else {
          for (std::size_t t = 0; t < middle; ++t) {
            detail::load_floats(key_middle + t * plan.shape.row_bytes + h * plan.head_row_bytes,
                                plan.shape.layout.dtype, dim, row.data());
            float sum = 0.0F;
            for (std::size_t d = 0; d < dim; ++d)
              sum += row[d] * row[d];
            norms[t] = sum == sum ? sum : 0.0F;  // NaN ranks lowest
          }
          // Largest norm first; ties by position so the choice is deterministic.
          mark_best(
              plan, order,
              [&](std::size_t a, std::size_t b) { return norms[a] > norms[b] || (norms[a] == norms[b] && a < b); },
              bitmap);
        }
        std::uint8_t* key_rows = bitmap + plan.bitmap_bytes;
        std::uint8_t* value_rows = key_rows + plan.kept * plan.head_row_bytes;
        std::size_t written = 0;
        for (std::size_t t = 0; t < middle; ++t) {
          if (!kept_bit(bitmap, t)) continue;
          const std::size_t offset = t * plan.shape.row_bytes + h * plan.head_row_bytes;
          std::memcpy(key_rows + written * plan.head_row_bytes, key_middle + offset, plan.head_row_bytes);
          std::memcpy(value_rows + written * plan.head_row_bytes, value_middle + offset, plan.head_row_bytes);
          ++written;
        }
        out += plan.per_head;
      }
    }
    *output_size = plan.total;
    return KVRELAY_CODEC_OK;
  });
}

// Checks one head's bitmap: exactly `kept` bits set, padding bits clear.
bool bitmap_valid(const std::uint8_t* bitmap, const Plan& plan) {
  std::size_t count = 0;
  for (std::size_t i = 0; i < plan.bitmap_bytes; ++i)
    count += static_cast<std::size_t>(std::popcount(bitmap[i]));
  if (count != plan.kept) return false;
  const std::size_t tail_bits = plan.split.middle % 8;
  return tail_bits == 0 || (bitmap[plan.bitmap_bytes - 1] >> tail_bits) == 0;
}

int sparse_decode(const kvrelay_codec_layout* layout, const void* params, std::size_t params_size, const void* input,
                  std::size_t input_size, void* output, std::size_t output_size) {
  return detail::guarded([&] {
    Plan plan;
    if (const int code = make_plan(layout, params, params_size, plan); code != KVRELAY_CODEC_OK) return code;
    if (output_size != plan.shape.total_bytes) return KVRELAY_CODEC_E_INVALID_ARGUMENT;
    if (input_size < plan.total) return KVRELAY_CODEC_E_TRUNCATED;
    if (input_size > plan.total) return KVRELAY_CODEC_E_LAYOUT_MISMATCH;
    const auto* in = static_cast<const std::uint8_t*>(input);
    // Validate every bitmap before writing anything.
    for (std::size_t layer = 0; layer < plan.shape.layout.layers; ++layer) {
      const std::uint8_t* heads =
          in + layer * plan.per_layer + 2 * (plan.split.sink + plan.split.recent) * plan.shape.row_bytes;
      for (std::size_t h = 0; h < plan.shape.layout.kv_heads; ++h) {
        if (!bitmap_valid(heads + h * plan.per_head, plan)) return KVRELAY_CODEC_E_CORRUPT;
      }
    }
    auto* out = static_cast<std::uint8_t*>(output);
    if (output_size != 0) std::memset(out, 0, output_size);
    for (std::uint32_t layer = 0; layer < plan.shape.layout.layers; ++layer) {
      std::uint8_t* keys = out + 2 * static_cast<std::size_t>(layer) * plan.shape.tensor_bytes;
      std::uint8_t* values = keys + plan.shape.tensor_bytes;
      in += get_exact(plan, in, keys);
      in += get_exact(plan, in, values);
      std::uint8_t* key_middle = keys + plan.split.sink * plan.shape.row_bytes;
      std::uint8_t* value_middle = values + plan.split.sink * plan.shape.row_bytes;
      for (std::size_t h = 0; h < plan.shape.layout.kv_heads; ++h) {
        const std::uint8_t* bitmap = in;
        const std::uint8_t* key_rows = bitmap + plan.bitmap_bytes;
        const std::uint8_t* value_rows = key_rows + plan.kept * plan.head_row_bytes;
        std::size_t read = 0;
        for (std::size_t t = 0; t < plan.split.middle; ++t) {
          if (!kept_bit(bitmap, t)) continue;
          const std::size_t offset = t * plan.shape.row_bytes + h * plan.head_row_bytes;
          std::memcpy(key_middle + offset, key_rows + read * plan.head_row_bytes, plan.head_row_bytes);
          std::memcpy(value_middle + offset, value_rows + read * plan.head_row_bytes, plan.head_row_bytes);
          ++read;
        }
        in += plan.per_head;
      }
    }
    return KVRELAY_CODEC_OK;
  });
}

const auto kSparseWire = BuiltinParams{}.serialize();

const kvrelay_codec_plugin kSparse = {KVRELAY_CODEC_ABI_VERSION,
                                      sizeof(kvrelay_codec_plugin),
                                      "sparse",
                                      kSparseCodecId,
                                      KVRELAY_CODEC_FLAG_HOST_MEMORY | KVRELAY_CODEC_FLAG_POSITION_SPARSE,
                                      kSparseWire.data(),
                                      static_cast<std::uint32_t>(kSparseWire.size()),
                                      sparse_max_size,
                                      sparse_encode,
                                      sparse_decode,
                                      detail::builtin_error_text};

}  // namespace

const kvrelay_codec_plugin* sparse_codec() noexcept {
  return &kSparse;
}

std::uint64_t sparse_kept_count(std::uint64_t tokens, const SparseKeep& rule) noexcept {
  const std::uint64_t sinks = std::min<std::uint64_t>(rule.sink_tokens, tokens);
  const std::uint64_t recent = std::min<std::uint64_t>(rule.recent_tokens, tokens - sinks);
  const std::uint64_t middle = tokens - sinks - recent;
  const std::uint32_t keep = std::min<std::uint32_t>(rule.keep_permille, 1000);
  return sinks + recent + static_cast<std::uint64_t>((static_cast<unsigned __int128>(middle) * keep + 999) / 1000);
}

Result<std::vector<TokenRun>> sparse_keep_positions(const KvLayout& layout, std::span<const std::byte> kv,
                                                    const SparseKeep& rule) {
  if (rule.keep_permille > 1000) {
    return fail(ErrorCode::kInvalidArgument, fmt::format("keep fraction {} per mille above 1000", rule.keep_permille));
  }
  if (layout.tokens > std::numeric_limits<std::uint32_t>::max()) {
    return fail(ErrorCode::kOutOfRange, fmt::format("{} tokens: positions are 32-bit", layout.tokens));
  }
  KVRELAY_TRY(layout.validate());
  if (dtype_moves_as_bytes(layout.dtype)) {
    return fail(ErrorCode::kUnsupported,
                fmt::format("sparse positions rank key norms; {} KV has none to rank", dtype_name(layout.dtype)));
  }
  BuiltinParams params;
  params.sink_tokens = rule.sink_tokens;
  params.recent_tokens = rule.recent_tokens;
  params.keep_permille = rule.keep_permille;
  const auto wire = params.serialize();
  const kvrelay_codec_layout c_layout{layout.layers, layout.kv_heads, layout.head_dim,
                                      static_cast<std::uint32_t>(layout.dtype), layout.tokens};
  Plan plan;
  if (const int code = make_plan(&c_layout, wire.data(), wire.size(), plan); code != KVRELAY_CODEC_OK) {
    return fail(static_cast<ErrorCode>(code), fmt::format("sparse: layout {} refused", layout.describe()));
  }
  if (kv.size() != plan.shape.total_bytes) {
    return fail(ErrorCode::kLayoutMismatch, fmt::format("KV of {} bytes, layout {} needs {}", kv.size(),
                                                        layout.describe(), plan.shape.total_bytes));
  }
  std::vector<std::uint8_t> bitmap(plan.bitmap_bytes);
  select_positions(plan, reinterpret_cast<const std::uint8_t*>(kv.data()), bitmap.data());
  std::vector<TokenRun> runs;
  const auto keep = [&runs](std::size_t position) {
    const auto at = static_cast<std::uint32_t>(position);
    if (!runs.empty() && runs.back().start + runs.back().length == at) {
      ++runs.back().length;
    } else {
      runs.push_back({at, 1});
    }
  };
  const std::size_t tokens = plan.shape.tokens;
  for (std::size_t t = 0; t < plan.split.sink; ++t)
    keep(t);
  for (std::size_t t = 0; t < plan.split.middle; ++t)
    if (kept_bit(bitmap.data(), t)) keep(plan.split.sink + t);
  for (std::size_t t = tokens - plan.split.recent; t < tokens; ++t)
    keep(t);
  return runs;
}

Result<std::vector<std::uint8_t>> sparse_kept_mask(const KvLayout& layout, std::span<const std::uint8_t> params,
                                                   std::span<const std::uint8_t> payload) {
  const kvrelay_codec_layout c_layout{layout.layers, layout.kv_heads, layout.head_dim,
                                      static_cast<std::uint32_t>(layout.dtype), layout.tokens};
  Plan plan;
  if (const int code = make_plan(&c_layout, params.data(), params.size(), plan); code != KVRELAY_CODEC_OK) {
    return fail(static_cast<ErrorCode>(code), "sparse: invalid layout or params");
  }
  if (payload.size() != plan.total)
    return fail(ErrorCode::kLayoutMismatch, "sparse: payload size disagrees with layout");
  const std::size_t heads = plan.shape.layout.kv_heads;
  std::vector<std::uint8_t> mask(plan.shape.layout.layers * heads * plan.shape.tokens, 0);
  for (std::size_t layer = 0; layer < plan.shape.layout.layers; ++layer) {
    const std::uint8_t* head_data =
        payload.data() + layer * plan.per_layer + 2 * (plan.split.sink + plan.split.recent) * plan.shape.row_bytes;
    for (std::size_t h = 0; h < heads; ++h) {
      const std::uint8_t* bitmap = head_data + h * plan.per_head;
      if (!bitmap_valid(bitmap, plan)) return fail(ErrorCode::kCorrupt, "sparse: bad kept-position bitmap");
      std::uint8_t* row = mask.data() + (layer * heads + h) * plan.shape.tokens;
      for (std::size_t t = 0; t < plan.split.sink; ++t)
        row[t] = 1;
      for (std::size_t t = plan.shape.tokens - plan.split.recent; t < plan.shape.tokens; ++t)
        row[t] = 1;
      for (std::size_t t = 0; t < plan.split.middle; ++t)
        row[plan.split.sink + t] = kept_bit(bitmap, t) ? 1 : 0;
    }
  }
  return mask;
}

}  // namespace kvrelay::codec
