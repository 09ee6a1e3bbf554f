#include <catch2/catch.hpp>

#include <cmath>

#include "kvrelay/refworker/generation.h"
#include "kvrelay/refworker/model.h"
#include "kvrelay/refworker/model_source.h"

namespace kr = kvrelay::refworker;
using kvrelay::ErrorCode;

namespace {

constexpr const char* kSyntheticShape = "layers=6,dim=128,heads=8,kv_heads=2,ffn=344,vocab=600,seq_len=256";

std::vector<float> prefill_logits(const kr::Model& model, std::span<const std::int32_t> tokens) {
  kr::InferenceSession session(model);
  auto logits = session.prefill(tokens);
  REQUIRE(logits);
  return logits.value();
}

std::vector<std::int32_t> some_tokens(std::size_t n) {
  std::vector<std::int32_t> tokens{kr::kBosToken};
  for (std::size_t i = 1; i < n; ++i)
    tokens.push_back(static_cast<std::int32_t>(3 + (i * 37) % 590));
  return tokens;
}

}  // namespace

TEST_CASE("refworker shape parser", "[refworker][synthetic]") {
  auto config = kr::parse_shape("layers=16,dim=1024,heads=16,kv_heads=4,ffn=2816,vocab=32000");
  REQUIRE(config);
  CHECK(config.value().layers == 16);
  CHECK(config.value().dim == 1024);
  CHECK(config.value().head_dim() == 64);
  CHECK(config.value().kv_dim() == 256);
  CHECK(config.value().hidden_dim == 2816);
  CHECK(config.value().vocab_size == 32000);
  CHECK(kr::parse_shape(config.value().shape_string()).value() == config.value());

  CHECK(kr::parse_shape("layers=2,bogus=3").error().code == ErrorCode::kInvalidArgument);
  CHECK(kr::parse_shape("layers=x").error().code == ErrorCode::kInvalidArgument);
  CHECK(kr::parse_shape("layers").error().code == ErrorCode::kInvalidArgument);
  CHECK(kr::parse_shape("layers=-1").error().code == ErrorCode::kInvalidArgument);
  CHECK(kr::parse_shape("dim=100,heads=16").error().code == ErrorCode::kInvalidArgument);
  CHECK(kr::parse_shape("heads=8,kv_heads=3").error().code == ErrorCode::kInvalidArgument);
  CHECK(kr::parse_shape("layers=0").error().code == ErrorCode::kInvalidArgument);
  CHECK(kr::parse_shape("layers=99999999999").error().code == ErrorCode::kInvalidArgument);
}

TEST_CASE("refworker synthetic weights are deterministic per seed", "[refworker][synthetic]") {
  const auto config = kr::parse_shape(kSyntheticShape).value();
  auto a = kr::make_synthetic(config, 42);
  auto b = kr::make_synthetic(config, 42);
  auto c = kr::make_synthetic(config, 43);
  REQUIRE(a);
  REQUIRE(b);
  REQUIRE(c);
  const auto tokens = some_tokens(40);
  CHECK(prefill_logits(a.value(), tokens) == prefill_logits(b.value(), tokens));
  CHECK(prefill_logits(a.value(), tokens) != prefill_logits(c.value(), tokens));
  CHECK(a.value().fingerprint() == b.value().fingerprint());
  CHECK_FALSE(a.value().fingerprint().kv_compatible_with(c.value().fingerprint()));
  CHECK(a.value().fingerprint().weights_identity == std::string("synthetic:") + kSyntheticShape + ":42");
  CHECK(a.value().fingerprint().head_dim == 16);
  CHECK(a.value().fingerprint().kv_heads == 2);
}

TEST_CASE("refworker synthetic activations stay finite and informative at depth", "[refworker][synthetic]") {
  auto config = kr::parse_shape("layers=24,dim=128,heads=8,kv_heads=2,ffn=344,vocab=600,seq_len=512").value();
  auto model = kr::make_synthetic(config, 1);
  REQUIRE(model);
  const auto tokens = some_tokens(300);
  kr::InferenceSession session(model.value());
  auto logits = session.prefill(tokens);
  REQUIRE(logits);
  double sum = 0.0;
  double sum_squares = 0.0;
  for (const float value : logits.value()) {
    REQUIRE(std::isfinite(value));
    sum += value;
    sum_squares += static_cast<double>(value) * value;
  }
  const double n = static_cast<double>(logits.value().size());
  const double stddev = std::sqrt(sum_squares / n - (sum / n) * (sum / n));
  CHECK(stddev > 0.1);    // not collapsed
  CHECK(stddev < 100.0);  // not exploding
  auto kv = session.export_kv(tokens.size());
  REQUIRE(kv);
  for (const float value : kv.value())
    REQUIRE(std::isfinite(value));
}

TEST_CASE("refworker synthetic model: KV prefix import equals full prefill", "[refworker][synthetic]") {
  auto model = kr::load_model({"", kSyntheticShape, 5});
  REQUIRE(model);
  const auto tokens = some_tokens(100);
  const auto full = prefill_logits(model.value(), tokens);
  kr::InferenceSession donor(model.value());
  REQUIRE(donor.prefill(std::span(tokens).first(70)));
  auto kv = donor.export_kv(70);
  REQUIRE(kv);
  kr::InferenceSession resumed(model.value());
  REQUIRE(resumed.import_kv(donor.layout(70), kv.value()));
  auto logits = resumed.prefill(std::span(tokens).subspan(70));
  REQUIRE(logits);
  float max_ref = 0.0F;
  float max_diff = 0.0F;
  for (std::size_t i = 0; i < full.size(); ++i) {
    max_ref = std::max(max_ref, std::fabs(full[i]));
    max_diff = std::max(max_diff, std::fabs(full[i] - logits.value()[i]));
  }
  CHECK(max_diff / max_ref < 1e-4F);
  CHECK(kr::argmax(full) == kr::argmax(logits.value()));
}

TEST_CASE("refworker synthetic: a shape too large to allocate is an error, not a crash", "[refworker][synthetic]") {
  // 1024 layers of dim 65536: about 100 TB of weights.
  auto config = kr::parse_shape("layers=1024,dim=65536,heads=1024,kv_heads=1024,ffn=262144,vocab=1000");
  REQUIRE(config);
  CHECK(kr::make_synthetic(config.value(), 1).error().code == ErrorCode::kResourceExhausted);
}

TEST_CASE("refworker load_model needs exactly one source", "[refworker][synthetic]") {
  CHECK(kr::load_model({}).error().code == ErrorCode::kInvalidArgument);
  CHECK(kr::load_model({"x.bin", kSyntheticShape, 0}).error().code == ErrorCode::kInvalidArgument);
}
