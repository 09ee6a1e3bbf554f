// The kv_sparse keep rule (issue #28): sparse_keep_positions, the `sparse` codec's per-position
// selection that applies it to every layer and kv head, and the parameter that selects it.
#include <catch2/catch.hpp>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <vector>

#include "kvrelay/codec_plugins/builtin_codecs.h"
#include "kvrelay/codec_plugins/builtin_params.h"
#include "kvrelay/codec_plugins/frame.h"
#include "kvrelay/codec_plugins/metrics.h"
#include "kvrelay/codec_plugins/sparse.h"
#include "kvrelay/codec_plugins/tensor_file.h"

using namespace kvrelay;
using namespace kvrelay::codec;

namespace {

std::span<const std::byte> as_bytes(const std::vector<std::uint8_t>& kv) {
  return std::as_bytes(std::span<const std::uint8_t>(kv));
}

// Position t's score as the rule defines it: its key L2 norms summed over layers and kv heads.
double reference_score(const KvLayout& layout, const std::vector<std::uint8_t>& kv, std::size_t t) {
  double score = 0;
  for (std::uint32_t layer = 0; layer < layout.layers; ++layer) {
    const std::size_t base = layout.tensor_offset(layer, false).value() / dtype_size(layout.dtype);
    for (std::size_t h = 0; h < layout.kv_heads; ++h) {
      double sum = 0;
      for (std::size_t d = 0; d < layout.head_dim; ++d) {
        const double x = load_element(kv, layout.dtype, base + (t * layout.kv_heads + h) * layout.head_dim + d);
        sum += x * x;
      }
      score += std::sqrt(sum);
    }
  }
  return score;
}

std::vector<std::uint8_t> kept_flags(std::span<const TokenRun> runs, std::uint64_t tokens) {
  std::vector<std::uint8_t> kept(tokens, 0);
  for (const auto& run : runs)
    std::fill_n(kept.begin() + run.start, run.length, std::uint8_t{1});
  return kept;
}

void set_key(const KvLayout& layout, std::vector<float>& kv, std::uint32_t layer, std::size_t t, std::size_t head,
             float value) {
  const std::size_t base = layout.tensor_offset(layer, false).value() / 4;
  for (std::size_t d = 0; d < layout.head_dim; ++d)
    kv[base + (t * layout.kv_heads + head) * layout.head_dim + d] = value;
}

std::vector<std::uint8_t> to_bytes(const std::vector<float>& values) {
  std::vector<std::uint8_t> bytes(values.size() * 4);
  std::memcpy(bytes.data(), values.data(), bytes.size());
  return bytes;
}

// The sparse frame's kept mask, [layers][kv_heads][tokens].
std::vector<std::uint8_t> frame_mask(const KvLayout& layout, const std::vector<std::uint8_t>& kv,
                                     const BuiltinParams& params) {
  const auto registry = CodecRegistry::with_builtins();
  EncodeOptions options;
  const auto wire = params.serialize();
  options.params.assign(wire.begin(), wire.end());
  const auto frame = encode_frame(*registry.find("sparse"), layout, kv, options).value();
  std::vector<std::uint8_t> decoded(kv.size());
  REQUIRE(decode_frame(registry, frame, decoded));
  const auto header = inspect_frame(frame).value();
  return sparse_kept_mask(layout, header.params,
                          {frame.data() + kFrameHeaderSize + header.params.size(), header.payload_length})
      .value();
}

}  // namespace

TEST_CASE("sparse_keep_positions keeps sinks, recent and the top middle fraction by summed key norm",
          "[codec][sparse]") {
  const std::vector<KvLayout> shapes = {{2, 3, 8, DType::kFloat32, 1},    {1, 1, 64, DType::kFloat32, 200},
                                        {3, 2, 36, DType::kFloat32, 170}, {5, 4, 8, DType::kFloat32, 400},
                                        {1, 1, 7, DType::kFloat32, 151},  {2, 2, 16, DType::kFloat32, 9}};
  const std::vector<SparseKeep> rules = {{}, {4, 16, 250}, {0, 0, 500}, {2, 3, 1000}, {1, 2, 0}, {4, 16, 333}};
  for (auto layout : shapes) {
    for (const DType dtype : {DType::kFloat32, DType::kFloat16, DType::kBFloat16}) {
      layout.dtype = dtype;
      const auto kv = synthetic_kv(layout, 11, 2).value();
      for (const auto& rule : rules) {
        INFO(layout.describe() << " sink " << rule.sink_tokens << " recent " << rule.recent_tokens << " keep "
                               << rule.keep_permille);
        const auto runs = sparse_keep_positions(layout, as_bytes(kv), rule);
        REQUIRE(runs);
        REQUIRE(check_token_runs(runs.value(), layout.tokens));
        for (std::size_t i = 1; i < runs.value().size(); ++i)  // never two adjacent runs
          CHECK(runs.value()[i - 1].start + runs.value()[i - 1].length < runs.value()[i].start);
        const std::uint64_t tokens = layout.tokens;
        const std::uint64_t sinks = std::min<std::uint64_t>(rule.sink_tokens, tokens);
        const std::uint64_t recent = std::min<std::uint64_t>(rule.recent_tokens, tokens - sinks);
        const std::uint64_t middle = tokens - sinks - recent;
        const std::uint64_t expected = sinks + recent + (middle * rule.keep_permille + 999) / 1000;
        CHECK(run_tokens(runs.value()) == expected);
        CHECK(sparse_kept_count(tokens, rule) == expected);
        const auto kept = kept_flags(runs.value(), tokens);
        double min_kept = std::numeric_limits<double>::infinity();
        double max_dropped = -1;
        for (std::size_t t = 0; t < tokens; ++t) {
          if (t < sinks || t >= tokens - recent) {
            REQUIRE(kept[t] == 1);
            continue;
          }
          const double score = reference_score(layout, kv, t);
          if (kept[t] == 1) {
            min_kept = std::min(min_kept, score);
          } else {
            max_dropped = std::max(max_dropped, score);
          }
        }
        // Scores are summed in another order here: equal up to rounding.
        if (max_dropped >= 0 && min_kept < std::numeric_limits<double>::infinity())
          CHECK(min_kept >= max_dropped * (1 - 1e-12));
      }
    }
  }
}

TEST_CASE("sparse_keep_positions ranks by the norm summed over every layer and head, ties and NaN last",
          "[codec][sparse]") {
  const KvLayout layout{2, 2, 4, DType::kFloat32, 12};
  const SparseKeep rule{2, 2, 250};  // middle 8 positions (2..9), keeps 2
  std::vector<float> kv(layout.total_bytes().value() / 4, 0.0F);
  // Position 3: one large head in one layer (norm 2 * 10 = 20). Position 6: every head of every
  // layer moderate (4 x 2 * 3 = 24). Position 8: the largest single norm but one NaN element.
  set_key(layout, kv, 1, 3, 0, 10.0F);
  for (std::uint32_t layer = 0; layer < 2; ++layer)
    for (std::size_t head = 0; head < 2; ++head)
      set_key(layout, kv, layer, 6, head, 3.0F);
  set_key(layout, kv, 0, 8, 1, 100.0F);
  kv[layout.tensor_offset(1, false).value() / 4 + (8 * 2 + 0) * 4] = std::numeric_limits<float>::quiet_NaN();
  auto runs = sparse_keep_positions(layout, as_bytes(to_bytes(kv)), rule).value();
  CHECK(runs == std::vector<TokenRun>{{0, 2}, {3, 1}, {6, 1}, {10, 2}});

  // All scores equal: the earliest middle positions win.
  std::vector<float> flat(kv.size(), 1.0F);
  runs = sparse_keep_positions(layout, as_bytes(to_bytes(flat)), rule).value();
  CHECK(runs == std::vector<TokenRun>{{0, 4}, {10, 2}});

  // Every head of position 5 at 3.5 (score 28) outranks 6 (24) and 3 (20): 5 and 6 are kept.
  for (std::uint32_t layer = 0; layer < 2; ++layer)
    for (std::size_t head = 0; head < 2; ++head)
      set_key(layout, kv, layer, 5, head, 3.5F);
  runs = sparse_keep_positions(layout, as_bytes(to_bytes(kv)), rule).value();
  CHECK(runs == std::vector<TokenRun>{{0, 2}, {5, 2}, {10, 2}});

  // Every position kept: one run. No tokens: no runs.
  runs = sparse_keep_positions(layout, as_bytes(to_bytes(kv)), SparseKeep{2, 2, 1000}).value();
  CHECK(runs == std::vector<TokenRun>{{0, 12}});
  const KvLayout empty{2, 2, 4, DType::kFloat32, 0};
  CHECK(sparse_keep_positions(empty, {}, rule).value().empty());
}

TEST_CASE("sparse_keep_positions refuses bad inputs", "[codec][sparse]") {
  const KvLayout layout{2, 2, 8, DType::kFloat16, 40};
  const auto kv = synthetic_kv(layout, 3).value();
  const auto bytes = as_bytes(kv);
  CHECK(sparse_keep_positions(layout, bytes.first(bytes.size() - 2), {}).error().code == ErrorCode::kLayoutMismatch);
  CHECK(sparse_keep_positions(layout, bytes, SparseKeep{4, 16, 1001}).error().code == ErrorCode::kInvalidArgument);
  KvLayout no_heads = layout;
  no_heads.kv_heads = 0;
  CHECK(sparse_keep_positions(no_heads, bytes, {}).error().code == ErrorCode::kInvalidArgument);
  KvLayout fp8 = layout;
  fp8.dtype = DType::kFp8E4M3;
  std::vector<std::uint8_t> fp8_kv(fp8.total_bytes().value(), 0x38);
  CHECK(sparse_keep_positions(fp8, as_bytes(fp8_kv), {}).error().code == ErrorCode::kUnsupported);
  KvLayout huge = layout;
  huge.tokens = std::uint64_t{1} << 33;
  CHECK(sparse_keep_positions(huge, bytes, {}).error().code == ErrorCode::kOutOfRange);
}

TEST_CASE("the sparse codec keeps sparse_keep_positions for every layer and head by default", "[codec][sparse]") {
  const KvLayout layout{3, 4, 16, DType::kBFloat16, 300};
  const auto kv = synthetic_kv(layout, 23, 2).value();
  BuiltinParams params;
  REQUIRE(params.per_position);
  const auto runs = sparse_keep_positions(layout, as_bytes(kv), SparseKeep::of(params)).value();
  const auto expected = kept_flags(runs, layout.tokens);
  const auto mask = frame_mask(layout, kv, params);
  const std::size_t tokens = layout.tokens;
  for (std::size_t row = 0; row < layout.layers * layout.kv_heads; ++row) {
    INFO("layer " << row / layout.kv_heads << " head " << row % layout.kv_heads);
    CHECK(std::equal(expected.begin(), expected.end(), mask.begin() + static_cast<std::ptrdiff_t>(row * tokens)));
  }
  // Per head (per_position false), the heads choose differently on this KV.
  params.per_position = false;
  const auto per_head = frame_mask(layout, kv, params);
  bool differs = false;
  for (std::size_t row = 1; row < layout.layers * layout.kv_heads; ++row)
    differs = differs || !std::equal(per_head.begin(), per_head.begin() + static_cast<std::ptrdiff_t>(tokens),
                                     per_head.begin() + static_cast<std::ptrdiff_t>(row * tokens));
  CHECK(differs);
  // Same size either way: the frame format is one.
  CHECK(std::count(per_head.begin(), per_head.end(), 1) == std::count(mask.begin(), mask.end(), 1));
}

TEST_CASE("per_position travels in bit 16 of the keep field, default bytes unchanged", "[codec][sparse]") {
  BuiltinParams params;
  auto wire = params.serialize();
  std::uint32_t keep = 0;
  std::memcpy(&keep, wire.data() + 12, 4);
  CHECK(keep == 250);  // the field's bytes before the mode existed
  CHECK(BuiltinParams::parse(wire.data(), wire.size()).value() == params);
  params.per_position = false;
  params.keep_permille = 100;
  wire = params.serialize();
  std::memcpy(&keep, wire.data() + 12, 4);
  CHECK(keep == (100U | (1U << 16)));
  CHECK(BuiltinParams::parse(wire.data(), wire.size()).value() == params);
  keep = 250U | (1U << 17);
  std::memcpy(wire.data() + 12, &keep, 4);
  CHECK(BuiltinParams::parse(wire.data(), wire.size()).error().code == ErrorCode::kInvalidArgument);
  params.keep_permille = 65536 + 250;  // never aliased into the mode bit
  wire = params.serialize();
  CHECK(BuiltinParams::parse(wire.data(), wire.size()).error().code == ErrorCode::kInvalidArgument);
}

TEST_CASE("attention_top1_agreement is 1 for lossless codecs and below 1 for int4", "[codec][metrics][sparse]") {
  const auto registry = CodecRegistry::with_builtins();
  const KvLayout layout{2, 2, 32, DType::kFloat16, 300};
  const auto kv = synthetic_kv(layout, 5).value();
  const auto queries = sample_queries(layout, kv, 32, 4, 9).value();
  for (const char* name : {"raw", "lossless"}) {
    const auto report = evaluate(registry, resolve_codec(registry, name).value(), layout, kv, queries).value();
    CHECK(report.attention_top1_agreement == 1.0);
    for (const auto& layer : report.layers)
      CHECK(layer.attention_top1_agreement == 1.0);
  }
  const auto int4 = evaluate(registry, resolve_codec(registry, "int4").value(), layout, kv, queries).value();
  CHECK(int4.attention_top1_agreement < 1.0);
  CHECK(int4.attention_top1_agreement > 0.5);
  const auto int8 = evaluate(registry, resolve_codec(registry, "int8").value(), layout, kv, queries).value();
  CHECK(int8.attention_top1_agreement >= int4.attention_top1_agreement);
  // sparse and sparse+zstd mask the same dropped positions, so they agree on every figure.
  const auto sparse = evaluate(registry, resolve_codec(registry, "sparse").value(), layout, kv, queries).value();
  const auto staged = evaluate(registry, resolve_codec(registry, "sparse+zstd").value(), layout, kv, queries).value();
  CHECK(sparse.attn_rel_err == staged.attn_rel_err);
  CHECK(sparse.attention_top1_agreement == staged.attention_top1_agreement);
  CHECK(sparse.attention_top1_agreement <= 1.0);
}
