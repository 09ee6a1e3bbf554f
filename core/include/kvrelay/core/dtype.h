#pragma once

#include <cstddef>
#include <cstdint>
#include <optional>
#include <string_view>

namespace kvrelay {

// Element type of KV tensors. Values are part of the wire format: never renumber.
enum class DType : std::uint8_t {
  kFloat32 = 1,
  kFloat16 = 2,
  kBFloat16 = 3,
};

[[nodiscard]] constexpr std::size_t dtype_size(DType dtype) noexcept {
  return dtype == DType::kFloat32 ? 4U : 2U;
}

// "fp32" / "fp16" / "bf16".
[[nodiscard]] std::string_view dtype_name(DType dtype) noexcept;
[[nodiscard]] std::optional<DType> parse_dtype(std::string_view name) noexcept;
[[nodiscard]] std::optional<DType> dtype_from_wire(std::uint8_t value) noexcept;

}  // namespace kvrelay
