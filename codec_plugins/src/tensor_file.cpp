#include "kvrelay/codec_plugins/tensor_file.h"

#include <fmt/format.h>

#include <charconv>
#include <cstdio>
#include <memory>
#include <string>

#include "codec_common.h"

namespace kvrelay::codec {
namespace {

struct FileCloser {
  void operator()(std::FILE* file) const { std::fclose(file); }
};

Result<std::uint32_t> parse_u32(std::string_view text, std::string_view what) {
  std::uint32_t value = 0;
  const auto [end, error] = std::from_chars(text.data(), text.data() + text.size(), value);
  if (error != std::errc() || end != text.data() + text.size()) {
    return fail(ErrorCode::kInvalidArgument, fmt::format("layout {} '{}' is not a number", what, text));
  }
  return value;
}

}  // namespace

Result<std::vector<std::uint8_t>> read_binary_file(const std::filesystem::path& path, std::uint64_t max_bytes) {
  std::unique_ptr<std::FILE, FileCloser> file(std::fopen(path.c_str(), "rb"));
  if (!file) return fail(ErrorCode::kIo, fmt::format("cannot open {}", path.string()));
  std::error_code error;
  const auto size = std::filesystem::file_size(path, error);
  if (error) return fail(ErrorCode::kIo, fmt::format("cannot stat {}: {}", path.string(), error.message()));
  if (size > max_bytes) {
    return fail(ErrorCode::kResourceExhausted,
                fmt::format("{} has {} bytes, above {}", path.string(), size, max_bytes));
  }
  std::vector<std::uint8_t> bytes(size);
  if (size != 0 && std::fread(bytes.data(), 1, size, file.get()) != size) {
    return fail(ErrorCode::kIo, fmt::format("short read from {}", path.string()));
  }
  return bytes;
}

Status write_binary_file(const std::filesystem::path& path, std::span<const std::uint8_t> bytes) {
  std::unique_ptr<std::FILE, FileCloser> file(std::fopen(path.c_str(), "wb"));
  if (!file) return fail(ErrorCode::kIo, fmt::format("cannot create {}", path.string()));
  if (!bytes.empty() && std::fwrite(bytes.data(), 1, bytes.size(), file.get()) != bytes.size()) {
    return fail(ErrorCode::kIo, fmt::format("short write to {}", path.string()));
  }
  if (std::fclose(file.release()) != 0) return fail(ErrorCode::kIo, fmt::format("cannot close {}", path.string()));
  return ok();
}

Result<KvLayout> parse_layout_spec(std::string_view spec, std::uint64_t tokens) {
  std::string_view parts[4];
  std::size_t count = 0;
  std::string_view rest = spec;
  while (count < 4) {
    const auto comma = rest.find(',');
    parts[count++] = rest.substr(0, comma);
    if (comma == std::string_view::npos) {
      rest = {};
      break;
    }
    rest.remove_prefix(comma + 1);
  }
  if (count != 4 || !rest.empty()) {
    return fail(ErrorCode::kInvalidArgument, fmt::format("layout '{}' is not L,H,D,DTYPE", spec));
  }
  KVRELAY_TRY(auto layers, parse_u32(parts[0], "layers"));
  KVRELAY_TRY(auto heads, parse_u32(parts[1], "kv_heads"));
  KVRELAY_TRY(auto dim, parse_u32(parts[2], "head_dim"));
  const auto dtype = parse_dtype(parts[3]);
  if (!dtype) return fail(ErrorCode::kInvalidArgument, fmt::format("layout dtype '{}' unknown", parts[3]));
  KvLayout layout{layers, heads, dim, *dtype, tokens};
  KVRELAY_TRY(layout.total_bytes());
  return layout;
}

float load_element(std::span<const std::uint8_t> bytes, DType dtype, std::size_t index) {
  float value = 0;
  detail::load_floats(bytes.data() + index * dtype_size(dtype), dtype, 1, &value);
  return value;
}

std::vector<std::uint8_t> convert_from_f32(std::span<const float> values, DType dtype) {
  std::vector<std::uint8_t> bytes(values.size() * dtype_size(dtype));
  detail::store_floats(values.data(), dtype, values.size(), bytes.data());
  return bytes;
}

}  // namespace kvrelay::codec
