#include <catch2/catch.hpp>

#include <algorithm>
#include <cmath>
#include <vector>

#include "kvrelay/codec_plugins/metrics.h"
#include "kvrelay/codec_plugins/tensor_file.h"

using namespace kvrelay;
using namespace kvrelay::codec;

TEST_CASE("identical KV has zero error and infinite SNR", "[codec][metrics]") {
  const KvLayout layout{2, 2, 8, DType::kFloat32, 20};
  const auto kv = synthetic_kv(layout, 1).value();
  const auto queries = sample_queries(layout, kv, 3, 4, 2).value();
  const auto report = compare_kv(layout, kv, kv, queries).value();
  REQUIRE(report.layers.size() == 2);
  CHECK(report.keys.rel_l2 == 0);
  CHECK(std::isinf(report.keys.snr_db));
  CHECK(report.values.cosine == Approx(1.0));
  CHECK(report.attn_rel_err == 0);
}

TEST_CASE("a uniform 1% scaling of V gives 1% error in V and in attention outputs", "[codec][metrics]") {
  const KvLayout layout{1, 2, 8, DType::kFloat32, 30};
  const auto kv = synthetic_kv(layout, 4).value();
  std::vector<float> scaled(kv.size() / 4);
  for (std::size_t i = 0; i < scaled.size(); ++i) {
    const bool is_value = i >= scaled.size() / 2;
    scaled[i] = load_element(kv, DType::kFloat32, i) * (is_value ? 1.01F : 1.0F);
  }
  const auto decoded = convert_from_f32(scaled, DType::kFloat32);
  const auto queries = sample_queries(layout, kv, 5, 2, 3).value();
  const auto report = compare_kv(layout, kv, decoded, queries).value();
  CHECK(report.keys.rel_l2 == 0);
  CHECK(report.values.rel_l2 == Approx(0.01).epsilon(1e-4));
  CHECK(report.values.snr_db == Approx(40.0).epsilon(1e-3));
  CHECK(report.values.cosine == Approx(1.0));
  // Attention weights are unchanged, so the output scales by exactly 1.01 too.
  CHECK(report.attn_rel_err == Approx(0.01).epsilon(1e-4));
}

TEST_CASE("GQA queries map onto kv heads and bad query sets are refused", "[codec][metrics]") {
  const KvLayout layout{1, 2, 4, DType::kFloat32, 6};
  const auto kv = synthetic_kv(layout, 4).value();
  std::vector<float> perturbed(kv.size() / 4);
  for (std::size_t i = 0; i < perturbed.size(); ++i) perturbed[i] = load_element(kv, DType::kFloat32, i);
  // Shift only kv head 0's values (row = 2 heads x 4 dims).
  const std::size_t v_base = perturbed.size() / 2;
  for (std::size_t t = 0; t < 6; ++t) {
    for (std::size_t d = 0; d < 4; ++d) perturbed[v_base + t * 8 + d] += 1.0F;
  }
  const auto decoded = convert_from_f32(perturbed, DType::kFloat32);
  QuerySet queries;
  queries.count = 1;
  queries.query_heads = 4;  // heads 0,1 -> kv head 0; heads 2,3 -> kv head 1
  queries.data.assign(4 * 4, 0.5F);
  // Query a on heads 0,1 and zero on heads 2,3. With GQA (h / 2) that is the same as two
  // query heads [a, 0] one-to-one; a modulo mapping would pair a with kv head 1 instead.
  for (std::size_t i = 8; i < 16; ++i) queries.data[i] = 0;
  QuerySet one_to_one;
  one_to_one.count = 1;
  one_to_one.query_heads = 2;
  one_to_one.data = {0.5F, 0.5F, 0.5F, 0.5F, 0, 0, 0, 0};
  const auto grouped = compare_kv(layout, kv, decoded, queries).value();
  const auto direct = compare_kv(layout, kv, decoded, one_to_one).value();
  CHECK(grouped.attn_rel_err > 0);
  CHECK(grouped.attn_rel_err == Approx(direct.attn_rel_err).epsilon(1e-12));
  CHECK(compare_kv(layout, kv, kv, queries).value().attn_rel_err == 0);
  QuerySet wrong = queries;
  wrong.query_heads = 3;
  CHECK(compare_kv(layout, kv, decoded, wrong).error().code == ErrorCode::kInvalidArgument);
  wrong = queries;
  wrong.data.pop_back();
  CHECK(compare_kv(layout, kv, decoded, wrong).error().code == ErrorCode::kLayoutMismatch);
}

TEST_CASE("synthetic KV has outlier key channels", "[codec][metrics]") {
  const KvLayout layout{1, 1, 32, DType::kFloat32, 400};
  const auto kv = synthetic_kv(layout, 8, 2, 12.0F).value();
  std::vector<double> channel_sq(32, 0.0);
  for (std::size_t t = 0; t < 400; ++t) {
    for (std::size_t c = 0; c < 32; ++c) {
      const double x = load_element(kv, DType::kFloat32, t * 32 + c);
      channel_sq[c] += x * x;
    }
  }
  std::sort(channel_sq.begin(), channel_sq.end());
  // The loudest channel carries far more energy than the median one.
  CHECK(channel_sq.back() > 50 * channel_sq[16]);
}
