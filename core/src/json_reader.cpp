#include "json_reader.h"

#include <fmt/format.h>

namespace kvrelay::detail {

namespace {

std::string render_value(const nlohmann::json& value) {
  constexpr std::size_t kMaxShown = 60;
  std::string text = value.dump();
  if (text.size() > kMaxShown) text = text.substr(0, kMaxShown - 3) + "...";
  return text;
}

template <class Int>
std::optional<Int> as_integer(const nlohmann::json& value, Int min, Int max) {
  if (value.is_number_unsigned()) {
    const auto number = value.get<std::uint64_t>();
    if (number > static_cast<std::uint64_t>(max)) return std::nullopt;
    if constexpr (std::is_signed_v<Int>) {
      if (static_cast<std::int64_t>(number) < static_cast<std::int64_t>(min)) return std::nullopt;
    } else {
      if (number < static_cast<std::uint64_t>(min)) return std::nullopt;
    }
    return static_cast<Int>(number);
  }
  if (value.is_number_integer()) {
    const auto number = value.get<std::int64_t>();
    if constexpr (std::is_signed_v<Int>) {
      if (number < static_cast<std::int64_t>(min) || number > static_cast<std::int64_t>(max)) {
        return std::nullopt;
      }
    } else {
      if (number < 0 || static_cast<std::uint64_t>(number) < static_cast<std::uint64_t>(min) ||
          static_cast<std::uint64_t>(number) > static_cast<std::uint64_t>(max)) {
        return std::nullopt;
      }
    }
    return static_cast<Int>(number);
  }
  return std::nullopt;
}

}  // namespace

void Diagnostics::expected(const std::string& pointer, std::string_view what, const nlohmann::json* got) {
  if (got == nullptr) {
    problems_.push_back(fmt::format("{}: {}: expected {}, got nothing", source_, pointer, what));
  } else {
    problems_.push_back(fmt::format("{}: {}: expected {}, got {}", source_, pointer, what, render_value(*got)));
  }
}

void Diagnostics::problem(const std::string& pointer, std::string_view message) {
  problems_.push_back(fmt::format("{}: {}: {}", source_, pointer, message));
}

std::string Diagnostics::joined() const {
  std::string text;
  for (const auto& line : problems_) {
    if (!text.empty()) text += '\n';
    text += line;
  }
  return text;
}

std::string pointer_append(const std::string& pointer, std::string_view token) {
  std::string result = pointer;
  result += '/';
  for (const char c : token) {
    if (c == '~') {
      result += "~0";
    } else if (c == '/') {
      result += "~1";
    } else {
      result += c;
    }
  }
  return result;
}

std::string pointer_append(const std::string& pointer, std::size_t index) {
  return pointer + "/" + std::to_string(index);
}

ObjectReader::ObjectReader(const nlohmann::json& value, std::string pointer, Diagnostics& diagnostics)
    : pointer_(std::move(pointer)), diagnostics_(diagnostics) {
  if (value.is_object()) {
    object_ = &value;
  } else {
    diagnostics_.expected(pointer_.empty() ? "/" : pointer_, "object", &value);
  }
}

const nlohmann::json* ObjectReader::field(std::string_view key, bool required) {
  known_.emplace(key);
  if (object_ == nullptr) return nullptr;
  const auto found = object_->find(key);
  if (found == object_->end()) {
    if (required) diagnostics_.problem(pointer_of(key), "required key is missing");
    return nullptr;
  }
  return &*found;
}

bool ObjectReader::read_string(std::string_view key, std::string& out, bool required, bool non_empty) {
  const auto* value = field(key, required);
  if (value == nullptr) return false;
  if (!value->is_string() || (non_empty && value->get_ref<const std::string&>().empty())) {
    diagnostics_.expected(pointer_of(key), non_empty ? "non-empty string" : "string", value);
    return false;
  }
  out = value->get<std::string>();
  return true;
}

bool ObjectReader::read_bool(std::string_view key, bool& out, bool required) {
  const auto* value = field(key, required);
  if (value == nullptr) return false;
  if (!value->is_boolean()) {
    diagnostics_.expected(pointer_of(key), "boolean", value);
    return false;
  }
  out = value->get<bool>();
  return true;
}

bool ObjectReader::read_int(std::string_view key, int& out, int min, int max, bool required) {
  const auto* value = field(key, required);
  if (value == nullptr) return false;
  const auto number = as_integer<int>(*value, min, max);
  if (!number) {
    diagnostics_.expected(pointer_of(key), fmt::format("integer {}..{}", min, max), value);
    return false;
  }
  out = *number;
  return true;
}

bool ObjectReader::read_u64(std::string_view key, std::uint64_t& out, std::uint64_t min, std::uint64_t max,
                            bool required) {
  const auto* value = field(key, required);
  if (value == nullptr) return false;
  const auto number = as_integer<std::uint64_t>(*value, min, max);
  if (!number) {
    diagnostics_.expected(pointer_of(key), fmt::format("integer {}..{}", min, max), value);
    return false;
  }
  out = *number;
  return true;
}

bool ObjectReader::read_u32(std::string_view key, std::uint32_t& out, std::uint32_t min, std::uint32_t max,
                            bool required) {
  std::uint64_t wide = out;
  if (!read_u64(key, wide, min, max, required)) return false;
  out = static_cast<std::uint32_t>(wide);
  return true;
}

bool ObjectReader::read_double(std::string_view key, double& out, double min, double max, bool required) {
  const auto* value = field(key, required);
  if (value == nullptr) return false;
  if (!value->is_number() || value->get<double>() < min || value->get<double>() > max) {
    diagnostics_.expected(pointer_of(key), fmt::format("number {}..{}", min, max), value);
    return false;
  }
  out = value->get<double>();
  return true;
}

bool ObjectReader::read_millis(std::string_view key, std::chrono::milliseconds& out, std::int64_t min, std::int64_t max,
                               bool required) {
  const auto* value = field(key, required);
  if (value == nullptr) return false;
  const auto number = as_integer<std::int64_t>(*value, min, max);
  if (!number) {
    diagnostics_.expected(pointer_of(key), fmt::format("integer milliseconds {}..{}", min, max), value);
    return false;
  }
  out = std::chrono::milliseconds(*number);
  return true;
}

bool ObjectReader::read_string_array(std::string_view key, std::vector<std::string>& out, bool required) {
  const auto* value = field(key, required);
  if (value == nullptr) return false;
  if (!value->is_array()) {
    diagnostics_.expected(pointer_of(key), "array of strings", value);
    return false;
  }
  std::vector<std::string> items;
  bool all_valid = true;
  for (std::size_t index = 0; index < value->size(); ++index) {
    const auto& item = (*value)[index];
    if (!item.is_string() || item.get_ref<const std::string&>().empty()) {
      diagnostics_.expected(pointer_append(pointer_of(key), index), "non-empty string", &item);
      all_valid = false;
      continue;
    }
    items.push_back(item.get<std::string>());
  }
  if (all_valid) out = std::move(items);
  return all_valid;
}

void ObjectReader::reject_unknown_keys() {
  if (object_ == nullptr) return;
  for (const auto& [key, value] : object_->items()) {
    if (known_.find(key) == known_.end()) {
      std::string allowed;
      for (const auto& name : known_)
        allowed += (allowed.empty() ? "" : ", ") + name;
      diagnostics_.problem(pointer_of(key), fmt::format("unknown key (allowed here: {})", allowed));
    }
  }
}

}  // namespace kvrelay::detail
