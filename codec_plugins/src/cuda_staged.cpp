// fp8/int8/int4 behind the plugin ABI with the CUDA kernels doing the work: host input is copied
// to the device, encoded or decoded there, and the output copied back.

#include "cuda_staged.h"

#include <cuda_runtime.h>

#include "kvrelay/codec_plugins/builtin_codecs.h"
#include "kvrelay/codec_plugins/builtin_params.h"
#include "kvrelay/codec_plugins/cuda_codecs.h"

namespace kvrelay::codec::detail {
namespace {

struct DeviceBuffer {
  void* pointer = nullptr;
  cudaError_t error = cudaSuccess;
  explicit DeviceBuffer(std::size_t size) : error(cudaMalloc(&pointer, size == 0 ? 1 : size)) {}
  ~DeviceBuffer() {
    if (pointer != nullptr) cudaFree(pointer);
  }
  DeviceBuffer(const DeviceBuffer&) = delete;
  DeviceBuffer& operator=(const DeviceBuffer&) = delete;
};

struct Call {
  KvLayout layout;
  BuiltinParams params;
  std::size_t kv_bytes = 0;
  std::size_t payload_bytes = 0;
};

int prepare(cuda::Quantizer quantizer, const kvrelay_codec_layout* c_layout, const void* params,
            std::size_t params_size, Call& call) {
  if (c_layout == nullptr) return KVRELAY_CODEC_E_INVALID_ARGUMENT;
  call.layout = KvLayout{c_layout->layers, c_layout->kv_heads, c_layout->head_dim, static_cast<DType>(c_layout->dtype),
                         c_layout->tokens};
  auto parsed = BuiltinParams::parse(static_cast<const std::uint8_t*>(params), params_size);
  if (!parsed) return static_cast<int>(parsed.error().code);
  call.params = parsed.value();
  auto total = call.layout.total_bytes();
  if (!total) return static_cast<int>(total.error().code);
  call.kv_bytes = total.value();
  auto payload = cuda::quant_payload_size(quantizer, call.layout, call.params);
  if (!payload) return static_cast<int>(payload.error().code);
  call.payload_bytes = payload.value();
  return KVRELAY_CODEC_OK;
}

template <cuda::Quantizer kQuantizer>
int staged_encode(const kvrelay_codec_layout* layout, const void* params, size_t params_size, const void* input,
                  size_t input_size, void* output, size_t output_capacity, size_t* output_size) {
  Call call;
  if (const int code = prepare(kQuantizer, layout, params, params_size, call); code != KVRELAY_CODEC_OK) return code;
  if (input_size != call.kv_bytes) return KVRELAY_CODEC_E_LAYOUT_MISMATCH;
  if (output_capacity < call.payload_bytes) return KVRELAY_CODEC_E_OVERFLOW;
  DeviceBuffer kv(call.kv_bytes);
  DeviceBuffer payload(call.payload_bytes);
  if (kv.error != cudaSuccess || payload.error != cudaSuccess) return KVRELAY_CODEC_E_RESOURCE_EXHAUSTED;
  if (cudaMemcpy(kv.pointer, input, input_size, cudaMemcpyHostToDevice) != cudaSuccess) return KVRELAY_CODEC_E_INTERNAL;
  if (!cuda::quant_encode(kQuantizer, call.layout, call.params, kv.pointer, payload.pointer)) {
    return KVRELAY_CODEC_E_INTERNAL;
  }
  if (cudaMemcpy(output, payload.pointer, call.payload_bytes, cudaMemcpyDeviceToHost) != cudaSuccess) {
    return KVRELAY_CODEC_E_INTERNAL;
  }
  *output_size = call.payload_bytes;
  return KVRELAY_CODEC_OK;
}

template <cuda::Quantizer kQuantizer>
int staged_decode(const kvrelay_codec_layout* layout, const void* params, size_t params_size, const void* input,
                  size_t input_size, void* output, size_t output_size) {
  Call call;
  if (const int code = prepare(kQuantizer, layout, params, params_size, call); code != KVRELAY_CODEC_OK) return code;
  if (output_size != call.kv_bytes) return KVRELAY_CODEC_E_LAYOUT_MISMATCH;
  // The CPU decoders refuse a payload of the wrong size the same way.
  if (input_size != call.payload_bytes) return KVRELAY_CODEC_E_TRUNCATED;
  DeviceBuffer payload(call.payload_bytes);
  DeviceBuffer kv(call.kv_bytes);
  if (kv.error != cudaSuccess || payload.error != cudaSuccess) return KVRELAY_CODEC_E_RESOURCE_EXHAUSTED;
  if (cudaMemcpy(payload.pointer, input, input_size, cudaMemcpyHostToDevice) != cudaSuccess) {
    return KVRELAY_CODEC_E_INTERNAL;
  }
  if (!cuda::quant_decode(kQuantizer, call.layout, call.params, payload.pointer, kv.pointer)) {
    return KVRELAY_CODEC_E_INTERNAL;
  }
  if (cudaMemcpy(output, kv.pointer, output_size, cudaMemcpyDeviceToHost) != cudaSuccess) {
    return KVRELAY_CODEC_E_INTERNAL;
  }
  return KVRELAY_CODEC_OK;
}

template <cuda::Quantizer kQuantizer>
kvrelay_codec_plugin make_staged(const kvrelay_codec_plugin* cpu) {
  kvrelay_codec_plugin plugin = *cpu;
  plugin.encode = staged_encode<kQuantizer>;
  plugin.decode = staged_decode<kQuantizer>;
  return plugin;
}

}  // namespace

Result<const kvrelay_codec_plugin*> staged_cuda_codec(std::uint32_t codec_id) {
  if (cuda::device_count() == 0) {
    return fail(ErrorCode::kUnsupported, "no CUDA device found (driver missing or no GPU visible)");
  }
  static const kvrelay_codec_plugin fp8 = make_staged<cuda::Quantizer::kFp8>(fp8_codec());
  static const kvrelay_codec_plugin int8 = make_staged<cuda::Quantizer::kInt8>(int8_codec());
  static const kvrelay_codec_plugin int4 = make_staged<cuda::Quantizer::kInt4>(int4_codec());
  switch (codec_id) {
    case kFp8CodecId:
      return &fp8;
    case kInt8CodecId:
      return &int8;
    case kInt4CodecId:
      return &int4;
    default:
      return fail(ErrorCode::kUnsupported, "codec has no CUDA implementation");
  }
}

}  // namespace kvrelay::codec::detail
