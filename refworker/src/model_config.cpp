#include "kvrelay/refworker/model_config.h"

#include <fmt/format.h>

#include <charconv>

namespace kvrelay::refworker {

namespace {

Status check_range(std::string_view name, std::uint32_t value, std::uint32_t max) {
  if (value == 0 || value > max) {
    return fail(ErrorCode::kInvalidArgument, fmt::format("model {} {} outside 1..{}", name, value, max));
  }
  return ok();
}

}  // namespace

Status ModelConfig::validate() const {
  KVRELAY_TRY(check_range("dim", dim, kMaxDim));
  KVRELAY_TRY(check_range("hidden_dim", hidden_dim, kMaxHiddenDim));
  KVRELAY_TRY(check_range("layers", layers, kMaxLayers));
  KVRELAY_TRY(check_range("heads", heads, kMaxHeads));
  KVRELAY_TRY(check_range("kv_heads", kv_heads, kMaxHeads));
  KVRELAY_TRY(check_range("vocab_size", vocab_size, kMaxVocab));
  KVRELAY_TRY(check_range("seq_len", seq_len, kMaxSeqLen));
  if (dim % heads != 0) {
    return fail(ErrorCode::kInvalidArgument, fmt::format("model dim {} not divisible by heads {}", dim, heads));
  }
  if (heads % kv_heads != 0) {
    return fail(ErrorCode::kInvalidArgument,
                fmt::format("model heads {} not divisible by kv_heads {}", heads, kv_heads));
  }
  if (head_dim() % 2 != 0) {
    return fail(ErrorCode::kInvalidArgument, fmt::format("model head_dim {} is odd; RoPE needs pairs", head_dim()));
  }
  return ok();
}

std::string ModelConfig::shape_string() const {
  return fmt::format("layers={},dim={},heads={},kv_heads={},ffn={},vocab={},seq_len={}", layers, dim, heads,
                     kv_heads, hidden_dim, vocab_size, seq_len);
}

Result<ModelConfig> parse_shape(std::string_view text) {
  ModelConfig config{.dim = 64, .hidden_dim = 172, .layers = 5, .heads = 8, .kv_heads = 4,
                     .vocab_size = 512, .seq_len = 4096, .shared_classifier = true};
  std::string_view rest = text;
  while (!rest.empty()) {
    const auto comma = rest.find(',');
    const std::string_view item = rest.substr(0, comma);
    rest = comma == std::string_view::npos ? std::string_view{} : rest.substr(comma + 1);
    const auto equals = item.find('=');
    if (equals == std::string_view::npos) {
      return fail(ErrorCode::kInvalidArgument, fmt::format("shape item '{}' is not key=value", item));
    }
    const std::string_view key = item.substr(0, equals);
    const std::string_view number = item.substr(equals + 1);
    std::uint32_t value = 0;
    const auto [end, ec] = std::from_chars(number.data(), number.data() + number.size(), value);
    if (ec != std::errc{} || end != number.data() + number.size()) {
      return fail(ErrorCode::kInvalidArgument, fmt::format("shape value '{}' for '{}' is not a number", number, key));
    }
    if (key == "layers") {
      config.layers = value;
    } else if (key == "dim") {
      config.dim = value;
    } else if (key == "heads") {
      config.heads = value;
    } else if (key == "kv_heads") {
      config.kv_heads = value;
    } else if (key == "ffn" || key == "hidden_dim") {
      config.hidden_dim = value;
    } else if (key == "vocab") {
      config.vocab_size = value;
    } else if (key == "seq_len") {
      config.seq_len = value;
    } else {
      return fail(ErrorCode::kInvalidArgument, fmt::format("unknown shape key '{}'", key));
    }
  }
  KVRELAY_TRY(config.validate());
  return config;
}

}  // namespace kvrelay::refworker
