#pragma once

// Path-tracking reader over nlohmann::json for configuration files: every problem is recorded
// with the JSON pointer of the value that caused it, and reading continues so one run reports
// all of them.

#include <nlohmann/json.hpp>

#include <chrono>
#include <cstdint>
#include <optional>
#include <set>
#include <string>
#include <string_view>
#include <vector>

namespace kvrelay::detail {

class Diagnostics {
 public:
  explicit Diagnostics(std::string source) : source_(std::move(source)) {}

  void expected(const std::string& pointer, std::string_view what, const nlohmann::json* got);
  void problem(const std::string& pointer, std::string_view message);

  [[nodiscard]] bool empty() const { return problems_.empty(); }
  [[nodiscard]] std::string joined() const;

 private:
  std::string source_;
  std::vector<std::string> problems_;
};

[[nodiscard]] std::string pointer_append(const std::string& pointer, std::string_view token);
[[nodiscard]] std::string pointer_append(const std::string& pointer, std::size_t index);

class ObjectReader {
 public:
  ObjectReader(const nlohmann::json& value, std::string pointer, Diagnostics& diagnostics);

  [[nodiscard]] bool is_object() const { return object_ != nullptr; }
  [[nodiscard]] const std::string& pointer() const { return pointer_; }
  [[nodiscard]] std::string pointer_of(std::string_view key) const { return pointer_append(pointer_, key); }

  // Marks the key as known; returns the value or nullptr (reporting it when required).
  const nlohmann::json* field(std::string_view key, bool required);

  bool read_string(std::string_view key, std::string& out, bool required, bool non_empty = true);
  bool read_bool(std::string_view key, bool& out, bool required = false);
  bool read_int(std::string_view key, int& out, int min, int max, bool required = false);
  bool read_u64(std::string_view key, std::uint64_t& out, std::uint64_t min, std::uint64_t max, bool required = false);
  bool read_u32(std::string_view key, std::uint32_t& out, std::uint32_t min, std::uint32_t max, bool required = false);
  bool read_double(std::string_view key, double& out, double min, double max, bool required = false);
  bool read_millis(std::string_view key, std::chrono::milliseconds& out, std::int64_t min, std::int64_t max,
                   bool required = false);
  bool read_string_array(std::string_view key, std::vector<std::string>& out, bool required = false);

  // Reports every key that no read_* or field() call asked for.
  void reject_unknown_keys();

 private:
  const nlohmann::json* object_ = nullptr;
  std::string pointer_;
  Diagnostics& diagnostics_;
  std::set<std::string, std::less<>> known_;
};

}  // namespace kvrelay::detail
