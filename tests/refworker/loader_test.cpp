// The loader treats checkpoints as untrusted input: every malformed file is a clear error.

#include <catch2/catch.hpp>
#include <xxhash.h>

#include <cmath>
#include <cstring>
#include <limits>

#include "kvrelay/refworker/model.h"
#include "skip.h"
#include "support/test_paths.h"

namespace kr = kvrelay::refworker;
using kvrelay::ErrorCode;

namespace {

kvrelay::Error load_error(const std::filesystem::path& path) {
  auto model = kr::load_llama2c(path);
  REQUIRE_FALSE(model);
  INFO(model.error().message);
  CHECK_FALSE(model.error().message.empty());
  return model.error();
}

std::string with_header_field(std::string bytes, std::size_t field, std::int32_t value) {
  std::memcpy(bytes.data() + field * 4, &value, 4);
  return bytes;
}

}  // namespace

TEST_CASE("refworker loader: identity is the xxh3 of the checkpoint bytes", "[refworker][loader]") {
  const auto path = kvrelay::test::stories_model_path();
  if (!path) KVRELAY_SKIP("stories260K.bin not found");
  const std::string bytes = kvrelay::test::read_file(*path);
  auto model = kr::load_llama2c(*path);
  REQUIRE(model);
  char expected[17];
  std::snprintf(expected, sizeof expected, "%016llx",
                static_cast<unsigned long long>(XXH3_64bits(bytes.data(), bytes.size())));
  CHECK(model.value().fingerprint().weights_identity == expected);
  CHECK(model.value().config().shape_string() == "layers=5,dim=64,heads=8,kv_heads=4,ffn=172,vocab=512,seq_len=512");
  CHECK(model.value().config().shared_classifier);
}

TEST_CASE("refworker loader: truncated, padded and corrupt checkpoints are rejected", "[refworker][loader]") {
  const auto path = kvrelay::test::stories_model_path();
  if (!path) KVRELAY_SKIP("stories260K.bin not found");
  const std::string good = kvrelay::test::read_file(*path);
  kvrelay::test::TempDir dir;
  const auto file = dir / "model.bin";

  SECTION("missing file") { CHECK(load_error(dir / "absent.bin").code == ErrorCode::kIo); }
  SECTION("empty file") {
    kvrelay::test::write_file(file, "");
    CHECK(load_error(file).code == ErrorCode::kTruncated);
  }
  SECTION("partial header") {
    kvrelay::test::write_file(file, good.substr(0, 20));
    CHECK(load_error(file).code == ErrorCode::kTruncated);
  }
  SECTION("header only") {
    kvrelay::test::write_file(file, good.substr(0, 28));
    CHECK(load_error(file).code == ErrorCode::kTruncated);
  }
  SECTION("one float short") {
    kvrelay::test::write_file(file, good.substr(0, good.size() - 4));
    const auto error = load_error(file);
    CHECK(error.code == ErrorCode::kTruncated);
    CHECK(error.message.find("truncated") != std::string::npos);
  }
  SECTION("trailing bytes") {
    kvrelay::test::write_file(file, good + "xx");
    CHECK(load_error(file).code == ErrorCode::kCorrupt);
  }
  SECTION("negative dim") {
    kvrelay::test::write_file(file, with_header_field(good, 0, -64));
    CHECK(load_error(file).code == ErrorCode::kCorrupt);
  }
  SECTION("zero layers") {
    kvrelay::test::write_file(file, with_header_field(good, 2, 0));
    CHECK(load_error(file).code == ErrorCode::kCorrupt);
  }
  SECTION("absurd dim") {
    kvrelay::test::write_file(file, with_header_field(good, 0, std::numeric_limits<std::int32_t>::max()));
    CHECK(load_error(file).code == ErrorCode::kCorrupt);
  }
  SECTION("kv_heads do not divide heads") {
    kvrelay::test::write_file(file, with_header_field(good, 4, 3));
    CHECK(load_error(file).code == ErrorCode::kCorrupt);
  }
  SECTION("huge but in-bounds shape: size mismatch, no allocation") {
    std::string header = with_header_field(good.substr(0, 28), 0, 65536);
    header = with_header_field(header, 1, 262144);
    header = with_header_field(header, 2, 1024);
    header = with_header_field(header, 3, 1024);
    header = with_header_field(header, 4, 1024);
    kvrelay::test::write_file(file, header + good.substr(28));
    CHECK(load_error(file).code == ErrorCode::kTruncated);
  }
  SECTION("most negative vocab") {
    kvrelay::test::write_file(file, with_header_field(good, 5, std::numeric_limits<std::int32_t>::min()));
    CHECK(load_error(file).code == ErrorCode::kCorrupt);
  }
  SECTION("a NaN weight") {
    std::string bad = good;
    const float nan = std::numeric_limits<float>::quiet_NaN();
    std::memcpy(bad.data() + 28 + 4 * 1000, &nan, 4);
    kvrelay::test::write_file(file, bad);
    CHECK(load_error(file).code == ErrorCode::kCorrupt);
  }
  SECTION("negative vocab means a separate classifier, which this file lacks") {
    kvrelay::test::write_file(file, with_header_field(good, 5, -512));
    CHECK(load_error(file).code == ErrorCode::kTruncated);
  }
}
