#pragma once

// Helpers shared by the built-in codec implementations (not part of the public API).

#include <cstddef>
#include <cstdint>
#include <cstring>
#include <new>

#include "kvrelay/codec_plugins/builtin_params.h"
#include "kvrelay/codec_plugins/codec_abi.h"
#include "kvrelay/codec_plugins/float_bits.h"
#include "kvrelay/core/kv_layout.h"

namespace kvrelay::codec::detail {

// The C layout checked and expanded into the sizes every codec needs.
struct Shape {
  KvLayout layout;
  std::size_t element_size = 0;
  std::size_t row_elements = 0;  // kv_heads * head_dim
  std::size_t row_bytes = 0;
  std::size_t tokens = 0;
  std::size_t tensor_bytes = 0;  // one layer's K (or V)
  std::size_t total_bytes = 0;
};

// How a codec reads the elements: as bytes it moves (raw, lossless: any dtype) or as floats it
// quantizes or ranks (the lossy codecs), which refuse the dtypes that move only as bytes (fp8).
enum class ElementAccess : std::uint8_t { kBytes, kFloats };

// Returns KVRELAY_CODEC_OK or an error code (KVRELAY_CODEC_E_UNSUPPORTED: fp8 under kFloats).
int make_shape(const kvrelay_codec_layout* layout, ElementAccess access, Shape& shape) noexcept;

// Splits the tokens into exact sinks, a quantized middle and an exact recent window.
struct TokenSplit {
  std::size_t sink = 0;
  std::size_t middle = 0;
  std::size_t recent = 0;
};
[[nodiscard]] TokenSplit split_tokens(std::size_t tokens, const BuiltinParams& params) noexcept;

int parse_params(const void* data, std::size_t size, BuiltinParams& params) noexcept;

// Runs `body` and turns an escaping exception (allocation failure) into a return code, so
// nothing ever crosses the C boundary.
template <class Body>
int guarded(Body&& body) noexcept {
  try {
    return body();
  } catch (const std::bad_alloc&) {
    return KVRELAY_CODEC_E_RESOURCE_EXHAUSTED;
  } catch (...) {
    return KVRELAY_CODEC_E_INTERNAL;
  }
}

const char* builtin_error_text(int code) noexcept;

// Converts `count` elements of `dtype` to float / back; loops are branch-free so they vectorize.
// fp8 converts too, for synthetic KV and the fidelity metrics only: no codec converts fp8 KV.
void load_floats(const std::uint8_t* source, DType dtype, std::size_t count, float* destination) noexcept;
void store_floats(const float* source, DType dtype, std::size_t count, std::uint8_t* destination) noexcept;

// memcpy that accepts empty ranges with null pointers (empty tensors have no storage).
inline void copy_bytes(void* destination, const void* source, std::size_t count) noexcept {
  if (count != 0) std::memcpy(destination, source, count);
}

inline void put_u16(std::uint8_t* out, std::uint16_t value) noexcept {
  std::memcpy(out, &value, 2);
}
inline std::uint16_t get_u16(const std::uint8_t* in) noexcept {
  std::uint16_t value;
  std::memcpy(&value, in, 2);
  return value;
}

}  // namespace kvrelay::codec::detail
