// Data-plane version 2 messages (Resolve, PrefillReport): round trips, and every malformed
// payload refused with an error that names the problem.
#include <catch2/catch.hpp>

#include <cstring>
#include <limits>

#include "kvrelay/shm_transport/control_protocol.h"

using namespace kvrelay;
using namespace kvrelay::shm;

TEST_CASE("resolve requests round-trip and reject malformed payloads", "[shm][protocol]") {
  ResolveRequest request;
  request.model_id = 0x1234;
  request.block_tokens = 16;
  request.prompt_tokens = 50;
  request.block_hashes = {1, 2, 3};
  request.params_json = R"({"agent":"reader","routes":["a-to-b"]})";
  const auto bytes = encode_resolve(request);
  const auto decoded = decode_resolve(bytes);
  REQUIRE(decoded);
  CHECK(decoded.value().model_id == 0x1234);
  CHECK(decoded.value().block_hashes == std::vector<std::uint64_t>{1, 2, 3});
  CHECK(decoded.value().params_json == request.params_json);

  // Every truncation is refused.
  for (std::size_t length = 0; length < bytes.size(); ++length) {
    CHECK_FALSE(decode_resolve(std::span(bytes.data(), length)));
  }
  // More blocks than the prompt holds.
  request.prompt_tokens = 47;
  const auto too_many = decode_resolve(encode_resolve(request));
  REQUIRE_FALSE(too_many);
  CHECK(too_many.error().message.find("exceed the prompt") != std::string::npos);
  // A hash count far beyond the payload.
  auto lying = encode_resolve(ResolveRequest{1, 16, 1000, {}, ""});
  const std::uint32_t huge = 1U << 30;
  std::memcpy(lying.data() + 20, &huge, sizeof(huge));
  const auto refused = decode_resolve(lying);
  REQUIRE_FALSE(refused);
  CHECK(refused.error().code == ErrorCode::kTruncated);
  // block_tokens 0 would divide by zero downstream.
  CHECK_FALSE(decode_resolve(encode_resolve(ResolveRequest{1, 0, 10, {}, ""})));
}

TEST_CASE("prefill reports round-trip and reject impossible figures", "[shm][protocol]") {
  const PrefillReport report{7, 17, 225, 0.0042, R"({"agent":"reader"})"};
  const auto decoded = decode_prefill_report(encode_prefill_report(report));
  REQUIRE(decoded);
  CHECK(decoded.value().computed_tokens == 17);
  CHECK(decoded.value().context_tokens == 225);
  CHECK(decoded.value().seconds == Approx(0.0042));
  CHECK(decoded.value().params_json == report.params_json);

  CHECK_FALSE(decode_prefill_report(encode_prefill_report({7, 300, 225, 0.1, ""})));  // computed > context
  CHECK_FALSE(decode_prefill_report(encode_prefill_report({7, 1, 2, -1.0, ""})));
  CHECK_FALSE(decode_prefill_report(encode_prefill_report({7, 1, 2, std::numeric_limits<double>::quiet_NaN(), ""})));
  auto trailing = encode_prefill_report(report);
  trailing.push_back(std::byte{0});
  CHECK_FALSE(decode_prefill_report(trailing));
}
