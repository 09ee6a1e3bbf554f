#pragma once

// An audit treatment: which span of the sender's context moves as KV, and in which medium. One
// type for the front proxy that draws it, the KV path that applies it and the audit that
// analyses it; the span is an enum, so behaviour never hangs on a string comparison.

#include <array>
#include <cstdint>
#include <optional>
#include <string>
#include <string_view>

namespace kvrelay {

// The part of A's context that moves as KV; the rest is prefilled from tokens.
enum class KvSpan : std::uint8_t { kNone, kPrompt, kGenerated, kAll };

inline constexpr std::array<std::string_view, 4> kKvSpanNames = {"none", "prompt", "generated", "all"};

[[nodiscard]] constexpr std::string_view span_name(KvSpan span) noexcept {
  return kKvSpanNames[static_cast<std::size_t>(span)];
}
// nullopt for anything but the four names.
[[nodiscard]] constexpr std::optional<KvSpan> parse_span(std::string_view name) noexcept {
  for (std::size_t i = 0; i < kKvSpanNames.size(); ++i) {
    if (kKvSpanNames[i] == name) return static_cast<KvSpan>(i);
  }
  return std::nullopt;
}

struct Treatment {
  std::string name;               // "T0".."T3" or any identifier
  std::string medium = "tokens";  // a policy medium name; "" keeps the route's choice
  KvSpan span = KvSpan::kNone;
  std::optional<std::uint64_t> prompt_tokens;  // A's prompt length; what span kPrompt moves

  // Whether the treatment, not the route, picks the medium.
  [[nodiscard]] bool decides_medium() const { return !medium.empty() || span == KvSpan::kNone; }
  // The medium it delivers (tokens when nothing moves as KV); only when decides_medium().
  [[nodiscard]] std::string delivered_medium() const { return span == KvSpan::kNone ? "tokens" : medium; }
  friend bool operator==(const Treatment&, const Treatment&) = default;
};

}  // namespace kvrelay
