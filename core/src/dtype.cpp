#include "kvrelay/core/dtype.h"

namespace kvrelay {

std::string_view dtype_name(DType dtype) noexcept {
  switch (dtype) {
    case DType::kFloat32:
      return "fp32";
    case DType::kFloat16:
      return "fp16";
    case DType::kBFloat16:
      return "bf16";
  }
  return "invalid";
}

std::optional<DType> parse_dtype(std::string_view name) noexcept {
  if (name == "fp32" || name == "float32") return DType::kFloat32;
  if (name == "fp16" || name == "float16") return DType::kFloat16;
  if (name == "bf16" || name == "bfloat16") return DType::kBFloat16;
  return std::nullopt;
}

std::optional<DType> dtype_from_wire(std::uint8_t value) noexcept {
  switch (value) {
    case 1:
      return DType::kFloat32;
    case 2:
      return DType::kFloat16;
    case 3:
      return DType::kBFloat16;
    default:
      return std::nullopt;
  }
}

}  // namespace kvrelay
