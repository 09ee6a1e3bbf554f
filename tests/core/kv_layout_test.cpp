#include "kvrelay/core/kv_layout.h"

#include <catch2/catch.hpp>

#include <cstdint>
#include <limits>

using kvrelay::DType;
using kvrelay::ErrorCode;
using kvrelay::KvLayout;

TEST_CASE("KvLayout sizes for the trained stories260K shape", "[core][layout]") {
  const KvLayout layout{5, 4, 8, DType::kFloat32, 300};
  REQUIRE(layout.validate());
  CHECK(layout.elements_per_token_row().value() == 32);
  CHECK(layout.bytes_per_token().value() == 1280);  // 5 layers x 2 x 4 heads x 8 dims x 4 bytes
  CHECK(layout.tensor_bytes().value() == 300ULL * 32 * 4);
  CHECK(layout.total_bytes().value() == 300ULL * 1280);
  CHECK(layout.tensor_offset(0, false).value() == 0);
  CHECK(layout.tensor_offset(0, true).value() == 300ULL * 32 * 4);
  CHECK(layout.tensor_offset(4, true).value() == 9ULL * 300 * 32 * 4);
  CHECK(layout.tensor_offset(5, false).error().code == ErrorCode::kOutOfRange);
}

TEST_CASE("KvLayout 16-bit dtypes halve the bytes", "[core][layout]") {
  for (const auto dtype : {DType::kFloat16, DType::kBFloat16}) {
    const KvLayout layout{32, 8, 128, dtype, 4096};
    CHECK(layout.total_bytes().value() == 32ULL * 2 * 8 * 128 * 2 * 4096);
  }
}

TEST_CASE("KvLayout with zero tokens is valid and empty", "[core][layout]") {
  const KvLayout layout{2, 2, 2, DType::kFloat16, 0};
  REQUIRE(layout.validate());
  CHECK(layout.total_bytes().value() == 0);
}

TEST_CASE("KvLayout rejects structural fields out of range", "[core][layout]") {
  CHECK(KvLayout{0, 4, 8, DType::kFloat32, 1}.validate().error().code == ErrorCode::kInvalidArgument);
  CHECK(KvLayout{4, 0, 8, DType::kFloat32, 1}.validate().error().code == ErrorCode::kInvalidArgument);
  CHECK(KvLayout{4, 4, 0, DType::kFloat32, 1}.validate().error().code == ErrorCode::kInvalidArgument);
  CHECK(KvLayout{KvLayout::kMaxLayers + 1, 4, 8, DType::kFloat32, 1}.validate().error().message.find("layers") !=
        std::string::npos);
  CHECK(KvLayout{4, 4, 8, static_cast<DType>(9), 1}.validate().error().message.find("dtype") != std::string::npos);
}

TEST_CASE("KvLayout size arithmetic rejects overflow instead of wrapping", "[core][layout]") {
  const auto huge_tokens = std::numeric_limits<std::uint64_t>::max() / 16;
  const KvLayout layout{KvLayout::kMaxLayers, KvLayout::kMaxKvHeads, KvLayout::kMaxHeadDim, DType::kFloat32,
                        huge_tokens};
  const auto total = layout.total_bytes();
  REQUIRE_FALSE(total);
  CHECK(total.error().code == ErrorCode::kOverflow);
  CHECK_FALSE(layout.tensor_bytes());
  // Per-token size stays well-defined: it does not depend on the token count.
  CHECK(layout.bytes_per_token().value() == 1024ULL * 1024 * 4096 * 4 * 2);
}

TEST_CASE("checked arithmetic", "[core][layout]") {
  CHECK(kvrelay::checked_mul(1ULL << 32, 1ULL << 31).value() == 1ULL << 63);
  CHECK(kvrelay::checked_mul(1ULL << 32, 1ULL << 32).error().code == ErrorCode::kOverflow);
  CHECK(kvrelay::checked_add(std::numeric_limits<std::uint64_t>::max(), 1).error().code == ErrorCode::kOverflow);
  CHECK(kvrelay::checked_add(40, 2).value() == 42);
}
