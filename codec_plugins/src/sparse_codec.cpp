// `sparse`: keeps the sinks, the recent window and, per layer and kv head, the middle tokens
// with the largest key L2 norm (a fraction keep_permille / 1000, rounded up). Kept values are
// exact; dropped positions decode as zeros and are listed by sparse_kept_mask(), because the
// receiver must mask them out of attention (it declares position-sparse support first).
//
// Payload per layer: K sink rows, K recent rows, V sink rows, V recent rows (exact); then per
// kv head: a bitmap of the middle tokens (bit t%8 of byte t/8 set = kept, padding bits zero),
// the kept K head rows [kept][head_dim] and the kept V head rows [kept][head_dim], in token order.

#include <algorithm>
#include <bit>
#include <cstring>
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
    for (std::uint32_t layer = 0; layer < plan.shape.layout.layers; ++layer) {
      const std::uint8_t* keys = in + 2 * static_cast<std::size_t>(layer) * plan.shape.tensor_bytes;
      const std::uint8_t* values = keys + plan.shape.tensor_bytes;
      out += put_exact(plan, keys, out);
      out += put_exact(plan, values, out);
      const std::uint8_t* key_middle = keys + plan.split.sink * plan.shape.row_bytes;
      const std::uint8_t* value_middle = values + plan.split.sink * plan.shape.row_bytes;
      for (std::size_t h = 0; h < plan.shape.layout.kv_heads; ++h) {
        for (std::size_t t = 0; t < middle; ++t) {
          detail::load_floats(key_middle + t * plan.shape.row_bytes + h * plan.head_row_bytes, plan.shape.layout.dtype,
                              dim, row.data());
          float sum = 0.0F;
          for (std::size_t d = 0; d < dim; ++d)
            sum += row[d] * row[d];
          norms[t] = sum == sum ? sum : 0.0F;  // NaN ranks lowest
        }
        std::iota(order.begin(), order.end(), std::size_t{0});
        // Largest norm first; ties by position so the choice is deterministic.
        std::nth_element(
            order.begin(), order.begin() + static_cast<std::ptrdiff_t>(plan.kept), order.end(),
            [&](std::size_t a, std::size_t b) { return norms[a] > norms[b] || (norms[a] == norms[b] && a < b); });
        std::uint8_t* bitmap = out;
        std::memset(bitmap, 0, plan.bitmap_bytes);
        for (std::size_t i = 0; i < plan.kept; ++i)
          bitmap[order[i] / 8] |= static_cast<std::uint8_t>(1U << (order[i] % 8));
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
