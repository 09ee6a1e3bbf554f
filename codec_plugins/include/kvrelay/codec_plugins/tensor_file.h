#pragma once

// Raw tensor files and the layout notation of the CLI.

#include <cstdint>
#include <filesystem>
#include <span>
#include <string_view>
#include <vector>

#include "kvrelay/core/kv_layout.h"
#include "kvrelay/core/result.h"

namespace kvrelay::codec {

[[nodiscard]] Result<std::vector<std::uint8_t>> read_binary_file(const std::filesystem::path& path,
                                                                 std::uint64_t max_bytes);
[[nodiscard]] Status write_binary_file(const std::filesystem::path& path, std::span<const std::uint8_t> bytes);

// "L,H,D,DTYPE" (e.g. "5,4,8,bf16") plus a token count.
[[nodiscard]] Result<KvLayout> parse_layout_spec(std::string_view spec, std::uint64_t tokens);

// Reads a float from a KV buffer of `dtype` at element `index`.
[[nodiscard]] float load_element(std::span<const std::uint8_t> bytes, DType dtype, std::size_t index);
// Converts fp32 values to `dtype` bytes (round to nearest even).
[[nodiscard]] std::vector<std::uint8_t> convert_from_f32(std::span<const float> values, DType dtype);

}  // namespace kvrelay::codec
