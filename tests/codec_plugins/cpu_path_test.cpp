#include "kvrelay/codec_plugins/cpu_path.h"

#include <xxhash.h>

#include <catch2/catch.hpp>

#include <random>
#include <string>
#include <vector>

#include "kvrelay/codec_plugins/builtin_codecs.h"
#include "kvrelay/codec_plugins/builtin_params.h"
#include "kvrelay/codec_plugins/metrics.h"

#include "support/skip.h"

using namespace kvrelay;
using namespace kvrelay::codec;

namespace {

const kvrelay_codec_plugin* quantizer(int index) {
  return index == 0 ? fp8_codec() : index == 1 ? int8_codec() : int4_codec();
}

kvrelay_codec_layout to_c(const KvLayout& layout) {
  return {layout.layers, layout.kv_heads, layout.head_dim, static_cast<std::uint32_t>(layout.dtype), layout.tokens};
}

std::vector<std::uint8_t> encode_payload(const kvrelay_codec_plugin& codec, const KvLayout& layout,
                                         const std::vector<std::uint8_t>& kv, const std::vector<std::uint8_t>& params) {
  const kvrelay_codec_layout c_layout = to_c(layout);
  std::vector<std::uint8_t> out(codec.max_encoded_size(&c_layout, params.data(), params.size()));
  std::size_t size = 0;
  REQUIRE(codec.encode(&c_layout, params.data(), params.size(), kv.data(), kv.size(), out.data(), out.size(), &size) ==
          KVRELAY_CODEC_OK);
  out.resize(size);
  return out;
}

std::vector<std::uint8_t> decode_payload(const kvrelay_codec_plugin& codec, const KvLayout& layout,
                                         const std::vector<std::uint8_t>& payload,
                                         const std::vector<std::uint8_t>& params, std::size_t size) {
  const kvrelay_codec_layout c_layout = to_c(layout);
  std::vector<std::uint8_t> out(size, 0xEE);
  REQUIRE(codec.decode(&c_layout, params.data(), params.size(), payload.data(), payload.size(), out.data(),
                       out.size()) == KVRELAY_CODEC_OK);
  return out;
}

std::vector<std::uint8_t> group_params(std::uint32_t group) {
  BuiltinParams params;
  params.group_size = group;
  params.recent_tokens = 16;
  const auto wire = params.serialize();
  return {wire.begin(), wire.end()};
}

// The vector builds this CPU runs, to compare with the portable one.
std::vector<CpuPath> supported_vector_paths() {
  std::vector<CpuPath> paths;
  for (CpuPath path : {CpuPath::kAvx2, CpuPath::kAvx512}) {
    if (cpu_path_supported(path)) paths.push_back(path);
  }
  return paths;
}

// Restores the fastest path when a test ends, whatever it forced.
struct PathGuard {
  ~PathGuard() { reset_cpu_path(); }
};

}  // namespace

TEST_CASE("the portable, AVX2 and AVX-512 quantizer loops write the same bytes", "[codec][cpu_path]") {
  const std::vector<CpuPath> vector_paths = supported_vector_paths();
  if (vector_paths.empty()) KVRELAY_SKIP("CPU without AVX2+F16C: only the portable path exists here");
  PathGuard guard;
  // Odd shapes: one token, tokens off the group, head_dim off the lane width and the group,
  // odd rows (int4 pairs), a single head; random bytes bring NaN, infinities and subnormals.
  // For the AVX-512 loops: rows of 16 but not 32 elements (int4 keys fall back), head_dim 48
  // (groups of 32 then 16, int4 half vectors), groups of 16, and 16-element heads; rows of 400
  // and 480 elements (64-element steps and a 16- or 32-element rest, 25 value groups of 16: a
  // second, partial reduction of sixteen groups).
  const std::vector<KvLayout> shapes = {{2, 3, 8, DType::kFloat32, 1},    {1, 1, 64, DType::kFloat32, 200},
                                        {3, 2, 36, DType::kFloat32, 170}, {1, 1, 7, DType::kFloat32, 151},
                                        {1, 3, 5, DType::kFloat32, 201},  {2, 8, 128, DType::kFloat32, 190},
                                        {1, 1, 48, DType::kFloat32, 133}, {1, 3, 16, DType::kFloat32, 97},
                                        {1, 5, 80, DType::kFloat32, 77},  {1, 6, 80, DType::kFloat32, 45}};
  std::mt19937 random(11);
  int compared = 0;
  for (auto layout : shapes) {
    for (DType dtype : {DType::kFloat32, DType::kFloat16, DType::kBFloat16}) {
      layout.dtype = dtype;
      auto kv = synthetic_kv(layout, 5).value();
      std::vector<std::uint8_t> noise(kv.size());
      for (auto& byte : noise)
        byte = static_cast<std::uint8_t>(random());
      for (const auto* input : {&kv, &noise}) {
        for (int index = 0; index < 3; ++index) {
          for (std::uint32_t group : {2U, 6U, 16U, 32U, 64U}) {
            const auto& codec = *quantizer(index);
            const auto params = group_params(group);
            REQUIRE(force_cpu_path(CpuPath::kBaseline));
            const auto portable = encode_payload(codec, layout, *input, params);
            const auto portable_back = decode_payload(codec, layout, portable, params, input->size());
            for (CpuPath path : vector_paths) {
              INFO(codec.name << " group " << group << " " << layout.describe() << (input == &noise ? " noise" : "")
                              << " on " << cpu_path_name(path));
              REQUIRE(force_cpu_path(path));
              CHECK(encode_payload(codec, layout, *input, params) == portable);
              CHECK(decode_payload(codec, layout, portable, params, input->size()) == portable_back);
              ++compared;
            }
          }
        }
      }
    }
  }
  CHECK(compared == static_cast<int>(shapes.size()) * 3 * 2 * 3 * 5 * static_cast<int>(vector_paths.size()));
}

namespace {

// True when `a` and `b` are equal, or both fp16 NaNs (F16C and float_to_half quiet a NaN
// differently; decoding only yields NaN from a payload whose metadata is NaN or infinite).
bool same_or_both_half_nan(const std::vector<std::uint8_t>& a, const std::vector<std::uint8_t>& b, DType dtype) {
  if (a.size() != b.size()) return false;
  if (dtype != DType::kFloat16) return a == b;
  for (std::size_t i = 0; i + 1 < a.size(); i += 2) {
    const auto x = static_cast<std::uint16_t>(a[i] | (a[i + 1] << 8));
    const auto y = static_cast<std::uint16_t>(b[i] | (b[i + 1] << 8));
    const bool both_nan = (x & 0x7FFFU) > 0x7C00U && (y & 0x7FFFU) > 0x7C00U;
    if (x != y && !both_nan) return false;
  }
  return true;
}

}  // namespace

TEST_CASE("the portable, AVX2 and AVX-512 loops decode any payload bytes alike", "[codec][cpu_path]") {
  const std::vector<CpuPath> vector_paths = supported_vector_paths();
  if (vector_paths.empty()) KVRELAY_SKIP("CPU without AVX2+F16C: only the portable path exists here");
  PathGuard guard;
  // Random payloads: every code value, scales and zeros that are NaN, infinite or subnormal,
  // so the vector decoders' NaN-free shortcuts and their exact fallbacks both run; shapes with
  // whole vectors, nibble rows starting on odd elements and short tails.
  const std::vector<KvLayout> shapes = {{1, 2, 128, DType::kFloat32, 180}, {2, 3, 36, DType::kFloat32, 170},
                                        {1, 3, 5, DType::kFloat32, 201},   {1, 1, 7, DType::kFloat32, 151},
                                        {1, 4, 64, DType::kFloat32, 140},  {1, 1, 48, DType::kFloat32, 133},
                                        {1, 3, 16, DType::kFloat32, 97}};
  std::mt19937 random(23);
  int compared = 0;
  for (auto layout : shapes) {
    for (DType dtype : {DType::kFloat32, DType::kFloat16, DType::kBFloat16}) {
      layout.dtype = dtype;
      const std::size_t size = layout.total_bytes().value();
      for (int index = 0; index < 3; ++index) {
        for (std::uint32_t group : {6U, 16U, 32U, 64U}) {
          const auto& codec = *quantizer(index);
          const auto params = group_params(group);
          const kvrelay_codec_layout c_layout = to_c(layout);
          std::vector<std::uint8_t> payload(codec.max_encoded_size(&c_layout, params.data(), params.size()));
          for (auto& byte : payload)
            byte = static_cast<std::uint8_t>(random());
          REQUIRE(force_cpu_path(CpuPath::kBaseline));
          const auto portable = decode_payload(codec, layout, payload, params, size);
          for (CpuPath path : vector_paths) {
            INFO(codec.name << " group " << group << " " << layout.describe() << " on " << cpu_path_name(path));
            REQUIRE(force_cpu_path(path));
            CHECK(same_or_both_half_nan(decode_payload(codec, layout, payload, params, size), portable, dtype));
            ++compared;
          }
        }
      }
    }
  }
  CHECK(compared == 7 * 3 * 3 * 4 * static_cast<int>(vector_paths.size()));
}

TEST_CASE("quantizer payloads keep the bytes of the reference implementation the CUDA kernels match",
          "[codec][cpu_path]") {
  // xxh3 of payloads written by the scalar implementation that the CUDA parity test checked on
  // a GPU; both CPU paths must still produce them (the kernels are unchanged).
  struct Golden {
    const char* codec;
    DType dtype;
    std::uint64_t hash;
  };
  const Golden goldens[] = {
      {"fp8", DType::kFloat32, 0xb2670e765c258826ULL},   {"int8", DType::kFloat32, 0x7e1c8ef1d3dcd4ccULL},
      {"int4", DType::kFloat32, 0xf89be2e9fe02cb4fULL},  {"fp8", DType::kFloat16, 0x585cbb713e6a46a9ULL},
      {"int8", DType::kFloat16, 0x753ea2ba8cf2c661ULL},  {"int4", DType::kFloat16, 0xeab2dcbe05addab1ULL},
      {"fp8", DType::kBFloat16, 0x631a6eaf34fd2dc5ULL},  {"int8", DType::kBFloat16, 0xde07d0e873565a12ULL},
      {"int4", DType::kBFloat16, 0xcaa3024b9b10cb9cULL},
  };
  PathGuard guard;
  for (CpuPath path : {CpuPath::kBaseline, CpuPath::kAvx2, CpuPath::kAvx512}) {
    if (!force_cpu_path(path)) continue;
    for (const auto& golden : goldens) {
      const KvLayout layout{2, 3, 36, golden.dtype, 170};
      const auto kv = synthetic_kv(layout, 29).value();
      const std::string name = golden.codec;
      const auto& codec = *quantizer(name == "fp8" ? 0 : name == "int8" ? 1 : 2);
      const auto payload = encode_payload(codec, layout, kv, group_params(32));
      INFO(name << " " << layout.describe() << " on " << cpu_path_name(path));
      CHECK(XXH3_64bits(payload.data(), payload.size()) == golden.hash);
    }
  }
}

TEST_CASE("cpu path names parse and an unsupported path is refused", "[codec][cpu_path]") {
  CHECK(parse_cpu_path("baseline") == CpuPath::kBaseline);
  CHECK(parse_cpu_path("avx2") == CpuPath::kAvx2);
  CHECK(parse_cpu_path("avx512") == CpuPath::kAvx512);
  CHECK_FALSE(parse_cpu_path("avx10"));
  for (CpuPath path : {CpuPath::kBaseline, CpuPath::kAvx2, CpuPath::kAvx512})
    CHECK(parse_cpu_path(cpu_path_name(path)) == path);
  PathGuard guard;
  CHECK(force_cpu_path(CpuPath::kBaseline));
  CHECK(active_cpu_path() == CpuPath::kBaseline);
  // AVX-512 implies AVX2 here: a CPU (or build) without AVX2 refuses AVX-512 too.
  if (!cpu_path_supported(CpuPath::kAvx2)) CHECK_FALSE(force_cpu_path(CpuPath::kAvx512));
  reset_cpu_path();
  const CpuPath fastest = cpu_path_supported(CpuPath::kAvx512) ? CpuPath::kAvx512
                          : cpu_path_supported(CpuPath::kAvx2) ? CpuPath::kAvx2
                                                               : CpuPath::kBaseline;
  CHECK(active_cpu_path() == fastest);
}
