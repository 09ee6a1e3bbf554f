#include "kvrelay/codec_plugins/cuda_codecs.h"

#include <fmt/format.h>

#include <algorithm>

#include "cuda/kernel_api.h"
#include "quant_layout.h"

namespace kvrelay::codec::cuda {
namespace {

detail::QuantKind kind_of(Quantizer quantizer) {
  switch (quantizer) {
    case Quantizer::kFp8:
      return detail::QuantKind::kFp8;
    case Quantizer::kInt8:
      return detail::QuantKind::kInt8;
    case Quantizer::kInt4:
      return detail::QuantKind::kInt4;
  }
  return detail::QuantKind::kInt8;
}

Result<KernelPlan> make_plan(Quantizer quantizer, const KvLayout& layout, const BuiltinParams& params) {
  KVRELAY_TRY(auto tensor, layout.tensor_bytes());
  if (dtype_moves_as_bytes(layout.dtype)) {
    return fail(ErrorCode::kUnsupported, fmt::format("CUDA quantizers read fp32, fp16 or bf16; {} KV moves only as "
                                                     "bytes (raw or lossless), never converted",
                                                     dtype_name(layout.dtype)));
  }
  KVRELAY_TRY(BuiltinParams::parse(params.serialize().data(), BuiltinParams::kWireSize));
  KernelPlan plan;
  plan.kind = static_cast<std::uint8_t>(kind_of(quantizer));
  plan.dtype = static_cast<std::uint32_t>(layout.dtype);
  plan.layers = layout.layers;
  plan.heads = layout.kv_heads;
  plan.dim = layout.head_dim;
  plan.group = params.group_size;
  plan.tokens = layout.tokens;
  plan.sink = std::min<std::size_t>(params.sink_tokens, plan.tokens);
  plan.recent = std::min<std::size_t>(params.recent_tokens, plan.tokens - plan.sink);
  plan.middle = plan.tokens - plan.sink - plan.recent;
  plan.row_bytes = plan.heads * plan.dim * dtype_size(layout.dtype);
  plan.tensor_bytes = tensor;
  return plan;
}

Status check(int code, const char* what) {
  if (code == 0) return ok();
  return fail(ErrorCode::kInternal, fmt::format("CUDA {}: {}", what, kernel_error_text(code)));
}

}  // namespace

int device_count() noexcept {
  return kernel_device_count();
}

Result<std::size_t> quant_payload_size(Quantizer quantizer, const KvLayout& layout, const BuiltinParams& params) {
  KVRELAY_TRY(auto plan, make_plan(quantizer, layout, params));
  const auto kind = kind_of(quantizer);
  const auto keys = detail::quant_section(kind, false, plan.middle, plan.heads, plan.dim, plan.group);
  const auto values = detail::quant_section(kind, true, plan.middle, plan.heads, plan.dim, plan.group);
  return (2 * (plan.sink + plan.recent) * plan.row_bytes + keys.total() + values.total()) * plan.layers;
}

Status quant_encode(Quantizer quantizer, const KvLayout& layout, const BuiltinParams& params, const void* device_kv,
                    void* device_payload) {
  KVRELAY_TRY(auto plan, make_plan(quantizer, layout, params));
  return check(kernel_quant(plan, true, device_kv, device_payload), "quant encode");
}

Status quant_decode(Quantizer quantizer, const KvLayout& layout, const BuiltinParams& params,
                    const void* device_payload, void* device_kv) {
  KVRELAY_TRY(auto plan, make_plan(quantizer, layout, params));
  return check(kernel_quant(plan, false, device_payload, device_kv), "quant decode");
}

Status split_byte_planes(const void* device_source, std::size_t elements, std::size_t element_size,
                         void* device_planes) {
  if (element_size != 2 && element_size != 4) return fail(ErrorCode::kInvalidArgument, "element size must be 2 or 4");
  return check(kernel_byte_planes(true, device_source, elements, element_size, device_planes), "byte planes");
}

Status merge_byte_planes(const void* device_planes, std::size_t elements, std::size_t element_size,
                         void* device_destination) {
  if (element_size != 2 && element_size != 4) return fail(ErrorCode::kInvalidArgument, "element size must be 2 or 4");
  return check(kernel_byte_planes(false, device_planes, elements, element_size, device_destination), "byte planes");
}

}  // namespace kvrelay::codec::cuda
