// The CUDA kernels against the CPU codecs, byte for byte. Exits 77 (ctest: skipped) when the
// build has no CUDA or the machine has no device.

#include <cstdio>
#include <cstring>
#include <string>
#include <vector>

#include "kvrelay/codec_plugins/builtin_codecs.h"
#include "kvrelay/codec_plugins/builtin_params.h"
#include "kvrelay/codec_plugins/byte_planes.h"
#include "kvrelay/codec_plugins/metrics.h"

#if defined(KVRELAY_HAVE_CUDA)
#include <cuda_runtime.h>

#include "kvrelay/codec_plugins/cuda_codecs.h"
#endif

using namespace kvrelay;
using namespace kvrelay::codec;

#if defined(KVRELAY_HAVE_CUDA)
namespace {

int failures = 0;

void expect(bool condition, const char* what, const KvLayout& layout, const std::string& detail = {}) {
  if (condition) return;
  ++failures;
  std::fprintf(stderr, "FAILED: %s for %s%s\n", what, layout.describe().c_str(), detail.c_str());
}

// Where two outputs first differ, for the failure message.
std::string first_difference(const char* codec, std::uint32_t group, bool specials,
                             const std::vector<std::uint8_t>& gpu, const std::vector<std::uint8_t>& cpu) {
  std::size_t at = 0;
  while (at < gpu.size() && at < cpu.size() && gpu[at] == cpu[at])
    ++at;
  std::size_t count = 0;
  for (std::size_t i = at; i < gpu.size() && i < cpu.size(); ++i)
    count += gpu[i] != cpu[i];
  char text[200];
  std::snprintf(text, sizeof text, " (%s group %u%s: %zu bytes differ, first at %zu of %zu: gpu %02x cpu %02x)", codec,
                group, specials ? " special values" : "", count, at, cpu.size(), at < gpu.size() ? gpu[at] : 0,
                at < cpu.size() ? cpu[at] : 0);
  return text;
}

struct DeviceBytes {
  void* pointer = nullptr;
  explicit DeviceBytes(std::size_t size) { cudaMalloc(&pointer, size == 0 ? 1 : size); }
  ~DeviceBytes() { cudaFree(pointer); }
};

// NaN of both signs, infinities, -0, the smallest subnormal and the largest finite value of the
// dtype, scattered over the KV: the GPU's hardware conversions must treat them as the CPU does.
// One head of the middle token holds only the smallest subnormals (fp8 then scales it by 1).
void plant_special_values(std::vector<std::uint8_t>& kv, const KvLayout& layout) {
  const DType dtype = layout.dtype;
  static constexpr std::uint32_t kFloat32[] = {0x7FC00000, 0xFFC00001, 0x7F800000, 0xFF800000,
                                               0x80000000, 0x00000001, 0x7F7FFFFF, 0xFF7FFFFF};
  static constexpr std::uint32_t kFloat16[] = {0x7E00, 0xFE01, 0x7C00, 0xFC00, 0x8000, 0x0001, 0x7BFF, 0xFBFF};
  static constexpr std::uint32_t kBFloat16[] = {0x7FC0, 0xFFC1, 0x7F80, 0xFF80, 0x8000, 0x0001, 0x7F7F, 0xFF7F};
  const std::uint32_t* patterns = dtype == DType::kFloat32 ? kFloat32 : dtype == DType::kFloat16 ? kFloat16 : kBFloat16;
  const std::size_t size = dtype_size(dtype);
  const std::size_t elements = kv.size() / size;
  for (std::size_t i = 0; i < 96 && i < elements; ++i) {
    const std::uint32_t bits = patterns[i % 8];
    std::memcpy(kv.data() + ((i * 7919) % elements) * size, &bits, size);  // little-endian low bytes
  }
  const std::size_t tiny_head = (layout.tokens / 2) * layout.kv_heads * layout.head_dim;
  for (std::size_t i = 0; i < layout.head_dim; ++i) {
    const std::uint32_t bits = i % 2 == 0 ? 1U : (dtype == DType::kFloat32 ? 0x80000001U : 0x8001U);
    std::memcpy(kv.data() + (tiny_head + i) * size, &bits, size);
  }
}

void check_quantizer(cuda::Quantizer quantizer, const kvrelay_codec_plugin* cpu, const KvLayout& layout,
                     std::uint32_t group, std::uint32_t sink = 4, std::uint32_t recent = 16, bool specials = false) {
  BuiltinParams params;
  params.group_size = group;
  params.sink_tokens = sink;
  params.recent_tokens = recent;
  const auto wire = params.serialize();
  auto kv = synthetic_kv(layout, 99).value();
  if (specials) plant_special_values(kv, layout);
  const kvrelay_codec_layout c_layout{layout.layers, layout.kv_heads, layout.head_dim,
                                      static_cast<std::uint32_t>(layout.dtype), layout.tokens};
  std::vector<std::uint8_t> cpu_payload(cpu->max_encoded_size(&c_layout, wire.data(), wire.size()));
  std::size_t written = 0;
  expect(cpu->encode(&c_layout, wire.data(), wire.size(), kv.data(), kv.size(), cpu_payload.data(), cpu_payload.size(),
                     &written) == 0,
         "cpu encode", layout);
  const std::size_t size = cuda::quant_payload_size(quantizer, layout, params).value();
  expect(size == written, "payload size", layout);
  DeviceBytes device_kv(kv.size());
  DeviceBytes device_payload(size);
  cudaMemcpy(device_kv.pointer, kv.data(), kv.size(), cudaMemcpyHostToDevice);
  expect(bool(cuda::quant_encode(quantizer, layout, params, device_kv.pointer, device_payload.pointer)), "gpu encode",
         layout);
  std::vector<std::uint8_t> gpu_payload(size);
  cudaMemcpy(gpu_payload.data(), device_payload.pointer, size, cudaMemcpyDeviceToHost);
  cpu_payload.resize(written);
  expect(gpu_payload == cpu_payload, "encoded bytes equal", layout,
         first_difference(cpu->name, group, specials, gpu_payload, cpu_payload));

  std::vector<std::uint8_t> cpu_decoded(kv.size());
  expect(cpu->decode(&c_layout, wire.data(), wire.size(), cpu_payload.data(), written, cpu_decoded.data(),
                     cpu_decoded.size()) == 0,
         "cpu decode", layout);
  cudaMemset(device_kv.pointer, 0, kv.size());
  expect(bool(cuda::quant_decode(quantizer, layout, params, device_payload.pointer, device_kv.pointer)), "gpu decode",
         layout);
  std::vector<std::uint8_t> gpu_decoded(kv.size());
  cudaMemcpy(gpu_decoded.data(), device_kv.pointer, kv.size(), cudaMemcpyDeviceToHost);
  expect(gpu_decoded == cpu_decoded, "decoded bytes equal", layout,
         first_difference(cpu->name, group, specials, gpu_decoded, cpu_decoded));
}

// Random payload bytes (every code, NaN and infinite scales) decode alike; where both sides
// produce NaN its bits may differ (x86 keeps a NaN operand's payload, GPUs return a canonical
// NaN), so NaN matches NaN.
bool equal_or_both_nan(const std::vector<std::uint8_t>& a, const std::vector<std::uint8_t>& b, DType dtype) {
  if (a.size() != b.size()) return false;
  const std::size_t size = dtype_size(dtype);
  for (std::size_t i = 0; i < a.size(); i += size) {
    std::uint32_t x = 0;
    std::uint32_t y = 0;
    std::memcpy(&x, a.data() + i, size);
    std::memcpy(&y, b.data() + i, size);
    if (x == y) continue;
    const std::uint32_t no_sign = dtype == DType::kFloat32 ? 0x7FFFFFFFU : 0x7FFFU;
    const std::uint32_t infinity = dtype == DType::kFloat32   ? 0x7F800000U
                                   : dtype == DType::kFloat16 ? 0x7C00U
                                                              : 0x7F80U;
    if ((x & no_sign) <= infinity || (y & no_sign) <= infinity) return false;
  }
  return true;
}

void check_random_payload(cuda::Quantizer quantizer, const kvrelay_codec_plugin* cpu, const KvLayout& layout,
                          std::uint32_t group, std::uint32_t seed) {
  BuiltinParams params;
  params.group_size = group;
  params.sink_tokens = 0;
  params.recent_tokens = 0;
  const auto wire = params.serialize();
  const kvrelay_codec_layout c_layout{layout.layers, layout.kv_heads, layout.head_dim,
                                      static_cast<std::uint32_t>(layout.dtype), layout.tokens};
  const std::size_t size = cuda::quant_payload_size(quantizer, layout, params).value();
  std::vector<std::uint8_t> payload(size);
  std::uint32_t state = seed;
  for (auto& byte : payload) {
    state = state * 1664525U + 1013904223U;
    byte = static_cast<std::uint8_t>(state >> 24);
  }
  const std::size_t kv_size = layout.total_bytes().value();
  std::vector<std::uint8_t> cpu_decoded(kv_size);
  expect(cpu->decode(&c_layout, wire.data(), wire.size(), payload.data(), size, cpu_decoded.data(), kv_size) == 0,
         "cpu decode of random payload", layout);
  DeviceBytes device_payload(size);
  DeviceBytes device_kv(kv_size);
  cudaMemcpy(device_payload.pointer, payload.data(), size, cudaMemcpyHostToDevice);
  expect(bool(cuda::quant_decode(quantizer, layout, params, device_payload.pointer, device_kv.pointer)),
         "gpu decode of random payload", layout);
  std::vector<std::uint8_t> gpu_decoded(kv_size);
  cudaMemcpy(gpu_decoded.data(), device_kv.pointer, kv_size, cudaMemcpyDeviceToHost);
  expect(equal_or_both_nan(gpu_decoded, cpu_decoded, layout.dtype), "random payload decodes alike", layout,
         first_difference(cpu->name, group, false, gpu_decoded, cpu_decoded));
}

}  // namespace
#endif

int main() {
#if !defined(KVRELAY_HAVE_CUDA)
  std::puts("skipped: built without CUDA");
  return 77;
#else
  if (cuda::device_count() == 0) {
    std::puts("skipped: no CUDA device");
    return 77;
  }
  const std::vector<KvLayout> shapes = {{2, 3, 8, DType::kFloat32, 1},
                                        {1, 1, 64, DType::kFloat32, 200},
                                        {3, 2, 36, DType::kFloat32, 170},
                                        {1, 1, 7, DType::kFloat32, 151},
                                        {2, 8, 128, DType::kFloat32, 1000}};
  for (auto layout : shapes) {
    for (DType dtype : {DType::kFloat32, DType::kFloat16, DType::kBFloat16}) {
      layout.dtype = dtype;
      check_quantizer(cuda::Quantizer::kFp8, fp8_codec(), layout, 32);
      check_quantizer(cuda::Quantizer::kInt8, int8_codec(), layout, 64);
      check_quantizer(cuda::Quantizer::kInt4, int4_codec(), layout, 32);
      check_quantizer(cuda::Quantizer::kInt4, int4_codec(), layout, 64);
      const auto kv = synthetic_kv(layout, 5).value();
      const std::size_t elements = kv.size() / dtype_size(dtype);
      std::vector<std::uint8_t> cpu_planes(kv.size());
      split_byte_planes(kv.data(), elements, dtype_size(dtype), cpu_planes.data());
      DeviceBytes source(kv.size());
      DeviceBytes planes(kv.size());
      cudaMemcpy(source.pointer, kv.data(), kv.size(), cudaMemcpyHostToDevice);
      expect(bool(cuda::split_byte_planes(source.pointer, elements, dtype_size(dtype), planes.pointer)), "gpu split",
             layout);
      std::vector<std::uint8_t> gpu_planes(kv.size());
      cudaMemcpy(gpu_planes.data(), planes.pointer, kv.size(), cudaMemcpyDeviceToHost);
      expect(gpu_planes == cpu_planes, "planes equal", layout);
      cudaMemset(source.pointer, 0, kv.size());
      expect(bool(cuda::merge_byte_planes(planes.pointer, elements, dtype_size(dtype), source.pointer)), "gpu merge",
             layout);
      std::vector<std::uint8_t> merged(kv.size());
      cudaMemcpy(merged.data(), source.pointer, kv.size(), cudaMemcpyDeviceToHost);
      expect(merged == kv, "merge restores", layout);
    }
  }
  // Shapes of the vectorized kernels: a scale shared by 1 to 32 threads of a warp, value groups of
  // 8 to 256 channels, key groups read in 1 to 16 slices and in two passes (1024 tokens), no exact
  // rows, only exact rows, and a partial last key group.
  const std::vector<KvLayout> vector_shapes = {{3, 4, 64, DType::kBFloat16, 777},
                                               {2, 2, 256, DType::kFloat16, 300},
                                               {2, 2, 128, DType::kFloat32, 129},
                                               {1, 8, 16, DType::kBFloat16, 64}};
  for (const auto& layout : vector_shapes) {
    for (std::uint32_t group : {8U, 16U, 32U, 64U, 256U, 1024U}) {
      check_quantizer(cuda::Quantizer::kFp8, fp8_codec(), layout, group, 0, 0);
      check_quantizer(cuda::Quantizer::kInt8, int8_codec(), layout, group, 0, 0);
      check_quantizer(cuda::Quantizer::kInt4, int4_codec(), layout, group, 3, 5);
      check_quantizer(cuda::Quantizer::kInt8, int8_codec(), layout, group, 1000, 1000);
    }
    for (std::uint32_t group : {16U, 64U}) {
      check_quantizer(cuda::Quantizer::kFp8, fp8_codec(), layout, group, 0, 0, true);
      check_quantizer(cuda::Quantizer::kInt8, int8_codec(), layout, group, 0, 0, true);
      check_quantizer(cuda::Quantizer::kInt4, int4_codec(), layout, group, 0, 0, true);
    }
  }
  for (const auto& layout : vector_shapes) {
    for (std::uint32_t group : {16U, 64U}) {
      check_random_payload(cuda::Quantizer::kFp8, fp8_codec(), layout, group, group);
      check_random_payload(cuda::Quantizer::kInt8, int8_codec(), layout, group, group + 1);
      check_random_payload(cuda::Quantizer::kInt4, int4_codec(), layout, group, group + 2);
    }
  }
  // The per-tensor kernels on the same values.
  for (auto layout : shapes) {
    for (DType dtype : {DType::kFloat32, DType::kFloat16, DType::kBFloat16}) {
      layout.dtype = dtype;
      check_quantizer(cuda::Quantizer::kFp8, fp8_codec(), layout, 32, 0, 0, true);
      check_quantizer(cuda::Quantizer::kInt8, int8_codec(), layout, 64, 0, 0, true);
      check_quantizer(cuda::Quantizer::kInt4, int4_codec(), layout, 32, 0, 0, true);
      check_random_payload(cuda::Quantizer::kFp8, fp8_codec(), layout, 32, 7);
      check_random_payload(cuda::Quantizer::kInt8, int8_codec(), layout, 64, 8);
      check_random_payload(cuda::Quantizer::kInt4, int4_codec(), layout, 32, 9);
    }
  }
  std::printf("%s\n", failures == 0 ? "all CUDA outputs equal the CPU bytes" : "CUDA parity FAILED");
  return failures == 0 ? 0 : 1;
#endif
}
