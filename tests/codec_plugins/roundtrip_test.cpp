#include <catch2/catch.hpp>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <random>
#include <vector>

#include "kvrelay/codec_plugins/builtin_params.h"
#include "kvrelay/codec_plugins/frame.h"
#include "kvrelay/codec_plugins/metrics.h"
#include "kvrelay/codec_plugins/sparse.h"
#include "kvrelay/codec_plugins/tensor_file.h"

using namespace kvrelay;
using namespace kvrelay::codec;

namespace {

// Odd shapes: a single token, token counts off the group size, one head, head_dim off the
// group size, odd row lengths (int4 packs pairs).
const std::vector<KvLayout> kShapes = {
    {2, 3, 8, DType::kFloat32, 1},   {1, 1, 64, DType::kFloat32, 200}, {3, 2, 36, DType::kFloat32, 170},
    {1, 1, 7, DType::kFloat32, 151}, {2, 4, 16, DType::kFloat32, 0},
};
const DType kDtypes[] = {DType::kFloat32, DType::kFloat16, DType::kBFloat16};

std::vector<std::uint8_t> params_with(std::uint32_t group, std::uint32_t recent = 16) {
  BuiltinParams params;
  params.group_size = group;
  params.recent_tokens = recent;
  const auto wire = params.serialize();
  return {wire.begin(), wire.end()};
}

std::vector<std::uint8_t> round_trip(const CodecRegistry& registry, const CodecSpec& spec, const KvLayout& layout,
                                     const std::vector<std::uint8_t>& kv, const std::vector<std::uint8_t>& params) {
  EncodeOptions options;
  options.zstd_stage = spec.zstd_stage;
  options.params = params;
  auto frame = encode_frame(*spec.codec, layout, kv, options);
  REQUIRE(frame);
  std::vector<std::uint8_t> decoded(kv.size(), 0xEE);
  auto status = decode_frame(registry, frame.value(), decoded);
  INFO((status ? std::string() : status.error().to_string()));
  REQUIRE(status);
  return decoded;
}

// Rows [first, last) of every tensor are byte-identical.
void require_rows_exact(const KvLayout& layout, const std::vector<std::uint8_t>& a, const std::vector<std::uint8_t>& b,
                        std::size_t first, std::size_t last) {
  const std::size_t row = layout.kv_heads * layout.head_dim * dtype_size(layout.dtype);
  if (last == first) return;
  for (std::uint32_t layer = 0; layer < layout.layers; ++layer) {
    for (bool value : {false, true}) {
      const std::size_t offset = layout.tensor_offset(layer, value).value();
      REQUIRE(std::memcmp(a.data() + offset + first * row, b.data() + offset + first * row, (last - first) * row) == 0);
    }
  }
}

// Largest |x| and value range over one tensor, for the documented error bounds.
struct Extent {
  double abs_max = 0;
  double range = 0;
};
Extent extent(const KvLayout& layout, const std::vector<std::uint8_t>& kv) {
  double lo = INFINITY;
  double hi = -INFINITY;
  for (std::size_t i = 0; i < kv.size() / dtype_size(layout.dtype); ++i) {
    const double x = load_element(kv, layout.dtype, i);
    lo = std::min(lo, x);
    hi = std::max(hi, x);
  }
  return {std::max(std::fabs(lo), std::fabs(hi)), hi - lo};
}

}  // namespace

TEST_CASE("lossless codecs are bit-exact for every dtype and shape even on random bit patterns", "[codec][roundtrip]") {
  const auto registry = CodecRegistry::with_builtins();
  std::mt19937 random(3);
  for (const char* name : {"raw", "lossless", "raw+zstd", "lossless+zstd"}) {
    const auto spec = resolve_codec(registry, name).value();
    for (auto layout : kShapes) {
      for (DType dtype : kDtypes) {
        layout.dtype = dtype;
        INFO(name << " " << layout.describe());
        const auto kv = synthetic_kv(layout, 17).value();
        CHECK(round_trip(registry, spec, layout, kv, {}) == kv);
        std::vector<std::uint8_t> noise(kv.size());
        for (auto& byte : noise)
          byte = static_cast<std::uint8_t>(random());
        CHECK(round_trip(registry, spec, layout, noise, {}) == noise);
      }
    }
  }
}

TEST_CASE("lossless spans several chunks and compresses 16-bit KV", "[codec][roundtrip]") {
  const auto registry = CodecRegistry::with_builtins();
  const KvLayout layout{2, 4, 64, DType::kBFloat16, 1500};  // 3 MiB: four 1 MiB chunks, the last partial
  const auto kv = synthetic_kv(layout, 23).value();
  const auto spec = resolve_codec(registry, "lossless").value();
  CHECK(round_trip(registry, spec, layout, kv, {}) == kv);
  const auto frame = encode_frame(*spec.codec, layout, kv).value();
  // Gaussian bf16: the exponent plane compresses, the mantissa plane does not; > 1.2 overall.
  CHECK(static_cast<double>(kv.size()) / static_cast<double>(frame.size()) > 1.2);
}

TEST_CASE("lossy codecs keep sinks and the recent window exact and stay within bounds", "[codec][roundtrip]") {
  const auto registry = CodecRegistry::with_builtins();
  struct Case {
    const char* name;
    std::uint32_t group;
    double rel_l2_bound;  // documented in docs/codecs.md for Gaussian KV with outlier channels
    double max_code;      // 0 for fp8
  };
  const Case cases[] = {{"fp8", 32, 0.06, 0},     {"int8", 64, 0.012, 255}, {"int8", 32, 0.012, 255},
                        {"int4", 32, 0.2, 15},    {"int4", 64, 0.2, 15},    {"int4+zstd", 32, 0.2, 15},
                        {"fp8+zstd", 32, 0.06, 0}};
  for (const auto& c : cases) {
    const auto spec = resolve_codec(registry, c.name).value();
    for (auto layout : kShapes) {
      for (DType dtype : kDtypes) {
        layout.dtype = dtype;
        INFO(c.name << " group " << c.group << " " << layout.describe());
        const auto kv = synthetic_kv(layout, 29).value();
        const auto params = params_with(c.group);
        const auto decoded = round_trip(registry, spec, layout, kv, params);
        const std::size_t tokens = layout.tokens;
        const std::size_t sink = std::min<std::size_t>(4, tokens);
        const std::size_t recent = std::min<std::size_t>(16, tokens - sink);
        require_rows_exact(layout, kv, decoded, 0, sink);
        require_rows_exact(layout, kv, decoded, tokens - recent, tokens);
        if (tokens == sink + recent) {
          CHECK(decoded == kv);
          continue;
        }
        const QuerySet no_queries;
        const auto report = compare_kv(layout, kv, decoded, no_queries).value();
        CHECK(report.keys.rel_l2 < c.rel_l2_bound);
        CHECK(report.values.rel_l2 < c.rel_l2_bound);
        CHECK(report.keys.rel_l2 > 0);  // really quantized
        // Element bound: half a quantization step of the widest possible group plus fp16
        // rounding of scale and zero (2^-11 relative) and the output dtype's rounding.
        const Extent e = extent(layout, kv);
        const double output_rounding = dtype == DType::kBFloat16 ? 1.0 / 256 : 1.0 / 2048;
        const double bound =
            c.max_code > 0 ? e.range * (0.5 / c.max_code + 1.0 / 1024) + e.abs_max * (1.0 / 1024 + output_rounding)
                           : e.abs_max * (1.0 / 16 + output_rounding);
        CHECK(report.keys.max_abs <= bound);
        CHECK(report.values.max_abs <= bound);
      }
    }
  }
}

TEST_CASE("int4 with larger groups has larger error and int8 beats int4", "[codec][roundtrip]") {
  const auto registry = CodecRegistry::with_builtins();
  const KvLayout layout{2, 2, 64, DType::kFloat16, 600};
  const auto kv = synthetic_kv(layout, 31).value();
  const auto queries = sample_queries(layout, kv, 4, 4, 1).value();
  const auto int4 = resolve_codec(registry, "int4").value();
  const auto int8 = resolve_codec(registry, "int8").value();
  const auto small = evaluate(registry, int4, layout, kv, queries, params_with(32, 128)).value();
  const auto large = evaluate(registry, int4, layout, kv, queries, params_with(128, 128)).value();
  const auto eight = evaluate(registry, int8, layout, kv, queries, params_with(64, 128)).value();
  CHECK(small.keys.rel_l2 < large.keys.rel_l2);
  CHECK(large.ratio > small.ratio);
  CHECK(eight.attn_rel_err < small.attn_rel_err);
  CHECK(eight.values.rel_l2 < small.values.rel_l2 / 8);
}

TEST_CASE("sparse per head (per_position 0) keeps the top key norms per head exactly and records positions",
          "[codec][roundtrip]") {
  const auto registry = CodecRegistry::with_builtins();
  const auto spec = resolve_codec(registry, "sparse").value();
  for (auto layout : kShapes) {
    for (DType dtype : kDtypes) {
      layout.dtype = dtype;
      INFO(layout.describe());
      const auto kv = synthetic_kv(layout, 37, 0).value();
      BuiltinParams per_head;
      per_head.recent_tokens = 16;
      per_head.per_position = false;
      const auto wire = per_head.serialize();
      const std::vector<std::uint8_t> params(wire.begin(), wire.end());
      EncodeOptions options;
      options.params = params;
      const auto frame = encode_frame(*spec.codec, layout, kv, options).value();
      std::vector<std::uint8_t> decoded(kv.size());
      REQUIRE(decode_frame(registry, frame, decoded));
      const auto header = inspect_frame(frame).value();
      const auto mask =
          sparse_kept_mask(layout, header.params,
                           {frame.data() + kFrameHeaderSize + header.params.size(), header.payload_length})
              .value();
      const std::size_t tokens = layout.tokens;
      const std::size_t heads = layout.kv_heads;
      const std::size_t dim = layout.head_dim;
      const std::size_t sink = std::min<std::size_t>(4, tokens);
      const std::size_t recent = std::min<std::size_t>(16, tokens - sink);
      const std::size_t middle = tokens - sink - recent;
      for (std::uint32_t layer = 0; layer < layout.layers; ++layer) {
        const std::size_t k_base = layout.tensor_offset(layer, false).value() / dtype_size(dtype);
        const std::size_t v_base = layout.tensor_offset(layer, true).value() / dtype_size(dtype);
        for (std::size_t h = 0; h < heads; ++h) {
          const std::uint8_t* kept = mask.data() + (layer * heads + h) * tokens;
          std::size_t kept_middle = 0;
          double min_kept = INFINITY;
          double max_dropped = 0;
          for (std::size_t t = 0; t < tokens; ++t) {
            double norm = 0;
            bool exact = true;
            bool zero = true;
            for (std::size_t d = 0; d < dim; ++d) {
              const std::size_t k = k_base + t * heads * dim + h * dim + d;
              const std::size_t v = v_base + t * heads * dim + h * dim + d;
              const double x = load_element(kv, dtype, k);
              norm += x * x;
              exact = exact && load_element(decoded, dtype, k) == x &&
                      load_element(decoded, dtype, v) == load_element(kv, dtype, v);
              zero = zero && load_element(decoded, dtype, k) == 0 && load_element(decoded, dtype, v) == 0;
            }
            if (t < sink || t >= tokens - recent) {
              REQUIRE(kept[t] == 1);
            } else if (kept[t] == 1) {
              ++kept_middle;
              min_kept = std::min(min_kept, norm);
            } else {
              max_dropped = std::max(max_dropped, norm);
            }
            REQUIRE((kept[t] == 1 ? exact : zero));
          }
          CHECK(kept_middle == (middle * 250 + 999) / 1000);
          if (kept_middle > 0 && kept_middle < middle) CHECK(min_kept >= max_dropped);
        }
      }
    }
  }
}

TEST_CASE("codec parameters outside their ranges are refused at encode", "[codec][roundtrip]") {
  const auto registry = CodecRegistry::with_builtins();
  const KvLayout layout{1, 1, 8, DType::kFloat32, 10};
  const auto kv = synthetic_kv(layout, 1).value();
  EncodeOptions options;
  options.params = params_with(3);
  CHECK(encode_frame(*registry.find("int4"), layout, kv, options).error().code == ErrorCode::kInvalidArgument);
  options.params = {1, 2, 3};
  CHECK(encode_frame(*registry.find("int8"), layout, kv, options).error().code == ErrorCode::kInvalidArgument);
  const std::vector<std::uint8_t> short_kv(kv.begin(), kv.end() - 1);
  CHECK(encode_frame(*registry.find("raw"), layout, short_kv).error().code == ErrorCode::kLayoutMismatch);
}

TEST_CASE("lossless stores near-random planes as raw zstd blocks and restores them exactly", "[codec][roundtrip]") {
  const auto registry = CodecRegistry::with_builtins();
  const auto spec = resolve_codec(registry, "lossless").value();
  std::mt19937 random(41);
  // Plane sizes around zstd's 128 KiB block limit: one block short, exactly one, one byte over,
  // several, and chunks of 1 MiB (the last one partial).
  for (const std::uint64_t tokens : {1023U, 1024U, 1025U, 2500U, 9000U}) {
    const KvLayout layout{1, 1, 64, DType::kBFloat16, tokens};
    std::vector<std::uint8_t> noise(layout.total_bytes().value());
    for (auto& byte : noise)
      byte = static_cast<std::uint8_t>(random());
    INFO(layout.describe());
    CHECK(round_trip(registry, spec, layout, noise, {}) == noise);
    const auto frame = encode_frame(*spec.codec, layout, noise).value();
    // Stored planes cost their bytes plus a 9-byte frame header, 3 bytes per 128 KiB block and
    // the 4-byte length, per plane, plus the 72-byte frame header and trailer.
    const std::size_t planes = 2 * ((noise.size() + (1U << 20) - 1) >> 20);
    CHECK(frame.size() <= noise.size() + planes * (9 + 4 + 3 * 5) + 72 + 20);
  }
}
