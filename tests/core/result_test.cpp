#include "kvrelay/core/result.h"

#include <catch2/catch.hpp>

#include <set>
#include <string_view>

using kvrelay::ErrorCode;
using kvrelay::Result;

namespace {

Result<int> parse_positive(int value) {
  if (value <= 0) return kvrelay::fail(ErrorCode::kInvalidArgument, "must be positive");
  return value;
}

Result<int> doubled(int value) {
  KVRELAY_TRY(auto parsed, parse_positive(value));
  return parsed * 2;
}

}  // namespace

TEST_CASE("Result carries a value or an Error, and KVRELAY_TRY propagates", "[core][result]") {
  CHECK(doubled(21).value() == 42);
  const auto failed = doubled(-1);
  REQUIRE_FALSE(failed);
  CHECK(failed.error().code == ErrorCode::kInvalidArgument);
  CHECK(failed.error().to_string() == "invalid_argument: must be positive");
}

TEST_CASE("every error code has a distinct stable name", "[core][result]") {
  std::set<std::string_view> names;
  for (int code = 0; code <= static_cast<int>(ErrorCode::kInternal); ++code) {
    const auto name = kvrelay::error_code_name(static_cast<ErrorCode>(code));
    CHECK(name != "unknown_error");
    CHECK(names.insert(name).second);
  }
  CHECK(kvrelay::error_code_name(ErrorCode::kChecksumMismatch) == "checksum_mismatch");
}
