#pragma once

// CUDA versions of the fp8/int8/int4 codecs and of the lossless byte-plane split, on device
// memory. They write exactly the bytes of the CPU codecs (same payload layout, same scalar steps
// from float_bits.h), so a frame encoded on a GPU decodes on a CPU and the other way round.
// Built only when KVRELAY_HAVE_CUDA; every function fails cleanly without a device.

#include <cstddef>
#include <cstdint>

#include "kvrelay/codec_plugins/builtin_params.h"
#include "kvrelay/core/kv_layout.h"
#include "kvrelay/core/result.h"

namespace kvrelay::codec::cuda {

enum class Quantizer : std::uint8_t { kFp8, kInt8, kInt4 };

// Number of CUDA devices (0 when the driver or device is missing).
[[nodiscard]] int device_count() noexcept;

// Payload size for a layout and params (same as the CPU codec's max_encoded_size).
[[nodiscard]] Result<std::size_t> quant_payload_size(Quantizer quantizer, const KvLayout& layout,
                                                     const BuiltinParams& params);

// Device KV (layout's size) -> device payload of quant_payload_size() bytes. Synchronous.
[[nodiscard]] Status quant_encode(Quantizer quantizer, const KvLayout& layout, const BuiltinParams& params,
                                  const void* device_kv, void* device_payload);
// Device payload -> device KV. Synchronous.
[[nodiscard]] Status quant_decode(Quantizer quantizer, const KvLayout& layout, const BuiltinParams& params,
                                  const void* device_payload, void* device_kv);

// Byte planes as split_byte_planes()/merge_byte_planes(), on device memory. Synchronous.
[[nodiscard]] Status split_byte_planes(const void* device_source, std::size_t elements, std::size_t element_size,
                                       void* device_planes);
[[nodiscard]] Status merge_byte_planes(const void* device_planes, std::size_t elements, std::size_t element_size,
                                       void* device_destination);

}  // namespace kvrelay::codec::cuda
