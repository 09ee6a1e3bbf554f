#pragma once

// How kvrelay treats the shared memory it maps (policy `limits.memory_strategy`). Portable is
// plain memory and works everywhere; prefault pays first-touch costs up front, in paced
// background threads, for hosts that build page tables lazily (shadow or nested paging).

#include <optional>
#include <string_view>

namespace kvrelay {

enum class MemoryStrategy {
  kPortable,  // no page touching, no warmer or pacing threads
  kPrefault,  // touch each page of long-lived mappings once, from user and kernel mode
};

inline constexpr MemoryStrategy kDefaultMemoryStrategy = MemoryStrategy::kPortable;

// The policy's spelling: "portable" or "prefault".
[[nodiscard]] constexpr std::string_view to_string(MemoryStrategy strategy) noexcept {
  return strategy == MemoryStrategy::kPrefault ? "prefault" : "portable";
}

// nullopt for anything but the exact spellings of to_string.
[[nodiscard]] constexpr std::optional<MemoryStrategy> parse_memory_strategy(std::string_view text) noexcept {
  if (text == "portable") return MemoryStrategy::kPortable;
  if (text == "prefault") return MemoryStrategy::kPrefault;
  return std::nullopt;
}

}  // namespace kvrelay
