// The worker's pre-allocated KV cache: a session on a lent cache computes exactly what a session
// with its own cache computes, across requests that reuse the cache and past its capacity, and a
// prefix read straight into it (the shared-memory path) equals one copied in.

#include "kvrelay/refworker/kv_cache.h"

#include <catch2/catch.hpp>

#include <cmath>
#include <cstring>
#include <limits>

#include "kvrelay/refworker/generation.h"
#include "kvrelay/refworker/model.h"
#include "kvrelay/refworker/model_source.h"
#include "kvrelay/refworker/session.h"

namespace kr = kvrelay::refworker;
using kvrelay::ErrorCode;

namespace {

constexpr const char* kKvCacheShape = "layers=3,dim=64,heads=4,kv_heads=2,ffn=172,vocab=300,seq_len=256";

const kr::Model& model() {
  static auto built = kr::load_model({"", kKvCacheShape, 7});
  REQUIRE(built);
  return built.value();
}

std::vector<std::int32_t> tokens(std::size_t n, std::size_t salt) {
  std::vector<std::int32_t> out{kr::kBosToken};
  for (std::size_t i = 1; i < n; ++i)
    out.push_back(static_cast<std::int32_t>(3 + (i * 31 + salt * 7) % 290));
  return out;
}

struct Run {
  std::vector<float> logits;
  std::vector<float> kv;
};

// Prefill then a few decode steps, as a request does; the logits of the last step and the KV.
Run run(kr::InferenceSession& session, const std::vector<std::int32_t>& prompt) {
  auto logits = session.prefill(prompt);
  REQUIRE(logits);
  for (std::int32_t token = 10; token < 14; ++token) {
    logits = session.decode(token);
    REQUIRE(logits);
  }
  auto kv = session.export_kv(session.position());
  REQUIRE(kv);
  return {std::move(logits).value(), std::move(kv).value()};
}

// Same computation on differently placed buffers: equal up to BLAS kernels' alignment paths.
bool close(const std::vector<float>& a, const std::vector<float>& b) {
  if (a.size() != b.size()) return false;
  for (std::size_t i = 0; i < a.size(); ++i) {
    if (std::fabs(a[i] - b[i]) > 1e-5F * (1.0F + std::fabs(b[i]))) return false;
  }
  return true;
}

}  // namespace

TEST_CASE("refworker sessions on a lent KV cache compute what sessions with their own do", "[refworker][kv_cache]") {
  const auto& m = model();
  kr::KvCache cache(m.config().layers, m.config().kv_dim());
  REQUIRE(cache.reserve(40, 0));
  CHECK(cache.capacity() == 40);
  // Requests of different lengths in turn; the 90-token one outgrows the cache, which keeps its rows.
  for (const std::size_t length : {30U, 12U, 90U, 20U}) {
    const auto prompt = tokens(length, length);
    kr::InferenceSession own(m);
    kr::InferenceSession lent(m, cache);
    const Run expected = run(own, prompt);
    const Run got = run(lent, prompt);
    CHECK(close(got.logits, expected.logits));
    CHECK(close(got.kv, expected.kv));
  }
  CHECK(cache.capacity() >= 94);
}

TEST_CASE("refworker KV import through a reader equals import of a copy, and checks what it read",
          "[refworker][kv_cache]") {
  const auto& m = model();
  const auto prompt = tokens(50, 3);
  kr::InferenceSession donor(m);
  REQUIRE(donor.prefill(std::span(prompt).first(32)));
  auto kv = donor.export_kv(32);
  REQUIRE(kv);
  const auto layout = donor.layout(32);
  kvrelay::KvLayout wrong = layout;
  wrong.head_dim *= 2;

  kr::KvCache cache(m.config().layers, m.config().kv_dim());
  REQUIRE(cache.reserve(64, 0));
  std::size_t reads = 0;
  const std::vector<float>& source = kv.value();
  auto reader = [&](std::uint64_t offset, std::span<float> into) -> kvrelay::Status {
    ++reads;
    REQUIRE(offset + into.size() <= source.size());
    std::memcpy(into.data(), source.data() + offset, into.size_bytes());
    return kvrelay::ok();
  };

  SECTION("same logits as a copied prefix, one read per K and V tensor") {
    kr::InferenceSession copied(m);
    REQUIRE(copied.import_kv(layout, source));
    kr::InferenceSession read(m, cache);
    REQUIRE(read.import_kv(layout, reader));
    CHECK(reads == 2 * m.config().layers);
    CHECK(read.position() == 32);
    const std::vector<std::int32_t> rest(prompt.begin() + 32, prompt.end());
    CHECK(close(run(read, rest).logits, run(copied, rest).logits));
  }
  SECTION("a non-finite value read in is refused and the session stays empty") {
    auto poisoned = source;
    poisoned[poisoned.size() - 5] = std::numeric_limits<float>::quiet_NaN();
    kr::InferenceSession session(m, cache);
    auto imported = session.import_kv(layout, [&](std::uint64_t offset, std::span<float> into) {
      std::memcpy(into.data(), poisoned.data() + offset, into.size_bytes());
      return kvrelay::ok();
    });
    REQUIRE_FALSE(imported);
    CHECK(imported.error().code == ErrorCode::kCorrupt);
    CHECK(session.position() == 0);
  }
  SECTION("a failing read fails the import; a wrong layout is refused before reading") {
    kr::InferenceSession session(m, cache);
    auto failed = session.import_kv(
        layout, [](std::uint64_t, std::span<float>) { return kvrelay::fail(ErrorCode::kIo, "segment gone"); });
    REQUIRE_FALSE(failed);
    CHECK(failed.error().code == ErrorCode::kIo);
    CHECK(session.position() == 0);
    auto refused = session.import_kv(wrong, reader);
    REQUIRE_FALSE(refused);
    CHECK(refused.error().code == ErrorCode::kLayoutMismatch);
    CHECK(reads == 0);
  }
}
