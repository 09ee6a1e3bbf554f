// fp8 / int8 / int4: lossy quantizers keeping the sink tokens and the recent window exact.
// Keys are quantized per channel over groups of tokens and values per token over groups of
// channels (KIVI's grouping): key outliers live in fixed channels, value outliers in tokens.

#include <algorithm>
#include <cstring>
#include <vector>

#include "kvrelay/codec_plugins/builtin_codecs.h"

#include "codec_common.h"
#include "quant_layout.h"

namespace kvrelay::codec {
namespace {

using detail::QuantKind;
using detail::QuantSection;
using detail::Shape;
using detail::TokenSplit;

struct Plan {
  Shape shape;
  BuiltinParams params;
  TokenSplit split;
  QuantSection key_section;
  QuantSection value_section;
  std::size_t per_layer = 0;
  std::size_t total = 0;
};

int make_plan(QuantKind kind, const kvrelay_codec_layout* layout, const void* params, std::size_t params_size,
              Plan& plan) {
  if (const int code = detail::make_shape(layout, plan.shape); code != KVRELAY_CODEC_OK) return code;
  if (const int code = detail::parse_params(params, params_size, plan.params); code != KVRELAY_CODEC_OK) return code;
  plan.split = detail::split_tokens(plan.shape.tokens, plan.params);
  const std::size_t heads = plan.shape.layout.kv_heads;
  const std::size_t dim = plan.shape.layout.head_dim;
  plan.key_section = detail::quant_section(kind, false, plan.split.middle, heads, dim, plan.params.group_size);
  plan.value_section = detail::quant_section(kind, true, plan.split.middle, heads, dim, plan.params.group_size);
  const std::size_t exact = (plan.split.sink + plan.split.recent) * plan.shape.row_bytes;
  // Every term is at most the raw tensor size plus small metadata, so no overflow below 2^62.
  plan.per_layer = 2 * exact + plan.key_section.total() + plan.value_section.total();
  plan.total = plan.per_layer * plan.shape.layout.layers;
  return KVRELAY_CODEC_OK;
}

float max_code(QuantKind kind) {
  return kind == QuantKind::kInt4 ? 15.0F : 255.0F;
}

void pack_codes(QuantKind kind, const std::uint8_t* codes, std::size_t count, std::uint8_t* out) {
  if (kind != QuantKind::kInt4) {
    detail::copy_bytes(out, codes, count);
    return;
  }
  const std::size_t pairs = count / 2;
  for (std::size_t i = 0; i < pairs; ++i) {
    out[i] = static_cast<std::uint8_t>(codes[2 * i] | (codes[2 * i + 1] << 4));
  }
  if (count % 2 != 0) out[pairs] = codes[count - 1];
}

void unpack_codes(QuantKind kind, const std::uint8_t* in, std::size_t count, std::uint8_t* codes) {
  if (kind != QuantKind::kInt4) {
    std::memcpy(codes, in, count);
    return;
  }
  const std::size_t pairs = count / 2;
  for (std::size_t i = 0; i < pairs; ++i) {
    codes[2 * i] = in[i] & 0xFU;
    codes[2 * i + 1] = static_cast<std::uint8_t>(in[i] >> 4);
  }
  if (count % 2 != 0) codes[count - 1] = in[pairs] & 0xFU;
}

// Scratch buffers reused across tensors of one call.
struct Scratch {
  std::vector<float> values;
  std::vector<float> lo;
  std::vector<float> hi;
  std::vector<float> zero;
  std::vector<float> scale;
  std::vector<float> inv;
  std::vector<std::uint8_t> codes;
};

void encode_fp8(const Plan& plan, const std::uint8_t* rows, std::uint8_t* meta, std::uint8_t* codes, Scratch& s) {
  const std::size_t heads = plan.shape.layout.kv_heads;
  const std::size_t dim = plan.shape.layout.head_dim;
  const std::size_t row = plan.shape.row_elements;
  for (std::size_t t = 0; t < plan.split.middle; ++t) {
    detail::load_floats(rows + t * plan.shape.row_bytes, plan.shape.layout.dtype, row, s.values.data());
    for (std::size_t h = 0; h < heads; ++h) {
      const float* x = s.values.data() + h * dim;
      const float amax = detail::abs_max(x, dim);
      const float scale = amax > 0.0F && amax < __builtin_inff() ? amax / kFp8E4m3Max : 1.0F;
      const float inv = 1.0F / scale;
      std::memcpy(meta + (t * heads + h) * 4, &scale, 4);
      std::uint8_t* out = codes + t * row + h * dim;
      for (std::size_t d = 0; d < dim; ++d)
        out[d] = float_to_e4m3(x[d] * inv);
    }
  }
}

void decode_fp8(const Plan& plan, const std::uint8_t* meta, const std::uint8_t* codes, std::uint8_t* rows, Scratch& s) {
  const std::size_t heads = plan.shape.layout.kv_heads;
  const std::size_t dim = plan.shape.layout.head_dim;
  const std::size_t row = plan.shape.row_elements;
  float table[256];
  for (unsigned c = 0; c < 256; ++c)
    table[c] = e4m3_to_float(static_cast<std::uint8_t>(c));
  for (std::size_t t = 0; t < plan.split.middle; ++t) {
    for (std::size_t h = 0; h < heads; ++h) {
      float scale;
      std::memcpy(&scale, meta + (t * heads + h) * 4, 4);
      const std::uint8_t* in = codes + t * row + h * dim;
      float* x = s.values.data() + h * dim;
      for (std::size_t d = 0; d < dim; ++d)
        x[d] = table[in[d]] * scale;
    }
    detail::store_floats(s.values.data(), plan.shape.layout.dtype, row, rows + t * plan.shape.row_bytes);
  }
}

void encode_int_keys(QuantKind kind, const Plan& plan, const std::uint8_t* rows, std::uint8_t* meta,
                     std::uint8_t* codes, Scratch& s) {
  const std::size_t row = plan.shape.row_elements;
  const std::size_t group = plan.params.group_size;
  const float top = max_code(kind);
  const std::size_t row_code_bytes = plan.key_section.code_row_bytes;
  for (std::size_t start = 0; start < plan.split.middle; start += group) {
    const std::size_t count = std::min(group, plan.split.middle - start);
    detail::load_floats(rows + start * plan.shape.row_bytes, plan.shape.layout.dtype, count * row, s.values.data());
    std::fill(s.lo.begin(), s.lo.begin() + static_cast<std::ptrdiff_t>(row), __builtin_inff());
    std::fill(s.hi.begin(), s.hi.begin() + static_cast<std::ptrdiff_t>(row), -__builtin_inff());
    float* __restrict lo = s.lo.data();
    float* __restrict hi = s.hi.data();
    for (std::size_t t = 0; t < count; ++t) {
      const float* __restrict x = s.values.data() + t * row;
      for (std::size_t c = 0; c < row; ++c) {
        lo[c] = x[c] < lo[c] ? x[c] : lo[c];
        hi[c] = x[c] > hi[c] ? x[c] : hi[c];
      }
    }
    std::uint8_t* scales = meta + (start / group) * row * 4;
    std::uint8_t* zeros = scales + row * 2;
    for (std::size_t c = 0; c < row; ++c) {
      const QuantGroup q = make_quant_group(s.lo[c], s.hi[c], top);
      detail::put_u16(scales + 2 * c, q.scale_half);
      detail::put_u16(zeros + 2 * c, q.zero_half);
      s.zero[c] = q.zero;
      s.inv[c] = q.inv_scale;
    }
    const float* __restrict zero = s.zero.data();
    const float* __restrict inv = s.inv.data();
    std::uint8_t* __restrict code = s.codes.data();
    for (std::size_t t = 0; t < count; ++t) {
      const float* __restrict x = s.values.data() + t * row;
      for (std::size_t c = 0; c < row; ++c) {
        code[c] = static_cast<std::uint8_t>(quantize_step(x[c], zero[c], inv[c], top));
      }
      pack_codes(kind, s.codes.data(), row, codes + (start + t) * row_code_bytes);
    }
  }
}

void decode_int_keys(QuantKind kind, const Plan& plan, const std::uint8_t* meta, const std::uint8_t* codes,
                     std::uint8_t* rows, Scratch& s) {
  const std::size_t row = plan.shape.row_elements;
  const std::size_t group = plan.params.group_size;
  const std::size_t row_code_bytes = plan.key_section.code_row_bytes;
  for (std::size_t start = 0; start < plan.split.middle; start += group) {
    const std::size_t count = std::min(group, plan.split.middle - start);
    const std::uint8_t* scales = meta + (start / group) * row * 4;
    const std::uint8_t* zeros = scales + row * 2;
    for (std::size_t c = 0; c < row; ++c) {
      s.scale[c] = half_to_float(detail::get_u16(scales + 2 * c));
      s.zero[c] = half_to_float(detail::get_u16(zeros + 2 * c));
    }
    const float* __restrict scale = s.scale.data();
    const float* __restrict zero = s.zero.data();
    const std::uint8_t* __restrict code = s.codes.data();
    for (std::size_t t = 0; t < count; ++t) {
      unpack_codes(kind, codes + (start + t) * row_code_bytes, row, s.codes.data());
      float* __restrict x = s.values.data();
      for (std::size_t c = 0; c < row; ++c)
        x[c] = dequantize_step(code[c], zero[c], scale[c]);
      detail::store_floats(x, plan.shape.layout.dtype, row, rows + (start + t) * plan.shape.row_bytes);
    }
  }
}

void encode_int_values(QuantKind kind, const Plan& plan, const std::uint8_t* rows, std::uint8_t* meta,
                       std::uint8_t* codes, Scratch& s) {
  const std::size_t heads = plan.shape.layout.kv_heads;
  const std::size_t dim = plan.shape.layout.head_dim;
  const std::size_t row = plan.shape.row_elements;
  const std::size_t group = std::min<std::size_t>(plan.params.group_size, dim);
  const std::size_t groups_per_head = detail::ceil_div(dim, group);
  const float top = max_code(kind);
  std::uint8_t* meta_out = meta;
  for (std::size_t t = 0; t < plan.split.middle; ++t) {
    detail::load_floats(rows + t * plan.shape.row_bytes, plan.shape.layout.dtype, row, s.values.data());
    for (std::size_t h = 0; h < heads; ++h) {
      for (std::size_t g = 0; g < groups_per_head; ++g) {
        const std::size_t first = h * dim + g * group;
        const std::size_t count = std::min(group, dim - g * group);
        float lo;
        float hi;
        detail::min_max(s.values.data() + first, count, lo, hi);
        const QuantGroup q = make_quant_group(lo, hi, top);
        detail::put_u16(meta_out, q.scale_half);
        detail::put_u16(meta_out + 2, q.zero_half);
        meta_out += 4;
        const float* __restrict x = s.values.data() + first;
        std::uint8_t* __restrict code = s.codes.data() + first;
        for (std::size_t i = 0; i < count; ++i) {
          code[i] = static_cast<std::uint8_t>(quantize_step(x[i], q.zero, q.inv_scale, top));
        }
      }
    }
    pack_codes(kind, s.codes.data(), row, codes + t * plan.value_section.code_row_bytes);
  }
}

void decode_int_values(QuantKind kind, const Plan& plan, const std::uint8_t* meta, const std::uint8_t* codes,
                       std::uint8_t* rows, Scratch& s) {
  const std::size_t heads = plan.shape.layout.kv_heads;
  const std::size_t dim = plan.shape.layout.head_dim;
  const std::size_t row = plan.shape.row_elements;
  const std::size_t group = std::min<std::size_t>(plan.params.group_size, dim);
  const std::size_t groups_per_head = detail::ceil_div(dim, group);
  const std::uint8_t* meta_in = meta;
  for (std::size_t t = 0; t < plan.split.middle; ++t) {
    unpack_codes(kind, codes + t * plan.value_section.code_row_bytes, row, s.codes.data());
    for (std::size_t h = 0; h < heads; ++h) {
      for (std::size_t g = 0; g < groups_per_head; ++g) {
        const std::size_t first = h * dim + g * group;
        const std::size_t count = std::min(group, dim - g * group);
        const float scale = half_to_float(detail::get_u16(meta_in));
        const float zero = half_to_float(detail::get_u16(meta_in + 2));
        meta_in += 4;
        float* __restrict x = s.values.data() + first;
        const std::uint8_t* __restrict code = s.codes.data() + first;
        for (std::size_t i = 0; i < count; ++i)
          x[i] = dequantize_step(code[i], zero, scale);
      }
    }
    detail::store_floats(s.values.data(), plan.shape.layout.dtype, row, rows + t * plan.shape.row_bytes);
  }
}

Scratch make_scratch(const Plan& plan) {
  const std::size_t row = plan.shape.row_elements;
  const std::size_t rows_at_once =
      std::max<std::size_t>(1, std::min<std::size_t>(plan.params.group_size, plan.split.middle));
  Scratch s;
  s.values.resize(row * rows_at_once);
  s.lo.resize(row);
  s.hi.resize(row);
  s.zero.resize(row);
  s.scale.resize(row);
  s.inv.resize(row);
  s.codes.resize(row);
  return s;
}

template <QuantKind kKind>
std::uint64_t quant_max_size(const kvrelay_codec_layout* layout, const void* params, std::size_t params_size) {
  Plan plan;
  return make_plan(kKind, layout, params, params_size, plan) == KVRELAY_CODEC_OK ? plan.total : 0;
}

template <QuantKind kKind>
int quant_encode(const kvrelay_codec_layout* layout, const void* params, std::size_t params_size, const void* input,
                 std::size_t input_size, void* output, std::size_t output_capacity, std::size_t* output_size) {
  return detail::guarded([&] {
    Plan plan;
    if (const int code = make_plan(kKind, layout, params, params_size, plan); code != KVRELAY_CODEC_OK) return code;
    if (input_size != plan.shape.total_bytes || output_capacity < plan.total || output_size == nullptr) {
      return KVRELAY_CODEC_E_INVALID_ARGUMENT;
    }
    Scratch scratch = make_scratch(plan);
    const auto* in = static_cast<const std::uint8_t*>(input);
    auto* out = static_cast<std::uint8_t*>(output);
    const std::size_t row_bytes = plan.shape.row_bytes;
    for (std::size_t tensor = 0; tensor < 2 * static_cast<std::size_t>(plan.shape.layout.layers); ++tensor) {
      const bool is_value = tensor % 2 == 1;
      const std::uint8_t* source = in + tensor * plan.shape.tensor_bytes;
      const std::size_t sink_bytes = plan.split.sink * row_bytes;
      const std::size_t recent_bytes = plan.split.recent * row_bytes;
      detail::copy_bytes(out, source, sink_bytes);
      detail::copy_bytes(out + sink_bytes, source + (plan.shape.tokens - plan.split.recent) * row_bytes, recent_bytes);
      out += sink_bytes + recent_bytes;
      const QuantSection& section = is_value ? plan.value_section : plan.key_section;
      const std::uint8_t* middle = source + sink_bytes;
      if (kKind == QuantKind::kFp8) {
        encode_fp8(plan, middle, out, out + section.meta_bytes, scratch);
      } else if (is_value) {
        encode_int_values(kKind, plan, middle, out, out + section.meta_bytes, scratch);
      } else {
        encode_int_keys(kKind, plan, middle, out, out + section.meta_bytes, scratch);
      }
      out += section.total();
    }
    *output_size = plan.total;
    return KVRELAY_CODEC_OK;
  });
}

template <QuantKind kKind>
int quant_decode(const kvrelay_codec_layout* layout, const void* params, std::size_t params_size, const void* input,
                 std::size_t input_size, void* output, std::size_t output_size) {
  return detail::guarded([&] {
    Plan plan;
    if (const int code = make_plan(kKind, layout, params, params_size, plan); code != KVRELAY_CODEC_OK) return code;
    if (output_size != plan.shape.total_bytes) return KVRELAY_CODEC_E_INVALID_ARGUMENT;
    if (input_size < plan.total) return KVRELAY_CODEC_E_TRUNCATED;
    if (input_size > plan.total) return KVRELAY_CODEC_E_LAYOUT_MISMATCH;
    Scratch scratch = make_scratch(plan);
    const auto* in = static_cast<const std::uint8_t*>(input);
    auto* out = static_cast<std::uint8_t*>(output);
    const std::size_t row_bytes = plan.shape.row_bytes;
    for (std::size_t tensor = 0; tensor < 2 * static_cast<std::size_t>(plan.shape.layout.layers); ++tensor) {
      const bool is_value = tensor % 2 == 1;
      std::uint8_t* destination = out + tensor * plan.shape.tensor_bytes;
      const std::size_t sink_bytes = plan.split.sink * row_bytes;
      const std::size_t recent_bytes = plan.split.recent * row_bytes;
      detail::copy_bytes(destination, in, sink_bytes);
      detail::copy_bytes(destination + (plan.shape.tokens - plan.split.recent) * row_bytes, in + sink_bytes,
                         recent_bytes);
      in += sink_bytes + recent_bytes;
      const QuantSection& section = is_value ? plan.value_section : plan.key_section;
      std::uint8_t* middle = destination + sink_bytes;
      if (kKind == QuantKind::kFp8) {
        decode_fp8(plan, in, in + section.meta_bytes, middle, scratch);
      } else if (is_value) {
        decode_int_values(kKind, plan, in, in + section.meta_bytes, middle, scratch);
      } else {
        decode_int_keys(kKind, plan, in, in + section.meta_bytes, middle, scratch);
      }
      in += section.total();
    }
    return KVRELAY_CODEC_OK;
  });
}

constexpr BuiltinParams kInt8Defaults{4, 128, 64, 250, 1};
constexpr BuiltinParams kInt4Defaults{4, 128, 32, 250, 1};
const auto kFp8Wire = BuiltinParams{}.serialize();
const auto kInt8Wire = kInt8Defaults.serialize();
const auto kInt4Wire = kInt4Defaults.serialize();

constexpr std::uint32_t kLossyFlags = KVRELAY_CODEC_FLAG_HOST_MEMORY;

const kvrelay_codec_plugin kFp8 = {KVRELAY_CODEC_ABI_VERSION,
                                   sizeof(kvrelay_codec_plugin),
                                   "fp8",
                                   kFp8CodecId,
                                   kLossyFlags,
                                   kFp8Wire.data(),
                                   static_cast<std::uint32_t>(kFp8Wire.size()),
                                   quant_max_size<QuantKind::kFp8>,
                                   quant_encode<QuantKind::kFp8>,
                                   quant_decode<QuantKind::kFp8>,
                                   detail::builtin_error_text};
const kvrelay_codec_plugin kInt8 = {KVRELAY_CODEC_ABI_VERSION,
                                    sizeof(kvrelay_codec_plugin),
                                    "int8",
                                    kInt8CodecId,
                                    kLossyFlags,
                                    kInt8Wire.data(),
                                    static_cast<std::uint32_t>(kInt8Wire.size()),
                                    quant_max_size<QuantKind::kInt8>,
                                    quant_encode<QuantKind::kInt8>,
                                    quant_decode<QuantKind::kInt8>,
                                    detail::builtin_error_text};
const kvrelay_codec_plugin kInt4 = {KVRELAY_CODEC_ABI_VERSION,
                                    sizeof(kvrelay_codec_plugin),
                                    "int4",
                                    kInt4CodecId,
                                    kLossyFlags,
                                    kInt4Wire.data(),
                                    static_cast<std::uint32_t>(kInt4Wire.size()),
                                    quant_max_size<QuantKind::kInt4>,
                                    quant_encode<QuantKind::kInt4>,
                                    quant_decode<QuantKind::kInt4>,
                                    detail::builtin_error_text};

}  // namespace

const kvrelay_codec_plugin* fp8_codec() noexcept {
  return &kFp8;
}
const kvrelay_codec_plugin* int8_codec() noexcept {
  return &kInt8;
}
const kvrelay_codec_plugin* int4_codec() noexcept {
  return &kInt4;
}

}  // namespace kvrelay::codec
