// The CUDA kernels against the CPU codecs, byte for byte. Exits 77 (ctest: skipped) when the
// build has no CUDA or the machine has no device.

#include <cstdio>
#include <cstring>
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

void expect(bool condition, const char* what, const KvLayout& layout) {
  if (condition) return;
  ++failures;
  std::fprintf(stderr, "FAILED: %s for %s\n", what, layout.describe().c_str());
}

struct DeviceBytes {
  void* pointer = nullptr;
  explicit DeviceBytes(std::size_t size) { cudaMalloc(&pointer, size == 0 ? 1 : size); }
  ~DeviceBytes() { cudaFree(pointer); }
};

void check_quantizer(cuda::Quantizer quantizer, const kvrelay_codec_plugin* cpu, const KvLayout& layout,
                     std::uint32_t group) {
  BuiltinParams params;
  params.group_size = group;
  params.recent_tokens = 16;
  const auto wire = params.serialize();
  const auto kv = synthetic_kv(layout, 99).value();
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
  expect(bool(cuda::quant_encode(quantizer, layout, params, device_kv.pointer, device_payload.pointer)), "gpu encode", layout);
  std::vector<std::uint8_t> gpu_payload(size);
  cudaMemcpy(gpu_payload.data(), device_payload.pointer, size, cudaMemcpyDeviceToHost);
  expect(gpu_payload == std::vector<std::uint8_t>(cpu_payload.begin(), cpu_payload.begin() + static_cast<std::ptrdiff_t>(written)),
         "encoded bytes equal", layout);

  std::vector<std::uint8_t> cpu_decoded(kv.size());
  expect(cpu->decode(&c_layout, wire.data(), wire.size(), cpu_payload.data(), written, cpu_decoded.data(),
                     cpu_decoded.size()) == 0,
         "cpu decode", layout);
  cudaMemset(device_kv.pointer, 0, kv.size());
  expect(bool(cuda::quant_decode(quantizer, layout, params, device_payload.pointer, device_kv.pointer)), "gpu decode", layout);
  std::vector<std::uint8_t> gpu_decoded(kv.size());
  cudaMemcpy(gpu_decoded.data(), device_kv.pointer, kv.size(), cudaMemcpyDeviceToHost);
  expect(gpu_decoded == cpu_decoded, "decoded bytes equal", layout);
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
      expect(bool(cuda::split_byte_planes(source.pointer, elements, dtype_size(dtype), planes.pointer)), "gpu split", layout);
      std::vector<std::uint8_t> gpu_planes(kv.size());
      cudaMemcpy(gpu_planes.data(), planes.pointer, kv.size(), cudaMemcpyDeviceToHost);
      expect(gpu_planes == cpu_planes, "planes equal", layout);
      cudaMemset(source.pointer, 0, kv.size());
      expect(bool(cuda::merge_byte_planes(planes.pointer, elements, dtype_size(dtype), source.pointer)), "gpu merge", layout);
      std::vector<std::uint8_t> merged(kv.size());
      cudaMemcpy(merged.data(), source.pointer, kv.size(), cudaMemcpyDeviceToHost);
      expect(merged == kv, "merge restores", layout);
    }
  }
  std::printf("%s\n", failures == 0 ? "all CUDA outputs equal the CPU bytes" : "CUDA parity FAILED");
  return failures == 0 ? 0 : 1;
#endif
}
