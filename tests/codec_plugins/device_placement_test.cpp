// Where a registry runs its codecs: an executor set on a codec runs every later encode and decode
// of it with the same frames, and place_codecs moves fp8, int8 and int4 to the GPU (the policy's
// codecs.device) or says why it cannot.
#include <catch2/catch.hpp>

#include <set>
#include <string>
#include <vector>

#include "kvrelay/codec_plugins/builtin_codecs.h"
#include "kvrelay/codec_plugins/device_codecs.h"
#include "kvrelay/codec_plugins/frame.h"
#include "kvrelay/codec_plugins/metrics.h"
#include "kvrelay/codec_plugins/registry.h"

#include "counting_int8.h"

using namespace kvrelay;
using namespace kvrelay::codec;

namespace {

// An executor whose every call fails with its own error text.
int failing_encode(const kvrelay_codec_layout*, const void*, size_t, const void*, size_t, void*, size_t, size_t*) {
  return KVRELAY_CODEC_E_INTERNAL;
}

const char* failing_error_text(int) {
  return "device lost";
}

std::set<std::string> devices_of(const CodecRegistry& registry, const std::string& device) {
  std::set<std::string> names;
  for (const auto& codec : registry.codecs()) {
    if (codec->device() == device) names.emplace(codec->name());
  }
  return names;
}

}  // namespace

TEST_CASE("a codec's executor runs its encodes and decodes and writes the frames its own code writes",
          "[codec][device]") {
  auto placed = CodecRegistry::with_builtins();
  const auto plain = CodecRegistry::with_builtins();
  const kvrelay_codec_plugin counted = test::counting_int8();
  REQUIRE(placed.set_executor(kInt8CodecId, &counted, "test-device"));
  CHECK(placed.find("int8")->device() == "test-device");
  CHECK(placed.find("int4")->device() == "cpu");
  CHECK(&placed.find("int8")->executor() == &counted);

  const KvLayout layout{2, 4, 32, DType::kBFloat16, 170};
  const auto kv = synthetic_kv(layout, 9).value();
  for (const bool zstd : {false, true}) {
    INFO("zstd stage " << zstd);
    EncodeOptions options;
    options.zstd_stage = zstd;
    test::counting_int8_calls = 0;
    const auto expected = encode_frame(*plain.find("int8"), layout, kv, options).value();
    CHECK(test::counting_int8_calls == 0);
    const auto frame = encode_frame(*placed.find("int8"), layout, kv, options).value();
    CHECK(test::counting_int8_calls == 1);
    CHECK(frame == expected);
    std::vector<std::uint8_t> mine(kv.size());
    std::vector<std::uint8_t> theirs(kv.size());
    REQUIRE(decode_frame(plain, frame, mine));
    REQUIRE(decode_frame(placed, frame, theirs));
    CHECK(test::counting_int8_calls == 2);
    CHECK(theirs == mine);
    WarmBufferPool buffers(2, 1U << 20);
    const auto view = decode_frame_view(placed, frame, kv.size(), buffers);
    REQUIRE(view);
    CHECK(test::counting_int8_calls == 3);
    CHECK(std::vector<std::uint8_t>(view.value().kv.begin(), view.value().kv.end()) == mine);
  }

  // A failing executor's error carries its own text, and the codec's name.
  kvrelay_codec_plugin failing = *int8_codec();
  failing.encode = failing_encode;
  failing.error_text = failing_error_text;
  REQUIRE(placed.set_executor(kInt8CodecId, &failing, "test-device"));
  const auto refused = encode_frame(*placed.find("int8"), layout, kv);
  REQUIRE_FALSE(refused);
  CHECK(refused.error().code == ErrorCode::kInternal);
  CHECK_THAT(refused.error().message, Catch::Contains("int8") && Catch::Contains("device lost"));
}

TEST_CASE("set_executor refuses an implementation of another codec and an unknown codec", "[codec][device]") {
  auto registry = CodecRegistry::with_builtins();
  const auto wrong = registry.set_executor(kInt8CodecId, int4_codec(), "gpu");
  REQUIRE_FALSE(wrong);
  CHECK(wrong.error().code == ErrorCode::kInvalidArgument);
  CHECK_THAT(wrong.error().message, Catch::Contains("int8"));
  CHECK_FALSE(registry.set_executor(kInt8CodecId, nullptr, "gpu"));
  const auto unknown = registry.set_executor(4242, int8_codec(), "gpu");
  REQUIRE_FALSE(unknown);
  CHECK(unknown.error().code == ErrorCode::kNotFound);
  CHECK(devices_of(registry, "cpu").size() == registry.codecs().size());
}

namespace {

// An int8 implementation whose frames differ from the CPU's in one payload byte.
int off_by_one_encode(const kvrelay_codec_layout* layout, const void* params, size_t params_size, const void* input,
                      size_t input_size, void* output, size_t capacity, size_t* written) {
  const int code = int8_codec()->encode(layout, params, params_size, input, input_size, output, capacity, written);
  if (code == KVRELAY_CODEC_OK && *written > 0) static_cast<std::uint8_t*>(output)[*written / 2] ^= 1U;
  return code;
}

}  // namespace

TEST_CASE("verify_implementation accepts an implementation that writes the CPU's frames and names one that does not",
          "[codec][device]") {
  const auto registry = CodecRegistry::with_builtins();
  const Codec& int8 = *registry.find("int8");
  const kvrelay_codec_plugin counted = test::counting_int8();
  test::counting_int8_calls = 0;
  REQUIRE(verify_implementation(int8, counted, registry));
  CHECK(test::counting_int8_calls == 2);  // one encode, one decode

  kvrelay_codec_plugin differs = *int8_codec();
  differs.encode = off_by_one_encode;
  const auto wrong_bytes = verify_implementation(int8, differs, registry);
  REQUIRE_FALSE(wrong_bytes);
  CHECK_THAT(wrong_bytes.error().message, Catch::Contains("int8") && Catch::Contains("differs"));

  kvrelay_codec_plugin failing = *int8_codec();
  failing.encode = failing_encode;
  failing.error_text = failing_error_text;
  const auto broken = verify_implementation(int8, failing, registry);
  REQUIRE_FALSE(broken);
  CHECK_THAT(broken.error().message, Catch::Contains("self-check") && Catch::Contains("device lost"));
}

TEST_CASE("place_codecs puts fp8, int8 and int4 on the GPU when asked and able, and says why not", "[codec][device]") {
  const bool have_gpu = cuda_implementation(kInt8CodecId).has_value();
  const std::set<std::string> gpu_codecs{"fp8", "int8", "int4"};
  {
    auto registry = CodecRegistry::with_builtins();
    const auto cpu = place_codecs(registry, "cpu");
    REQUIRE(cpu);
    CHECK(cpu.value().on_gpu.empty());
    CHECK(devices_of(registry, "cpu").size() == registry.codecs().size());
  }
  {
    auto registry = CodecRegistry::with_builtins();
    const auto bogus = place_codecs(registry, "tpu");
    REQUIRE_FALSE(bogus);
    CHECK(bogus.error().code == ErrorCode::kInvalidArgument);
    CHECK_THAT(bogus.error().message, Catch::Contains("tpu"));
  }
  for (const char* device : {"cuda", "auto"}) {
    INFO("device " << device);
    auto registry = CodecRegistry::with_builtins();
    const auto placed = place_codecs(registry, device);
    if (have_gpu) {
      REQUIRE(placed);
      CHECK(std::set<std::string>(placed.value().on_gpu.begin(), placed.value().on_gpu.end()) == gpu_codecs);
      CHECK(devices_of(registry, "cuda") == gpu_codecs);
      // The GPU's frames are the CPU's, byte for byte.
      const KvLayout layout{2, 2, 64, DType::kFloat16, 300};
      const auto kv = synthetic_kv(layout, 5).value();
      const auto cpu_registry = CodecRegistry::with_builtins();
      for (const auto& name : gpu_codecs) {
        INFO(name);
        CHECK(encode_frame(*registry.find(name), layout, kv).value() ==
              encode_frame(*cpu_registry.find(name), layout, kv).value());
      }
    } else if (std::string(device) == "cuda") {
      REQUIRE_FALSE(placed);
      CHECK(placed.error().code == ErrorCode::kUnsupported);
      CHECK_THAT(placed.error().message, Catch::Contains("cuda"));
      CHECK(devices_of(registry, "cpu").size() == registry.codecs().size());  // nothing half moved
    } else {
      REQUIRE(placed);
      CHECK(placed.value().on_gpu.empty());
      CHECK_FALSE(placed.value().cpu_reason.empty());
      CHECK(devices_of(registry, "cpu").size() == registry.codecs().size());
    }
  }
}
