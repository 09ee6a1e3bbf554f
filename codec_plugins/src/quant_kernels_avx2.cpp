// The quantizer loops built with -mavx2 -mf16c (see codec_plugins/CMakeLists.txt); only called
// after cpu_path.cpp has checked the CPU for both. The same passes as quant_kernels.h, written
// with the eight-lane steps of quant_lanes_avx2.h: the dtype conversion is fused into the loops
// that read the KV (no float copy of a row where one pass suffices), codes leave in 32-byte
// (int8, fp8) or 16-byte (int4) stores, and every loop ends with the scalar float_bits.h step
// for the elements that do not fill a vector, so the bytes equal the portable build's.

#if !defined(__AVX2__) || !defined(__F16C__)
#error "quant_kernels_avx2.cpp needs -mavx2 -mf16c"
#endif
#if defined(__FMA__)
#error "FMA would round differently from the baseline build and the CUDA kernels"
#endif

#include "quant_kernels.h"
#include "quant_lanes_avx2.h"

namespace {

// Calls body(group, first element, element count) for the value groups of a row in order: per
// head, groups of `value_group` channels, the last one shorter (no division per group).
template <class Body>
inline __attribute__((always_inline)) void for_each_group(const kvrelay::codec::detail::QuantTensorDims& a,
                                                          Body&& body) {
  std::size_t g = 0;
  for (std::size_t head_start = 0; head_start < a.row_elements; head_start += a.head_dim) {
    for (std::size_t in_head = 0; in_head < a.head_dim; in_head += a.value_group, ++g)
      body(g, head_start + in_head, a.value_group < a.head_dim - in_head ? a.value_group : a.head_dim - in_head);
  }
}

// Only bf16 stores have a cheaper form for NaN-free values.
template <DType kDtype>
constexpr bool kNoNaNPath = kDtype == DType::kBFloat16;

// Asks for bytes the loops will read soon (the KV streams from DRAM); prefetches never fault.
inline __attribute__((always_inline)) void prefetch_bytes(const std::uint8_t* start, std::size_t bytes) {
  for (std::size_t b = 0; b < bytes; b += 64)
    __builtin_prefetch(start + b);
}

// Writes `count` int4 codes (one per byte) as nibbles from output byte `first / 2`; `first` is
// even (the row's pairs, as pack_nibbles).
void pack_nibble_run(const std::uint8_t* __restrict codes, std::size_t count, std::uint8_t* __restrict out) {
  std::size_t i = 0;
  for (; i + 32 <= count; i += 32)
    _mm_storeu_si128(reinterpret_cast<__m128i*>(out + i / 2),
                     lanes::pack_nibbles32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(codes + i))));
  pack_nibbles(codes + i, count - i, out + i / 2);
}

// Codes of one row, one per byte: int8 rows as they are, int4 rows unpacked into `scratch`.
const std::uint8_t* row_codes(bool int4, const std::uint8_t* in, std::size_t count, std::uint8_t* scratch) {
  if (!int4) return in;
  std::size_t i = 0;
  for (; i + 32 <= count; i += 32) {
    __m128i first;
    __m128i second;
    lanes::unpack_nibbles32(in + i / 2, first, second);
    _mm_storeu_si128(reinterpret_cast<__m128i*>(scratch + i), first);
    _mm_storeu_si128(reinterpret_cast<__m128i*>(scratch + i + 16), second);
  }
  unpack_nibbles(in + i / 2, count - i, scratch + i);
  return scratch;
}

// fp16 metadata -> floats.
void halves_to_floats(const std::uint8_t* __restrict halves, std::size_t count, float* __restrict out) {
  std::size_t i = 0;
  for (; i + 8 <= count; i += 8)
    _mm256_storeu_ps(out + i, lanes::load8<DType::kFloat16>(halves + 2 * i));
  for (; i < count; ++i)
    out[i] = lanes::load1<DType::kFloat16>(halves + 2 * i);
}

// Quantizes `count` elements of `source` with per-element parameters (keys: one per channel)
// or one broadcast pair (values: kPerElement false), codes one per byte.
template <DType kDtype, bool kPerElement>
void quantize_codes(const std::uint8_t* __restrict source, std::size_t count, const float* __restrict zero,
                    const float* __restrict inv, float max_code, std::uint8_t* __restrict codes) {
  constexpr std::size_t kSize = kElementSize<kDtype>;
  const __m256 top = _mm256_set1_ps(max_code);
  const auto zero_at = [&](std::size_t i) { return kPerElement ? _mm256_loadu_ps(zero + i) : _mm256_set1_ps(*zero); };
  const auto inv_at = [&](std::size_t i) { return kPerElement ? _mm256_loadu_ps(inv + i) : _mm256_set1_ps(*inv); };
  std::size_t i = 0;
  for (; i + 32 <= count; i += 32) {
    __m256i q[4];
    for (std::size_t k = 0; k < 4; ++k) {
      const std::size_t at = i + 8 * k;
      q[k] = lanes::quantize8(lanes::load8<kDtype>(source + at * kSize), zero_at(at), inv_at(at), top);
    }
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(codes + i), lanes::pack32_bytes(q[0], q[1], q[2], q[3]));
  }
  for (; i + 8 <= count; i += 8)
    lanes::store8_bytes(lanes::quantize8(lanes::load8<kDtype>(source + i * kSize), zero_at(i), inv_at(i), top),
                        codes + i);
  for (; i < count; ++i) {
    const std::size_t p = kPerElement ? i : 0;
    codes[i] = static_cast<std::uint8_t>(
        bits::quantize_step(lanes::load1<kDtype>(source + i * kSize), zero[p], inv[p], max_code));
  }
}

// int4 keys, `count` a multiple of 32: quantizes straight into packed nibbles.
template <DType kDtype>
void quantize_nibbles(const std::uint8_t* __restrict source, std::size_t count, const float* __restrict zero,
                      const float* __restrict inv, float max_code, std::uint8_t* __restrict out) {
  constexpr std::size_t kSize = kElementSize<kDtype>;
  const __m256 top = _mm256_set1_ps(max_code);
  for (std::size_t i = 0; i < count; i += 32) {
    __m256i q[4];
    for (std::size_t k = 0; k < 4; ++k) {
      const std::size_t at = i + 8 * k;
      q[k] = lanes::quantize8(lanes::load8<kDtype>(source + at * kSize), _mm256_loadu_ps(zero + at),
                              _mm256_loadu_ps(inv + at), top);
    }
    _mm_storeu_si128(reinterpret_cast<__m128i*>(out + i / 2),
                     lanes::pack_nibbles32(lanes::pack32_bytes(q[0], q[1], q[2], q[3])));
  }
}

// Dequantizes `count` codes into `destination`, per-element or broadcast parameters.
template <DType kDtype, bool kPerElement, bool kNoNaN>
void dequantize_codes(const std::uint8_t* __restrict codes, std::size_t count, const float* __restrict zero,
                      const float* __restrict scale, std::uint8_t* __restrict destination) {
  constexpr std::size_t kSize = kElementSize<kDtype>;
  const auto zero_at = [&](std::size_t i) { return kPerElement ? _mm256_loadu_ps(zero + i) : _mm256_set1_ps(*zero); };
  const auto scale_at = [&](std::size_t i) {
    return kPerElement ? _mm256_loadu_ps(scale + i) : _mm256_set1_ps(*scale);
  };
  std::size_t i = 0;
  for (; i + 16 <= count; i += 16) {
    const __m128i sixteen = _mm_loadu_si128(reinterpret_cast<const __m128i*>(codes + i));
    lanes::store8<kDtype, kNoNaN>(lanes::dequantize8(sixteen, zero_at(i), scale_at(i)), destination + i * kSize);
    lanes::store8<kDtype, kNoNaN>(
        lanes::dequantize8(_mm_unpackhi_epi64(sixteen, sixteen), zero_at(i + 8), scale_at(i + 8)),
        destination + (i + 8) * kSize);
  }
  for (; i + 8 <= count; i += 8) {
    const __m128i eight = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(codes + i));
    lanes::store8<kDtype, kNoNaN>(lanes::dequantize8(eight, zero_at(i), scale_at(i)), destination + i * kSize);
  }
  for (; i < count; ++i) {
    const std::size_t p = kPerElement ? i : 0;
    lanes::store1<kDtype>(bits::dequantize_step(codes[i], zero[p], scale[p]), destination + i * kSize);
  }
}

// int4: dequantizes elements [first, first + count) of a packed row (`first` even) into
// `destination`, nibbles unpacked in registers.
template <DType kDtype, bool kPerElement, bool kNoNaN>
void dequantize_nibbles(const std::uint8_t* __restrict packed, std::size_t first, std::size_t count,
                        const float* __restrict zero, const float* __restrict scale,
                        std::uint8_t* __restrict destination) {
  constexpr std::size_t kSize = kElementSize<kDtype>;
  const auto zero_at = [&](std::size_t i) { return kPerElement ? _mm256_loadu_ps(zero + i) : _mm256_set1_ps(*zero); };
  const auto scale_at = [&](std::size_t i) {
    return kPerElement ? _mm256_loadu_ps(scale + i) : _mm256_set1_ps(*scale);
  };
  std::size_t i = 0;
  for (; i + 32 <= count; i += 32) {
    __m128i low;
    __m128i high;
    lanes::unpack_nibbles32(packed + (first + i) / 2, low, high);
    lanes::store8<kDtype, kNoNaN>(lanes::dequantize8(low, zero_at(i), scale_at(i)), destination + i * kSize);
    lanes::store8<kDtype, kNoNaN>(lanes::dequantize8(_mm_unpackhi_epi64(low, low), zero_at(i + 8), scale_at(i + 8)),
                                  destination + (i + 8) * kSize);
    lanes::store8<kDtype, kNoNaN>(lanes::dequantize8(high, zero_at(i + 16), scale_at(i + 16)),
                                  destination + (i + 16) * kSize);
    lanes::store8<kDtype, kNoNaN>(lanes::dequantize8(_mm_unpackhi_epi64(high, high), zero_at(i + 24), scale_at(i + 24)),
                                  destination + (i + 24) * kSize);
  }
  for (; i + 8 <= count; i += 8) {
    std::uint32_t four;
    std::memcpy(&four, packed + (first + i) / 2, 4);
    const __m128i packed4 = _mm_cvtsi32_si128(static_cast<int>(four));
    const __m128i mask = _mm_set1_epi8(0x0F);
    const __m128i eight =
        _mm_unpacklo_epi8(_mm_and_si128(packed4, mask), _mm_and_si128(_mm_srli_epi16(packed4, 4), mask));
    lanes::store8<kDtype, kNoNaN>(lanes::dequantize8(eight, zero_at(i), scale_at(i)), destination + i * kSize);
  }
  for (; i < count; ++i) {
    const std::size_t p = kPerElement ? i : 0;
    const std::size_t at = first + i;
    const auto code = static_cast<std::uint32_t>((packed[at / 2] >> (4 * (at % 2))) & 0x0FU);
    lanes::store1<kDtype>(bits::dequantize_step(code, zero[p], scale[p]), destination + i * kSize);
  }
}

// Folds rows [0, kRows) of `source` into the column minima and maxima.
template <DType kDtype, std::size_t kRows>
void fold_columns(const std::uint8_t* __restrict source, std::size_t row_bytes, std::size_t row, float* __restrict lo,
                  float* __restrict hi) {
  constexpr std::size_t kSize = kElementSize<kDtype>;
  std::size_t c = 0;
  for (; c + 8 <= row; c += 8) {
    __m256 l = _mm256_loadu_ps(lo + c);
    __m256 h = _mm256_loadu_ps(hi + c);
    for (std::size_t r = 0; r < kRows; ++r) {
      const __m256 v = lanes::load8<kDtype>(source + r * row_bytes + c * kSize);
      l = _mm256_min_ps(v, l);
      h = _mm256_max_ps(v, h);
    }
    _mm256_storeu_ps(lo + c, l);
    _mm256_storeu_ps(hi + c, h);
  }
  for (; c < row; ++c) {
    for (std::size_t r = 0; r < kRows; ++r) {
      const float v = lanes::load1<kDtype>(source + r * row_bytes + c * kSize);
      lo[c] = v < lo[c] ? v : lo[c];
      hi[c] = v > hi[c] ? v : hi[c];
    }
  }
}

// Keys: per channel over groups of `group` tokens; column min/max eight rows per sweep, the
// group's parameters, then each row quantized straight from the source.
template <DType kDtype, bool kInt4>
void encode_keys_avx2(const QuantEncodeArgs& a) {
  const std::size_t row = a.row_elements;
  const std::size_t row_bytes = row * kElementSize<kDtype>;
  float* __restrict lo = a.scratch_floats;
  float* __restrict hi = lo + row;
  float* __restrict zero = hi + row;
  float* __restrict inv = zero + row;
  std::uint16_t* __restrict scale_half = a.scratch_halves;
  std::uint16_t* __restrict zero_half = scale_half + row;
  for (std::size_t start = 0; start < a.middle; start += a.group) {
    const std::size_t count = a.group < a.middle - start ? a.group : a.middle - start;
    const std::uint8_t* source = a.rows + start * row_bytes;
    for (std::size_t c = 0; c < row; ++c) {
      lo[c] = __builtin_inff();
      hi[c] = -__builtin_inff();
    }
    std::size_t swept = 0;
    for (; swept + 8 <= count; swept += 8) {
      prefetch_bytes(source + (swept + 8) * row_bytes, 8 * row_bytes);
      fold_columns<kDtype, 8>(source + swept * row_bytes, row_bytes, row, lo, hi);
    }
    for (; swept < count; ++swept)
      fold_columns<kDtype, 1>(source + swept * row_bytes, row_bytes, row, lo, hi);
    make_groups(lo, hi, row, a.max_code, scale_half, zero_half, zero, inv);
    std::uint8_t* meta = a.meta + (start / a.group) * row * 4;
    std::memcpy(meta, scale_half, row * 2);
    std::memcpy(meta + row * 2, zero_half, row * 2);
    for (std::size_t t = 0; t < count; ++t) {
      std::uint8_t* out = a.codes + (start + t) * a.code_row_bytes;
      if (kInt4 && row % 32 == 0) {
        quantize_nibbles<kDtype>(source + t * row_bytes, row, zero, inv, a.max_code, out);
      } else {
        std::uint8_t* codes = kInt4 ? a.scratch_codes : out;
        quantize_codes<kDtype, true>(source + t * row_bytes, row, zero, inv, a.max_code, codes);
        if constexpr (kInt4) pack_nibble_run(codes, row, out);
      }
    }
  }
}

template <DType kDtype>
void decode_keys_avx2(const QuantDecodeArgs& a) {
  const std::size_t row = a.row_elements;
  const std::size_t row_bytes = row * kElementSize<kDtype>;
  float* __restrict scale = a.scratch_floats;
  float* __restrict zero = scale + row;
  for (std::size_t start = 0; start < a.middle; start += a.group) {
    const std::size_t count = a.group < a.middle - start ? a.group : a.middle - start;
    const std::uint8_t* meta = a.meta + (start / a.group) * row * 4;
    halves_to_floats(meta, row, scale);
    halves_to_floats(meta + row * 2, row, zero);
    // code * scale + zero is never NaN for finite fp16 parameters (|scale * code| < 2^24).
    const bool no_nan = kNoNaNPath<kDtype> && lanes::all_finite(scale, row) && lanes::all_finite(zero, row);
    for (std::size_t t = 0; t < count; ++t) {
      const std::uint8_t* codes = a.codes + (start + t) * a.code_row_bytes;
      std::uint8_t* destination = a.rows + (start + t) * row_bytes;
      if (a.int4) {
        if (no_nan) {
          dequantize_nibbles<kDtype, true, true>(codes, 0, row, zero, scale, destination);
        } else {
          dequantize_nibbles<kDtype, true, false>(codes, 0, row, zero, scale, destination);
        }
      } else if (no_nan) {
        dequantize_codes<kDtype, true, true>(codes, row, zero, scale, destination);
      } else {
        dequantize_codes<kDtype, true, false>(codes, row, zero, scale, destination);
      }
    }
  }
}

// Values: per token, groups of `value_group` channels inside each head. The row is converted
// once into floats (it is read twice: min/max, then quantize).
template <DType kDtype, bool kInt4>
void encode_values_avx2(const QuantEncodeArgs& a) {
  constexpr std::size_t kSize = kElementSize<kDtype>;
  const std::size_t row = a.row_elements;
  const std::size_t row_bytes = row * kSize;
  const std::size_t per_head = (a.head_dim + a.value_group - 1) / a.value_group;
  const std::size_t groups = a.kv_heads * per_head;
  float* __restrict x = a.scratch_floats;
  float* __restrict lo = x + row;
  float* __restrict hi = lo + groups;
  float* __restrict zero = hi + groups;
  float* __restrict inv = zero + groups;
  std::uint16_t* __restrict scale_half = a.scratch_halves;
  std::uint16_t* __restrict zero_half = scale_half + groups;
  for (std::size_t t = 0; t < a.middle; ++t) {
    const std::uint8_t* source = a.rows + t * row_bytes;
    std::size_t i = 0;
    for (; i + 8 <= row; i += 8)
      _mm256_storeu_ps(x + i, lanes::load8<kDtype>(source + i * kSize));
    for (; i < row; ++i)
      x[i] = lanes::load1<kDtype>(source + i * kSize);
    for_each_group(a, [&]([[maybe_unused]] std::size_t g, std::size_t first, std::size_t count) {
      min_max(x + first, count, lo[g], hi[g]);
    });
    make_groups(lo, hi, groups, a.max_code, scale_half, zero_half, zero, inv);
    std::uint8_t* meta = a.meta + t * groups * 4;
    for (std::size_t g = 0; g < groups; ++g) {
      std::memcpy(meta + 4 * g, scale_half + g, 2);
      std::memcpy(meta + 4 * g + 2, zero_half + g, 2);
    }
    std::uint8_t* out = a.codes + t * a.code_row_bytes;
    std::uint8_t* codes = kInt4 ? a.scratch_codes : out;
    for_each_group(a, [&]([[maybe_unused]] std::size_t g, std::size_t first, std::size_t count) {
      quantize_codes<DType::kFloat32, false>(reinterpret_cast<const std::uint8_t*>(x + first), count, zero + g, inv + g,
                                             a.max_code, codes + first);
    });
    if constexpr (kInt4) pack_nibble_run(codes, row, out);
  }
}

// Values when every group spans whole vectors (value_group and head_dim multiples of 8, the
// usual shapes): min/max of each group straight from the source, the parameters of eight
// groups per vector step, then each group quantized from the source again (now in L1).
template <DType kDtype, bool kInt4>
void encode_values_lanes(const QuantEncodeArgs& a) {
  constexpr std::size_t kSize = kElementSize<kDtype>;
  const std::size_t row = a.row_elements;
  const std::size_t row_bytes = row * kSize;
  const std::size_t per_head = (a.head_dim + a.value_group - 1) / a.value_group;
  const std::size_t groups = a.kv_heads * per_head;
  const std::size_t padded = (groups + 7) / 8 * 8;
  float* __restrict lo = a.scratch_floats;
  float* __restrict hi = lo + padded;
  float* __restrict zero = hi + padded;
  float* __restrict inv = zero + padded;
  for (std::size_t g = groups; g < padded; ++g)
    lo[g] = hi[g] = 0.0F;
  const __m256 top = _mm256_set1_ps(a.max_code);
  for (std::size_t t = 0; t < a.middle; ++t) {
    const std::uint8_t* __restrict source = a.rows + t * row_bytes;
    prefetch_bytes(source + kPrefetchDistance, row_bytes);
    for_each_group(a, [&]([[maybe_unused]] std::size_t g, std::size_t first, std::size_t count) {
      __m256 l = _mm256_set1_ps(__builtin_inff());
      __m256 h = _mm256_set1_ps(-__builtin_inff());
      for (std::size_t i = 0; i < count; i += 8) {
        const __m256 v = lanes::load8<kDtype>(source + (first + i) * kSize);
        l = _mm256_min_ps(v, l);
        h = _mm256_max_ps(v, h);
      }
      lo[g] = lanes::fold_min8(l);
      hi[g] = lanes::fold_max8(h);
    });
    std::uint8_t* meta = a.meta + t * groups * 4;
    for (std::size_t g = 0; g < groups; g += 8) {
      __m128i scale_half;
      __m128i zero_half;
      __m256 zero8;
      __m256 inv8;
      lanes::make_quant_groups8(_mm256_loadu_ps(lo + g), _mm256_loadu_ps(hi + g), top, scale_half, zero_half, zero8,
                                inv8);
      _mm256_storeu_ps(zero + g, zero8);
      _mm256_storeu_ps(inv + g, inv8);
      // (scale, zero) per group, as on the wire.
      alignas(32) std::uint8_t pairs[32];
      _mm_store_si128(reinterpret_cast<__m128i*>(pairs), _mm_unpacklo_epi16(scale_half, zero_half));
      _mm_store_si128(reinterpret_cast<__m128i*>(pairs + 16), _mm_unpackhi_epi16(scale_half, zero_half));
      std::memcpy(meta + 4 * g, pairs, groups - g < 8 ? 4 * (groups - g) : 32);
    }
    std::uint8_t* __restrict out = a.codes + t * a.code_row_bytes;
    for_each_group(a, [&]([[maybe_unused]] std::size_t g, std::size_t first, std::size_t count) {
      const __m256 z = _mm256_set1_ps(zero[g]);
      const __m256 s = _mm256_set1_ps(inv[g]);
      const std::uint8_t* __restrict x = source + first * kSize;
      std::size_t i = 0;
      for (; i + 32 <= count; i += 32) {
        const __m256i bytes =
            lanes::pack32_bytes(lanes::quantize8(lanes::load8<kDtype>(x + i * kSize), z, s, top),
                                lanes::quantize8(lanes::load8<kDtype>(x + (i + 8) * kSize), z, s, top),
                                lanes::quantize8(lanes::load8<kDtype>(x + (i + 16) * kSize), z, s, top),
                                lanes::quantize8(lanes::load8<kDtype>(x + (i + 24) * kSize), z, s, top));
        if constexpr (kInt4) {
          _mm_storeu_si128(reinterpret_cast<__m128i*>(out + (first + i) / 2), lanes::pack_nibbles32(bytes));
        } else {
          _mm256_storeu_si256(reinterpret_cast<__m256i*>(out + first + i), bytes);
        }
      }
      for (; i < count; i += 8) {
        const __m256i q = lanes::quantize8(lanes::load8<kDtype>(x + i * kSize), z, s, top);
        if constexpr (kInt4) {
          lanes::store8_nibbles(q, out + (first + i) / 2);
        } else {
          lanes::store8_bytes(q, out + first + i);
        }
      }
    });
  }
}

template <DType kDtype>
void decode_values_avx2(const QuantDecodeArgs& a) {
  const std::size_t row = a.row_elements;
  const std::size_t row_bytes = row * kElementSize<kDtype>;
  const std::size_t per_head = (a.head_dim + a.value_group - 1) / a.value_group;
  const std::size_t groups = a.kv_heads * per_head;
  float* __restrict pairs = a.scratch_floats;  // (scale, zero) per group, as on the wire
  for (std::size_t t = 0; t < a.middle; ++t) {
    halves_to_floats(a.meta + t * groups * 4, 2 * groups, pairs);
    const bool no_nan = kNoNaNPath<kDtype> && lanes::all_finite(pairs, 2 * groups);
    // int4 groups starting on even elements are unpacked in registers, others via scratch.
    const bool in_registers = a.int4 && a.head_dim % 2 == 0 && a.value_group % 2 == 0;
    const std::uint8_t* packed = a.codes + t * a.code_row_bytes;
    const std::uint8_t* codes = in_registers ? packed : row_codes(a.int4, packed, row, a.scratch_codes);
    std::uint8_t* destination = a.rows + t * row_bytes;
    for_each_group(a, [&]([[maybe_unused]] std::size_t g, std::size_t first, std::size_t count) {
      const float* zero = pairs + 2 * g + 1;
      const float* scale = pairs + 2 * g;
      std::uint8_t* out = destination + first * kElementSize<kDtype>;
      if (in_registers) {
        if (no_nan) {
          dequantize_nibbles<kDtype, false, true>(packed, first, count, zero, scale, out);
        } else {
          dequantize_nibbles<kDtype, false, false>(packed, first, count, zero, scale, out);
        }
      } else if (no_nan) {
        dequantize_codes<kDtype, false, true>(codes + first, count, zero, scale, out);
      } else {
        dequantize_codes<kDtype, false, false>(codes + first, count, zero, scale, out);
      }
    });
  }
}

// Max |x| of the first 16-element blocks of a 16-bit head, advancing `done` past them. fp16 and
// bf16 magnitudes order as their bit patterns do, so the max is taken on integers, NaN patterns
// (above infinity's) dropped as abs_max drops NaN; the result converts exactly.
template <DType kDtype>
float abs_max_16bit(const std::uint8_t* __restrict head, std::size_t dim, std::size_t& done) {
  const __m256i no_sign = _mm256_set1_epi16(0x7FFF);
  const __m256i infinity = _mm256_set1_epi16(kDtype == DType::kFloat16 ? 0x7C00 : 0x7F80);
  __m256i wide = _mm256_setzero_si256();
  std::size_t d = 0;
  for (; d + 16 <= dim; d += 16) {
    const __m256i magnitude =
        _mm256_and_si256(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(head + 2 * d)), no_sign);
    wide = _mm256_max_epu16(wide, _mm256_andnot_si256(_mm256_cmpgt_epi16(magnitude, infinity), magnitude));
  }
  done = d;
  // max = ~min(~x): the one horizontal 16-bit reduction SSE4.1 has is minpos.
  const __m128i all = _mm_set1_epi16(-1);
  const __m128i half = _mm_max_epu16(_mm256_castsi256_si128(wide), _mm256_extracti128_si256(wide, 1));
  const auto top = static_cast<std::uint16_t>(~_mm_extract_epi16(_mm_minpos_epu16(_mm_xor_si128(half, all)), 0));
  std::uint8_t pattern[2];
  std::memcpy(pattern, &top, 2);
  return lanes::load1<kDtype>(pattern);
}

// Max |x| over one head of `dim` elements (0 when empty; NaN ignored), as abs_max.
template <DType kDtype>
inline __attribute__((always_inline)) float head_abs_max(const std::uint8_t* __restrict head, std::size_t dim) {
  constexpr std::size_t kSize = kElementSize<kDtype>;
  std::size_t d = 0;
  float amax = 0.0F;
  if constexpr (kSize == 2) amax = abs_max_16bit<kDtype>(head, dim, d);
  const __m256 no_sign = _mm256_castsi256_ps(_mm256_set1_epi32(0x7FFFFFFF));
  __m256 wide = _mm256_setzero_ps();
  for (; d + 8 <= dim; d += 8)
    wide = _mm256_max_ps(_mm256_and_ps(lanes::load8<kDtype>(head + d * kSize), no_sign), wide);
  const float lanes_max = lanes::fold_max8(wide);
  amax = lanes_max > amax ? lanes_max : amax;
  for (; d < dim; ++d) {
    const float v = __builtin_fabsf(lanes::load1<kDtype>(head + d * kSize));
    amax = v > amax ? v : amax;
  }
  return amax;
}

// fp8: one f32 scale per token and head (amax / 448). Per row: every head's amax, then the
// scales (independent divisions, not one chain per head), then the codes (the row is in L1).
template <DType kDtype>
void encode_fp8_avx2(const QuantEncodeArgs& a) {
  constexpr std::size_t kSize = kElementSize<kDtype>;
  const std::size_t row = a.row_elements;
  const std::size_t dim = a.head_dim;
  const std::size_t heads = a.kv_heads;
  float* __restrict amax = a.scratch_floats;
  float* __restrict scale = amax + heads;
  float* __restrict inv = scale + heads;
  for (std::size_t t = 0; t < a.middle; ++t) {
    const std::uint8_t* __restrict source = a.rows + t * row * kSize;
    prefetch_bytes(source + kPrefetchDistance, row * kSize);
    for (std::size_t h = 0; h < heads; ++h)
      amax[h] = head_abs_max<kDtype>(source + h * dim * kSize, dim);
    for (std::size_t h = 0; h < heads; ++h) {
      scale[h] = bits::fp8_scale(amax[h]);
      inv[h] = 1.0F / scale[h];
    }
    std::memcpy(a.meta + t * heads * 4, scale, heads * 4);
    for (std::size_t h = 0; h < heads; ++h) {
      const std::uint8_t* __restrict head = source + h * dim * kSize;
      const __m256 inv8 = _mm256_set1_ps(inv[h]);
      std::uint8_t* __restrict out = a.codes + t * row + h * dim;
      std::size_t d = 0;
      for (; d + 32 <= dim; d += 32) {
        __m256 scaled[4];
        __m256i q[4];
        for (std::size_t k = 0; k < 4; ++k) {
          scaled[k] = _mm256_mul_ps(lanes::load8<kDtype>(head + (d + 8 * k) * kSize), inv8);
          q[k] = lanes::e4m3_magnitude_lanes(scaled[k]);
        }
        _mm256_storeu_si256(reinterpret_cast<__m256i*>(out + d), lanes::pack_e4m3_32(scaled, q));
      }
      for (; d + 8 <= dim; d += 8)
        lanes::store8_bytes(lanes::float_to_e4m3_lanes(_mm256_mul_ps(lanes::load8<kDtype>(head + d * kSize), inv8)),
                            out + d);
      for (; d < dim; ++d)
        out[d] = bits::float_to_e4m3(lanes::load1<kDtype>(head + d * kSize) * inv[h]);
    }
  }
}

// One head of fp8 codes -> `dim` elements.
template <DType kDtype, bool kNoNaN>
void decode_fp8_head(const std::uint8_t* __restrict in, std::size_t dim, float scale, std::uint8_t* __restrict out) {
  constexpr std::size_t kSize = kElementSize<kDtype>;
  const __m256 scale8 = _mm256_set1_ps(scale);
  std::size_t d = 0;
  for (; d + 16 <= dim; d += 16) {
    const __m128i sixteen = _mm_loadu_si128(reinterpret_cast<const __m128i*>(in + d));
    lanes::store8<kDtype, kNoNaN>(_mm256_mul_ps(lanes::e4m3_to_float8(sixteen), scale8), out + d * kSize);
    lanes::store8<kDtype, kNoNaN>(_mm256_mul_ps(lanes::e4m3_to_float8(_mm_unpackhi_epi64(sixteen, sixteen)), scale8),
                                  out + (d + 8) * kSize);
  }
  for (; d + 8 <= dim; d += 8) {
    const __m128i eight = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(in + d));
    lanes::store8<kDtype, kNoNaN>(_mm256_mul_ps(lanes::e4m3_to_float8(eight), scale8), out + d * kSize);
  }
  for (; d < dim; ++d)
    lanes::store1<kDtype>(bits::e4m3_to_float(in[d]) * scale, out + d * kSize);
}

template <DType kDtype>
void decode_fp8_avx2(const QuantDecodeArgs& a) {
  constexpr std::size_t kSize = kElementSize<kDtype>;
  const std::size_t row = a.row_elements;
  const std::size_t dim = a.head_dim;
  for (std::size_t t = 0; t < a.middle; ++t) {
    for (std::size_t h = 0; h < a.kv_heads; ++h) {
      float scale;
      std::memcpy(&scale, a.meta + (t * a.kv_heads + h) * 4, 4);
      const std::uint8_t* in = a.codes + t * row + h * dim;
      std::uint8_t* out = a.rows + (t * row + h * dim) * kSize;
      // A finite scale times a finite e4m3 value may overflow to infinity, never to NaN.
      if (kNoNaNPath<kDtype> && __builtin_isfinite(scale)) {
        decode_fp8_head<kDtype, true>(in, dim, scale, out);
      } else {
        decode_fp8_head<kDtype, false>(in, dim, scale, out);
      }
    }
  }
}

template <DType kDtype>
void encode_keys_any(const QuantEncodeArgs& a) {
  if (a.int4) {
    encode_keys_avx2<kDtype, true>(a);
  } else {
    encode_keys_avx2<kDtype, false>(a);
  }
}

template <DType kDtype>
void encode_values_any(const QuantEncodeArgs& a) {
  if (a.value_group % 8 == 0 && a.head_dim % 8 == 0) {
    if (a.int4) {
      encode_values_lanes<kDtype, true>(a);
    } else {
      encode_values_lanes<kDtype, false>(a);
    }
  } else if (a.int4) {
    encode_values_avx2<kDtype, true>(a);
  } else {
    encode_values_avx2<kDtype, false>(a);
  }
}

template <DType kDtype>
constexpr kvrelay::codec::detail::QuantKernelSet avx2_kernels_for() {
  return {encode_keys_any<kDtype>,    decode_keys_avx2<kDtype>, encode_values_any<kDtype>,
          decode_values_avx2<kDtype>, encode_fp8_avx2<kDtype>,  decode_fp8_avx2<kDtype>};
}

}  // namespace

namespace kvrelay::codec::detail {

const QuantKernelTable& avx2_quant_kernels() noexcept {
  static constexpr QuantKernelTable kTable{avx2_kernels_for<DType::kFloat32>(), avx2_kernels_for<DType::kFloat16>(),
                                           avx2_kernels_for<DType::kBFloat16>()};
  return kTable;
}

}  // namespace kvrelay::codec::detail
