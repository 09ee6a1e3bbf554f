#include "kvrelay/core/kv_tokens.h"

#include <catch2/catch.hpp>

#include <cstdint>
#include <vector>

using kvrelay::DType;
using kvrelay::ErrorCode;
using kvrelay::KvLayout;

namespace {

// Every byte names its tensor, token and offset in the row, so a misplaced copy shows.
std::vector<std::byte> numbered_cache(const KvLayout& layout) {
  std::vector<std::byte> bytes(layout.total_bytes().value());
  const std::uint64_t row = layout.bytes_per_token().value() / (2ULL * layout.layers);
  for (std::size_t index = 0; index < bytes.size(); ++index) {
    const std::uint64_t tensor = index / (layout.tokens * row);
    const std::uint64_t token = (index / row) % layout.tokens;
    bytes[index] = static_cast<std::byte>((tensor * 31 + token * 7 + index % row) & 0xFF);
  }
  return bytes;
}

}  // namespace

TEST_CASE("a cache split at any token and joined again is the original", "[core][kv_tokens]") {
  const KvLayout layout{3, 2, 4, DType::kFloat16, 19};
  const auto cache = numbered_cache(layout);
  for (std::uint64_t split : {0ULL, 1ULL, 16ULL, 18ULL, 19ULL}) {
    INFO("split at " << split);
    std::vector<std::byte> head(layout.with_tokens(split).total_bytes().value());
    std::vector<std::byte> tail(layout.with_tokens(layout.tokens - split).total_bytes().value());
    REQUIRE(kvrelay::copy_token_range(layout, cache, 0, split, head));
    REQUIRE(kvrelay::copy_token_range(layout, cache, split, layout.tokens, tail));
    std::vector<std::byte> joined(cache.size());
    REQUIRE(
        kvrelay::join_tokens(layout.with_tokens(split), head, layout.with_tokens(layout.tokens - split), tail, joined));
    CHECK(joined == cache);
  }
}

TEST_CASE("a middle token range holds exactly those tokens of every tensor", "[core][kv_tokens]") {
  const KvLayout layout{2, 1, 2, DType::kFloat32, 5};
  std::vector<std::byte> cache(layout.total_bytes().value());
  const std::uint64_t row = 8;  // 1 head x 2 dims x 4 bytes
  for (std::size_t index = 0; index < cache.size(); ++index)
    cache[index] = static_cast<std::byte>(index / row);  // the (tensor, token) ordinal
  std::vector<std::byte> middle(layout.with_tokens(2).total_bytes().value());
  REQUIRE(kvrelay::copy_token_range(layout, cache, 2, 4, middle));
  for (std::size_t index = 0; index < middle.size(); ++index) {
    const std::size_t tensor = index / (2 * row);
    const std::size_t token = 2 + (index / row) % 2;
    CHECK(std::to_integer<std::size_t>(middle[index]) == tensor * 5 + token);
  }
}

TEST_CASE("token ranges and joins refuse sizes and shapes that disagree", "[core][kv_tokens]") {
  const KvLayout layout{2, 2, 4, DType::kFloat32, 8};
  const auto cache = numbered_cache(layout);
  std::vector<std::byte> out(layout.with_tokens(4).total_bytes().value());
  CHECK(kvrelay::copy_token_range(layout, cache, 6, 10, out).error().code == ErrorCode::kOutOfRange);
  CHECK(kvrelay::copy_token_range(layout, cache, 5, 4, out).error().code == ErrorCode::kOutOfRange);
  CHECK(kvrelay::copy_token_range(layout, cache, 0, 3, out).error().code == ErrorCode::kLayoutMismatch);
  CHECK(kvrelay::copy_token_range(layout, std::span(cache).first(cache.size() - 1), 0, 4, out).error().code ==
        ErrorCode::kLayoutMismatch);

  KvLayout other = layout.with_tokens(4);
  other.head_dim = 8;
  std::vector<std::byte> other_bytes(other.total_bytes().value());
  std::vector<std::byte> joined(layout.with_tokens(12).total_bytes().value());
  const auto mismatch = kvrelay::join_tokens(layout, cache, other, other_bytes, joined);
  REQUIRE_FALSE(mismatch);
  CHECK(mismatch.error().code == ErrorCode::kLayoutMismatch);
  CHECK(mismatch.error().message.find("cannot join") != std::string::npos);
  std::vector<std::byte> short_out(joined.size() - 4);
  CHECK(kvrelay::join_tokens(layout, cache, layout.with_tokens(4), out, short_out).error().code ==
        ErrorCode::kLayoutMismatch);
}

TEST_CASE("token runs select positions of every tensor, in order", "[core][kv_tokens]") {
  const KvLayout layout{2, 2, 4, DType::kFloat32, 10};
  const auto cache = numbered_cache(layout);
  const std::vector<kvrelay::TokenRun> runs{{0, 2}, {7, 3}};
  REQUIRE(kvrelay::run_tokens(runs) == 5);
  std::vector<std::byte> kept(layout.with_tokens(5).total_bytes().value());
  REQUIRE(kvrelay::copy_token_runs(layout, cache, runs, kept));
  // Each kept row equals the source row of its original position, tensor by tensor.
  const std::uint64_t row = layout.bytes_per_token().value() / (2ULL * layout.layers);
  const std::uint64_t positions[] = {0, 1, 7, 8, 9};
  for (std::uint64_t tensor = 0; tensor < 2ULL * layout.layers; ++tensor) {
    for (std::uint64_t r = 0; r < 5; ++r) {
      const auto* got = kept.data() + (tensor * 5 + r) * row;
      const auto* want = cache.data() + (tensor * layout.tokens + positions[r]) * row;
      CHECK(std::equal(got, got + row, want));
    }
  }
}

TEST_CASE("token runs must be ascending, disjoint, non-empty and inside the cache", "[core][kv_tokens]") {
  using kvrelay::TokenRun;
  CHECK(kvrelay::check_token_runs(std::vector<TokenRun>{{0, 4}, {4, 2}}, 6));
  CHECK(kvrelay::check_token_runs(std::vector<TokenRun>{}, 6));
  CHECK(kvrelay::check_token_runs(std::vector<TokenRun>{{2, 0}}, 6).error().code == ErrorCode::kInvalidArgument);
  const auto overlap = kvrelay::check_token_runs(std::vector<TokenRun>{{0, 4}, {3, 2}}, 9);
  REQUIRE_FALSE(overlap);
  CHECK(overlap.error().message.find("before the previous run ends") != std::string::npos);
  CHECK(kvrelay::check_token_runs(std::vector<TokenRun>{{5, 2}, {1, 1}}, 9).error().code ==
        ErrorCode::kInvalidArgument);
  CHECK(kvrelay::check_token_runs(std::vector<TokenRun>{{4, 3}}, 6).error().code == ErrorCode::kOutOfRange);
  const KvLayout layout{1, 1, 4, DType::kFloat32, 6};
  const auto cache = numbered_cache(layout);
  std::vector<std::byte> out(layout.with_tokens(2).total_bytes().value());
  CHECK(kvrelay::copy_token_runs(layout, cache, std::vector<TokenRun>{{0, 3}}, out).error().code ==
        ErrorCode::kLayoutMismatch);  // three tokens do not fit two
}

TEST_CASE("token runs are coarsened across the smallest gaps to fit a bound, never keeping fewer",
          "[core][kv_tokens]") {
  std::vector<kvrelay::TokenRun> runs;
  for (std::uint32_t i = 0; i < 100; ++i)
    runs.push_back({i * 10, i % 3 == 0 ? 9U : 5U});  // gaps of 1 and of 5 positions
  const auto kept_before = kvrelay::run_tokens(runs);
  auto coarse = runs;
  kvrelay::coarsen_token_runs(coarse, 40);
  CHECK(coarse.size() <= 40);
  CHECK(kvrelay::check_token_runs(coarse, 1000));
  CHECK(kvrelay::run_tokens(coarse) >= kept_before);
  // Every position kept before is still kept.
  for (const auto& run : runs) {
    const bool covered = std::any_of(coarse.begin(), coarse.end(), [&](const kvrelay::TokenRun& c) {
      return c.start <= run.start && run.start + run.length <= c.start + c.length;
    });
    CHECK(covered);
  }
  auto fits = runs;
  kvrelay::coarsen_token_runs(fits, 100);
  CHECK(fits == runs);  // already within the bound: untouched
  kvrelay::coarsen_token_runs(fits, 1);
  CHECK(fits == std::vector<kvrelay::TokenRun>{{0, 999}});
}
