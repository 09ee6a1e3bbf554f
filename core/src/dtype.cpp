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
    case DType::kFp8E4M3:
      return "fp8_e4m3";
    case DType::kFp8E5M2:
      return "fp8_e5m2";
  }
  return "invalid";
}

std::optional<DType> parse_dtype(std::string_view name) noexcept {
  if (name == "fp32" || name == "float32") return DType::kFloat32;
  if (name == "fp16" || name == "float16") return DType::kFloat16;
  if (name == "bf16" || name == "bfloat16") return DType::kBFloat16;
  // No bare "fp8": which of the two it means is an engine's default, not a property of the bytes.
  if (name == "fp8_e4m3" || name == "float8_e4m3fn") return DType::kFp8E4M3;
  if (name == "fp8_e5m2" || name == "float8_e5m2") return DType::kFp8E5M2;
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
    case 4:
      return DType::kFp8E4M3;
    case 5:
      return DType::kFp8E5M2;
    default:
      return std::nullopt;
  }
}

}  // namespace kvrelay
