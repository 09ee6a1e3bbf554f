// fp8 KV (an engine's fp8 kv_cache_dtype) moves as tagged bytes: the lossless codecs carry it bit
// for bit, every lossy codec refuses it with kUnsupported naming the dtype, never converting it.
#include <xxhash.h>

#include <catch2/catch.hpp>

#include <cstring>
#include <string>
#include <vector>

#include "kvrelay/codec_plugins/builtin_codecs.h"
#include "kvrelay/codec_plugins/byte_planes.h"
#include "kvrelay/codec_plugins/device_codecs.h"
#include "kvrelay/codec_plugins/frame.h"
#include "kvrelay/codec_plugins/metrics.h"
#include "kvrelay/codec_plugins/registry.h"

#if defined(KVRELAY_HAVE_CUDA)
#include "kvrelay/codec_plugins/cuda_codecs.h"
#endif

using namespace kvrelay;
using namespace kvrelay::codec;

namespace {

// Every byte value, fp8 NaN patterns included, in an order that differs per seed.
std::vector<std::uint8_t> fp8_test_bytes(const KvLayout& layout, unsigned seed) {
  std::vector<std::uint8_t> bytes(static_cast<std::size_t>(layout.total_bytes().value()));
  for (std::size_t i = 0; i < bytes.size(); ++i)
    bytes[i] = static_cast<std::uint8_t>(i * 37 + seed * 11 + (i >> 8));
  return bytes;
}

void fp8_reseal(std::vector<std::uint8_t>& frame) {
  const std::size_t body = frame.size() - kFrameTrailerSize;
  const std::uint64_t checksum = XXH3_64bits(frame.data(), body);
  std::memcpy(frame.data() + body, &checksum, 8);
}

}  // namespace

TEST_CASE("fp8 KV goes through raw and lossless frames bit for bit", "[codec][fp8]") {
  const auto registry = CodecRegistry::with_builtins();
  for (const DType dtype : {DType::kFp8E4M3, DType::kFp8E5M2}) {
    // 3 MiB: several of lossless's 1 MiB chunks and a short tail.
    const KvLayout layout{4, 8, 128, dtype, 769};
    REQUIRE(layout.total_bytes().value() == 4ULL * 2 * 769 * 8 * 128);
    const auto kv = fp8_test_bytes(layout, static_cast<unsigned>(dtype));
    for (const char* name : {"raw", "lossless"}) {
      for (const bool zstd_stage : {false, true}) {
        INFO(dtype_name(dtype) << " " << name << (zstd_stage ? "+zstd" : ""));
        EncodeOptions options;
        options.zstd_stage = zstd_stage;
        const auto frame = encode_frame(*registry.find(name), layout, kv, options);
        REQUIRE(frame.has_value());
        const auto header = inspect_frame(frame.value());
        REQUIRE(header.has_value());
        CHECK(header.value().layout == layout);
        const auto decoded = decode_frame(registry, frame.value(), std::uint64_t{1} << 30);
        REQUIRE(decoded.has_value());
        CHECK(decoded.value() == kv);
      }
    }
  }
}

TEST_CASE("every lossy codec refuses fp8 KV with unsupported, naming the dtype", "[codec][fp8]") {
  const auto registry = CodecRegistry::with_builtins();
  for (const DType dtype : {DType::kFp8E4M3, DType::kFp8E5M2}) {
    const KvLayout layout{2, 2, 64, dtype, 300};
    const auto kv = fp8_test_bytes(layout, 3);
    for (const char* name : {"fp8", "int8", "int4", "sparse"}) {
      INFO(dtype_name(dtype) << " through " << name);
      const Codec* codec = registry.find(name);
      REQUIRE(codec != nullptr);
      const auto frame = encode_frame(*codec, layout, kv);
      REQUIRE_FALSE(frame.has_value());
      CHECK(frame.error().code == ErrorCode::kUnsupported);
      CHECK(frame.error().message.find(std::string(dtype_name(dtype))) != std::string::npos);
      CHECK(frame.error().message.find(name) != std::string::npos);

      // The plugin entry points themselves refuse it too (a caller that skips the frame layer).
      const kvrelay_codec_layout c_layout{layout.layers, layout.kv_heads, layout.head_dim,
                                          static_cast<std::uint32_t>(dtype), layout.tokens};
      const auto& plugin = codec->plugin();
      const auto& params = codec->default_params();
      CHECK(plugin.max_encoded_size(&c_layout, params.data(), params.size()) == 0);
      std::vector<std::uint8_t> out(kv.size() * 2 + 4096);
      std::size_t written = 0;
      CHECK(plugin.encode(&c_layout, params.data(), params.size(), kv.data(), kv.size(), out.data(), out.size(),
                          &written) == KVRELAY_CODEC_E_UNSUPPORTED);
      std::vector<std::uint8_t> decoded(kv.size());
      CHECK(plugin.decode(&c_layout, params.data(), params.size(), out.data(), out.size(), decoded.data(),
                          decoded.size()) == KVRELAY_CODEC_E_UNSUPPORTED);
    }
  }
}

TEST_CASE("a lossy frame relabelled as fp8 is refused before its codec runs", "[codec][fp8]") {
  const auto registry = CodecRegistry::with_builtins();
  const KvLayout layout{1, 2, 64, DType::kBFloat16, 200};
  const auto kv = synthetic_kv(layout, 9).value();
  auto frame = encode_frame(*registry.find("int8"), layout, kv).value();
  frame[7] = static_cast<std::uint8_t>(DType::kFp8E4M3);  // the dtype byte (docs/wire-format.md)
  fp8_reseal(frame);
  const auto header = inspect_frame(frame);
  REQUIRE(header.has_value());
  const auto decoded = decode_frame(registry, frame, std::uint64_t{1} << 30);
  REQUIRE_FALSE(decoded.has_value());
  CHECK(decoded.error().code == ErrorCode::kUnsupported);
  CHECK(decoded.error().message.find("fp8_e4m3") != std::string::npos);
}

TEST_CASE("byte planes of 1-byte elements are the elements", "[codec][fp8]") {
  std::vector<std::uint8_t> source(1000);
  for (std::size_t i = 0; i < source.size(); ++i)
    source[i] = static_cast<std::uint8_t>(i * 7);
  std::vector<std::uint8_t> planes(source.size(), 0);
  split_byte_planes(source.data(), source.size(), 1, planes.data());
  CHECK(planes == source);
  std::vector<std::uint8_t> merged(source.size(), 0);
  merge_byte_planes(planes.data(), planes.size(), 1, merged.data());
  CHECK(merged == source);
}

TEST_CASE("synthetic fp8 KV and the fidelity metrics read fp8 elements", "[codec][fp8]") {
  const KvLayout layout{2, 2, 16, DType::kFp8E4M3, 64};
  const auto kv = synthetic_kv(layout, 4);
  REQUIRE(kv.has_value());
  CHECK(kv.value().size() == layout.total_bytes().value());
  // Values near N(0, 1), outlier channels up to 12 + 6: every element finite and most non-zero.
  std::size_t zeros = 0;
  for (const std::uint8_t byte : kv.value()) {
    CHECK((byte & 0x7FU) != 0x7FU);  // never e4m3fn's NaN
    zeros += (byte & 0x7FU) == 0 ? 1U : 0U;
  }
  CHECK(zeros < kv.value().size() / 10);
  const auto queries = sample_queries(layout, kv.value(), 2, 4, 1);
  REQUIRE(queries.has_value());
  const auto report = compare_kv(layout, kv.value(), kv.value(), queries.value());
  REQUIRE(report.has_value());
  CHECK(report.value().attn_rel_err == 0.0);
  CHECK(report.value().keys.rel_l2 == 0.0);
}

#if defined(KVRELAY_HAVE_CUDA)
TEST_CASE("the CUDA quantizers refuse fp8 KV before touching a device", "[codec][fp8]") {
  for (const auto quantizer : {cuda::Quantizer::kFp8, cuda::Quantizer::kInt8, cuda::Quantizer::kInt4}) {
    const KvLayout layout{2, 2, 64, DType::kFp8E5M2, 300};
    const auto size = cuda::quant_payload_size(quantizer, layout, BuiltinParams{});
    REQUIRE_FALSE(size.has_value());
    CHECK(size.error().code == ErrorCode::kUnsupported);
    CHECK(size.error().message.find("fp8_e5m2") != std::string::npos);
    // Through the plugin ABI of the staged GPU codecs too: a code, not a crash or a conversion.
    const auto implementation = cuda_implementation(quantizer == cuda::Quantizer::kFp8    ? kFp8CodecId
                                                    : quantizer == cuda::Quantizer::kInt8 ? kInt8CodecId
                                                                                          : kInt4CodecId);
    if (!implementation) continue;  // no GPU here: the host-side refusal above is what runs
    const kvrelay_codec_layout c_layout{2, 2, 64, KVRELAY_CODEC_DTYPE_FP8_E5M2, 300};
    const auto params = BuiltinParams{}.serialize();
    std::vector<std::uint8_t> kv(static_cast<std::size_t>(layout.total_bytes().value()));
    std::vector<std::uint8_t> out(kv.size() * 2);
    std::size_t written = 0;
    CHECK(implementation.value()->encode(&c_layout, params.data(), params.size(), kv.data(), kv.size(), out.data(),
                                         out.size(), &written) == KVRELAY_CODEC_E_UNSUPPORTED);
  }
}
#endif
