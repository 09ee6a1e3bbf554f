#include <catch2/catch.hpp>

#include <filesystem>
#include <map>
#include <vector>

#include "kvrelay/codec_plugins/builtin_codecs.h"
#include "kvrelay/codec_plugins/frame.h"
#include "kvrelay/codec_plugins/metrics.h"
#include "kvrelay/codec_plugins/registry.h"

using namespace kvrelay;
using namespace kvrelay::codec;

namespace {
const std::filesystem::path kPlugins = KVRELAY_TEST_PLUGIN_DIR;
}

TEST_CASE("built-in codecs register through the C struct", "[codec][plugin]") {
  const auto registry = CodecRegistry::with_builtins();
  std::vector<std::string> names;
  for (const auto& codec : registry.codecs()) {
    names.emplace_back(codec->name());
    CHECK(codec->origin() == "built-in");
    CHECK(codec->plugin().abi_version == KVRELAY_CODEC_ABI_VERSION);
  }
  CHECK(names == std::vector<std::string>{"raw", "lossless", "fp8", "int8", "int4", "sparse"});
  CHECK(registry.find("lossless")->lossless());
  CHECK_FALSE(registry.find("int4")->lossless());
  CHECK(registry.find(std::uint32_t{kInt8CodecId})->name() == "int8");
}

TEST_CASE("an out-of-tree plugin built against the header alone loads and round-trips", "[codec][plugin]") {
  auto registry = CodecRegistry::with_builtins();
  const auto failures = registry.load_directory(kPlugins / "good");
  REQUIRE(failures.empty());
  const Codec* xor_codec = registry.find("xor");
  REQUIRE(xor_codec != nullptr);
  CHECK(xor_codec->id() == 300);
  CHECK(xor_codec->lossless());
  CHECK(xor_codec->origin().find("xor_plugin.so") != std::string::npos);

  const KvLayout layout{2, 2, 4, DType::kFloat16, 5};
  const auto kv = synthetic_kv(layout, 1).value();
  const auto frame = encode_frame(*xor_codec, layout, kv).value();
  // The payload really is the plugin's transformation, not a copy.
  CHECK(frame[kFrameHeaderSize + 1] == (kv[0] ^ 0x5A));
  std::vector<std::uint8_t> decoded(kv.size());
  REQUIRE(decode_frame(registry, frame, decoded));
  CHECK(decoded == kv);
}

TEST_CASE("the loader refuses bad plugins with distinct errors and keeps going", "[codec][plugin]") {
  auto registry = CodecRegistry::with_builtins();
  const std::size_t before = registry.codecs().size();
  const auto failures = registry.load_directory(kPlugins / "bad");
  CHECK(registry.codecs().size() == before);
  REQUIRE(failures.size() == 4);
  std::map<std::string, ErrorCode> codes;
  for (const auto& failure : failures) codes[failure.path.filename().string()] = failure.error.code;
  CHECK(codes.at("bad_version_plugin.so") == ErrorCode::kBadVersion);
  CHECK(codes.at("bad_size_plugin.so") == ErrorCode::kLayoutMismatch);
  CHECK(codes.at("no_entry_plugin.so") == ErrorCode::kNotFound);
  CHECK(codes.at("builtin_id_plugin.so") == ErrorCode::kInvalidArgument);

  auto duplicate = registry.load_directory(kPlugins / "dup");
  REQUIRE(duplicate.size() == 1);
  CHECK(duplicate[0].error.code == ErrorCode::kAlreadyExists);
  CHECK(registry.find("lossless")->origin() == "built-in");

  auto missing = registry.load_file(kPlugins / "does_not_exist.so");
  REQUIRE_FALSE(missing);
  CHECK(missing.error().code == ErrorCode::kIo);
  CHECK(missing.error().message.find("dlopen") != std::string::npos);

  auto not_a_directory = registry.load_directory(kPlugins / "nowhere");
  CHECK(not_a_directory.size() == 1);
}

TEST_CASE("loading the same plugin twice is refused as a duplicate", "[codec][plugin]") {
  auto registry = CodecRegistry::with_builtins();
  REQUIRE(registry.load_file(kPlugins / "good" / "xor_plugin.so"));
  auto again = registry.load_file(kPlugins / "good" / "xor_plugin.so");
  REQUIRE_FALSE(again);
  CHECK(again.error().code == ErrorCode::kAlreadyExists);
}

TEST_CASE("codec specs resolve the zstd stage suffix", "[codec][plugin]") {
  const auto registry = CodecRegistry::with_builtins();
  auto spec = resolve_codec(registry, "int4+zstd");
  REQUIRE(spec);
  CHECK(spec.value().codec->name() == "int4");
  CHECK(spec.value().zstd_stage);
  CHECK_FALSE(resolve_codec(registry, "int4").value().zstd_stage);
  CHECK(resolve_codec(registry, "nope").error().code == ErrorCode::kUnknownCodec);
  CHECK(resolve_codec(registry, "+zstd").error().code == ErrorCode::kUnknownCodec);
}
