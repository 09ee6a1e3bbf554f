// CUDA kernels of the quantizing codecs. The payload layout is quant_layout.h's and every scalar
// step comes from float_bits.h, compiled with -fmad=false, so the bytes equal the CPU codec's.
// These per-tensor kernels take the shapes quant_vector_kernels.cu does not cover (odd head
// sizes, groups that do not split a head evenly, unaligned rows). They favour simple indexing:
// one thread per channel (K groups), per token and head (fp8, V groups) or per element
// (dequantize); int4 packing runs as a separate pass.

#include <cuda_runtime.h>

#include "kvrelay/codec_plugins/float_bits.h"

#include "../quant_layout.h"
#include "kernel_api.h"
#include "quant_vector_kernels.h"

namespace kvrelay::codec::cuda {
namespace {

using detail::QuantKind;
using detail::QuantSection;

constexpr int kThreads = 256;

unsigned blocks_for(std::size_t work) {
  return static_cast<unsigned>((work + kThreads - 1) / kThreads);
}

__device__ float load_value(const std::uint8_t* base, std::uint32_t dtype, std::size_t index) {
  if (dtype == 1) {
    float value;
    memcpy(&value, base + index * 4, 4);
    return value;
  }
  std::uint16_t bits;
  memcpy(&bits, base + index * 2, 2);
  return dtype == 2 ? half_to_float(bits) : bf16_to_float(bits);
}

__device__ void store_value(std::uint8_t* base, std::uint32_t dtype, std::size_t index, float value) {
  if (dtype == 1) {
    memcpy(base + index * 4, &value, 4);
    return;
  }
  const std::uint16_t bits = dtype == 2 ? float_to_half(value) : float_to_bf16(value);
  memcpy(base + index * 2, &bits, 2);
}

__device__ void put_half(std::uint8_t* out, std::uint16_t value) {
  memcpy(out, &value, 2);
}
__device__ std::uint16_t get_half(const std::uint8_t* in) {
  std::uint16_t value;
  memcpy(&value, in, 2);
  return value;
}

struct Dims {
  std::size_t middle;
  std::size_t heads;
  std::size_t dim;
  std::size_t row;
  std::size_t group;
  std::uint32_t dtype;
  float max_code;
};

// fp8: one thread per (token, head).
__global__ void fp8_encode_kernel(Dims d, const std::uint8_t* rows, std::uint8_t* meta, std::uint8_t* codes) {
  const std::size_t id = blockIdx.x * static_cast<std::size_t>(blockDim.x) + threadIdx.x;
  if (id >= d.middle * d.heads) return;
  const std::size_t t = id / d.heads;
  const std::size_t h = id % d.heads;
  const std::size_t first = t * d.row + h * d.dim;
  float amax = 0.0F;
  for (std::size_t i = 0; i < d.dim; ++i) {
    const float v = fabsf(load_value(rows, d.dtype, first + i));
    amax = v > amax ? v : amax;
  }
  const float scale = fp8_scale(amax);
  const float inv = __fdiv_rn(1.0F, scale);
  memcpy(meta + id * 4, &scale, 4);
  for (std::size_t i = 0; i < d.dim; ++i)
    codes[first + i] = scaled_e4m3(load_value(rows, d.dtype, first + i), inv);
}

// fp8 decode: one thread per element.
__global__ void fp8_decode_kernel(Dims d, const std::uint8_t* meta, const std::uint8_t* codes, std::uint8_t* rows) {
  const std::size_t id = blockIdx.x * static_cast<std::size_t>(blockDim.x) + threadIdx.x;
  if (id >= d.middle * d.row) return;
  const std::size_t t = id / d.row;
  const std::size_t h = (id % d.row) / d.dim;
  float scale;
  memcpy(&scale, meta + (t * d.heads + h) * 4, 4);
  store_value(rows, d.dtype, id, __fmul_rn(e4m3_to_float(codes[id]), scale));
}

// Keys: one thread per (token group, channel); codes go to an unpacked byte buffer.
__global__ void int_keys_encode_kernel(Dims d, const std::uint8_t* rows, std::uint8_t* meta, std::uint8_t* codes) {
  const std::size_t groups = (d.middle + d.group - 1) / d.group;
  const std::size_t id = blockIdx.x * static_cast<std::size_t>(blockDim.x) + threadIdx.x;
  if (id >= groups * d.row) return;
  const std::size_t g = id / d.row;
  const std::size_t c = id % d.row;
  const std::size_t start = g * d.group;
  const std::size_t end = start + d.group < d.middle ? start + d.group : d.middle;
  float lo = __int_as_float(0x7F800000);
  float hi = __int_as_float(0xFF800000);
  for (std::size_t t = start; t < end; ++t) {
    const float x = load_value(rows, d.dtype, t * d.row + c);
    lo = x < lo ? x : lo;
    hi = x > hi ? x : hi;
  }
  const QuantGroup q = make_quant_group(lo, hi, d.max_code);
  std::uint8_t* scales = meta + g * d.row * 4;
  put_half(scales + 2 * c, q.scale_half);
  put_half(scales + d.row * 2 + 2 * c, q.zero_half);
  for (std::size_t t = start; t < end; ++t) {
    codes[t * d.row + c] = static_cast<std::uint8_t>(
        quantize_step(load_value(rows, d.dtype, t * d.row + c), q.zero, q.inv_scale, d.max_code));
  }
}

// Values: one thread per (token, head, channel group).
__global__ void int_values_encode_kernel(Dims d, const std::uint8_t* rows, std::uint8_t* meta, std::uint8_t* codes) {
  const std::size_t group = d.group < d.dim ? d.group : d.dim;
  const std::size_t per_head = (d.dim + group - 1) / group;
  const std::size_t id = blockIdx.x * static_cast<std::size_t>(blockDim.x) + threadIdx.x;
  if (id >= d.middle * d.heads * per_head) return;
  const std::size_t t = id / (d.heads * per_head);
  const std::size_t h = (id / per_head) % d.heads;
  const std::size_t g = id % per_head;
  const std::size_t first = t * d.row + h * d.dim + g * group;
  const std::size_t count = g * group + group <= d.dim ? group : d.dim - g * group;
  float lo = __int_as_float(0x7F800000);
  float hi = __int_as_float(0xFF800000);
  for (std::size_t i = 0; i < count; ++i) {
    const float x = load_value(rows, d.dtype, first + i);
    lo = x < lo ? x : lo;
    hi = x > hi ? x : hi;
  }
  const QuantGroup q = make_quant_group(lo, hi, d.max_code);
  put_half(meta + id * 4, q.scale_half);
  put_half(meta + id * 4 + 2, q.zero_half);
  for (std::size_t i = 0; i < count; ++i) {
    codes[first + i] =
        static_cast<std::uint8_t>(quantize_step(load_value(rows, d.dtype, first + i), q.zero, q.inv_scale, d.max_code));
  }
}

// int4: two codes per byte along each row; one thread per output byte.
__global__ void pack_int4_kernel(std::size_t middle, std::size_t row, const std::uint8_t* codes, std::uint8_t* out) {
  const std::size_t row_bytes = (row + 1) / 2;
  const std::size_t id = blockIdx.x * static_cast<std::size_t>(blockDim.x) + threadIdx.x;
  if (id >= middle * row_bytes) return;
  const std::size_t t = id / row_bytes;
  const std::size_t i = id % row_bytes;
  const std::uint8_t low = codes[t * row + 2 * i];
  const std::uint8_t high = 2 * i + 1 < row ? codes[t * row + 2 * i + 1] : 0;
  out[id] = static_cast<std::uint8_t>(low | (high << 4));
}

__global__ void unpack_int4_kernel(std::size_t middle, std::size_t row, const std::uint8_t* in, std::uint8_t* codes) {
  const std::size_t row_bytes = (row + 1) / 2;
  const std::size_t id = blockIdx.x * static_cast<std::size_t>(blockDim.x) + threadIdx.x;
  if (id >= middle * row) return;
  const std::size_t t = id / row;
  const std::size_t c = id % row;
  const std::uint8_t byte = in[t * row_bytes + c / 2];
  codes[id] = (c % 2 == 0) ? (byte & 0xFU) : static_cast<std::uint8_t>(byte >> 4);
}

// Dequantize: one thread per element.
__global__ void int_keys_decode_kernel(Dims d, const std::uint8_t* meta, const std::uint8_t* codes,
                                       std::uint8_t* rows) {
  const std::size_t id = blockIdx.x * static_cast<std::size_t>(blockDim.x) + threadIdx.x;
  if (id >= d.middle * d.row) return;
  const std::size_t t = id / d.row;
  const std::size_t c = id % d.row;
  const std::uint8_t* scales = meta + (t / d.group) * d.row * 4;
  const float scale = half_to_float(get_half(scales + 2 * c));
  const float zero = half_to_float(get_half(scales + d.row * 2 + 2 * c));
  store_value(rows, d.dtype, id, dequantize_step(codes[id], zero, scale));
}

__global__ void int_values_decode_kernel(Dims d, const std::uint8_t* meta, const std::uint8_t* codes,
                                         std::uint8_t* rows) {
  const std::size_t group = d.group < d.dim ? d.group : d.dim;
  const std::size_t per_head = (d.dim + group - 1) / group;
  const std::size_t id = blockIdx.x * static_cast<std::size_t>(blockDim.x) + threadIdx.x;
  if (id >= d.middle * d.row) return;
  const std::size_t t = id / d.row;
  const std::size_t h = (id % d.row) / d.dim;
  const std::size_t g = (id % d.dim) / group;
  const std::uint8_t* pair = meta + ((t * d.heads + h) * per_head + g) * 4;
  store_value(rows, d.dtype, id,
              dequantize_step(codes[id], half_to_float(get_half(pair + 2)), half_to_float(get_half(pair))));
}

// Scratch for unpacked int4 codes, freed on scope exit.
struct DeviceBuffer {
  void* pointer = nullptr;
  ~DeviceBuffer() {
    if (pointer != nullptr) cudaFree(pointer);
  }
};

}  // namespace

int kernel_device_count() {
  int count = 0;
  if (cudaGetDeviceCount(&count) != cudaSuccess) return 0;
  return count;
}

const char* kernel_error_text(int code) {
  return cudaGetErrorString(static_cast<cudaError_t>(code));
}

int kernel_quant(const KernelPlan& plan, bool encode, const void* device_in, void* device_out) {
  if (vector_path_applies(plan, encode ? device_in : device_out)) {
    return kernel_quant_vectorized(plan, encode, device_in, device_out);
  }
  const auto kind = static_cast<QuantKind>(plan.kind);
  const Dims dims{plan.middle,
                  plan.heads,
                  plan.dim,
                  plan.heads * plan.dim,
                  plan.group,
                  plan.dtype,
                  kind == QuantKind::kInt4 ? 15.0F : 255.0F};
  const QuantSection keys = detail::quant_section(kind, false, plan.middle, plan.heads, plan.dim, plan.group);
  const QuantSection values = detail::quant_section(kind, true, plan.middle, plan.heads, plan.dim, plan.group);
  DeviceBuffer scratch;
  cudaError_t error = cudaSuccess;
  if (kind == QuantKind::kInt4 && plan.middle > 0) {
    error = cudaMalloc(&scratch.pointer, plan.middle * dims.row);
    if (error != cudaSuccess) return static_cast<int>(error);
  }
  auto* unpacked = static_cast<std::uint8_t*>(scratch.pointer);
  const std::size_t sink_bytes = plan.sink * plan.row_bytes;
  const std::size_t recent_bytes = plan.recent * plan.row_bytes;
  const auto* kv_in = static_cast<const std::uint8_t*>(device_in);
  auto* kv_out = static_cast<std::uint8_t*>(device_out);
  std::size_t payload = 0;  // running offset into the payload
  for (std::size_t tensor = 0; tensor < 2 * plan.layers && error == cudaSuccess; ++tensor) {
    const bool is_value = tensor % 2 == 1;
    const QuantSection& section = is_value ? values : keys;
    const std::size_t kv_offset = tensor * plan.tensor_bytes;
    if (encode) {
      const std::uint8_t* source = kv_in + kv_offset;
      std::uint8_t* out = kv_out + payload;
      error = cudaMemcpy(out, source, sink_bytes, cudaMemcpyDeviceToDevice);
      if (error == cudaSuccess) {
        error = cudaMemcpy(out + sink_bytes, source + (plan.tokens - plan.recent) * plan.row_bytes, recent_bytes,
                           cudaMemcpyDeviceToDevice);
      }
      out += sink_bytes + recent_bytes;
      if (error == cudaSuccess && plan.middle > 0) {
        const std::uint8_t* middle = source + sink_bytes;
        std::uint8_t* meta = out;
        std::uint8_t* codes = out + section.meta_bytes;
        std::uint8_t* target = kind == QuantKind::kInt4 ? unpacked : codes;
        if (kind == QuantKind::kFp8) {
          fp8_encode_kernel<<<blocks_for(plan.middle * dims.heads), kThreads>>>(dims, middle, meta, codes);
        } else if (is_value) {
          const std::size_t group = dims.group < dims.dim ? dims.group : dims.dim;
          const std::size_t work = plan.middle * dims.heads * ((dims.dim + group - 1) / group);
          int_values_encode_kernel<<<blocks_for(work), kThreads>>>(dims, middle, meta, target);
        } else {
          const std::size_t work = ((plan.middle + dims.group - 1) / dims.group) * dims.row;
          int_keys_encode_kernel<<<blocks_for(work), kThreads>>>(dims, middle, meta, target);
        }
        if (kind == QuantKind::kInt4) {
          pack_int4_kernel<<<blocks_for(plan.middle * section.code_row_bytes), kThreads>>>(plan.middle, dims.row,
                                                                                           target, codes);
        }
        error = cudaGetLastError();
      }
    } else {
      const std::uint8_t* in = kv_in + payload;
      std::uint8_t* destination = kv_out + kv_offset;
      error = cudaMemcpy(destination, in, sink_bytes, cudaMemcpyDeviceToDevice);
      if (error == cudaSuccess) {
        error = cudaMemcpy(destination + (plan.tokens - plan.recent) * plan.row_bytes, in + sink_bytes, recent_bytes,
                           cudaMemcpyDeviceToDevice);
      }
      in += sink_bytes + recent_bytes;
      if (error == cudaSuccess && plan.middle > 0) {
        std::uint8_t* middle = destination + sink_bytes;
        const std::uint8_t* meta = in;
        const std::uint8_t* codes = in + section.meta_bytes;
        if (kind == QuantKind::kInt4) {
          unpack_int4_kernel<<<blocks_for(plan.middle * dims.row), kThreads>>>(plan.middle, dims.row, codes, unpacked);
          codes = unpacked;
        }
        const unsigned blocks = blocks_for(plan.middle * dims.row);
        if (kind == QuantKind::kFp8) {
          fp8_decode_kernel<<<blocks, kThreads>>>(dims, meta, codes, middle);
        } else if (is_value) {
          int_values_decode_kernel<<<blocks, kThreads>>>(dims, meta, codes, middle);
        } else {
          int_keys_decode_kernel<<<blocks, kThreads>>>(dims, meta, codes, middle);
        }
        error = cudaGetLastError();
      }
    }
    payload += sink_bytes + recent_bytes + section.total();
  }
  if (error == cudaSuccess) error = cudaDeviceSynchronize();
  return static_cast<int>(error);
}

}  // namespace kvrelay::codec::cuda
