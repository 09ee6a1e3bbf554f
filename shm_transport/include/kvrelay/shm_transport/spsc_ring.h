#pragma once

// Single-producer/single-consumer ring of small fixed-size slots in shared memory. The two
// ends live in different processes that do not trust each other, so the consumer re-checks
// every index and length it reads from shared memory and copies messages out before use.

#include <atomic>
#include <cstddef>
#include <cstdint>
#include <optional>
#include <span>

#include "kvrelay/core/result.h"

namespace kvrelay::shm {

inline constexpr std::uint32_t kRingMagic = 0x474E5252U;  // "RRNG"

// Shared layout: a 192-byte header (magic, geometry, head and tail on their own cache lines),
// then `slots` slots of `slot_bytes` each: u32 length + payload.
struct RingGeometry {
  std::uint32_t slots = 64;        // power of two
  std::uint32_t slot_bytes = 256;  // includes the 4-byte length
  [[nodiscard]] std::uint64_t ring_bytes() const { return 192 + std::uint64_t{slots} * slot_bytes; }
  [[nodiscard]] std::uint32_t max_message() const { return slot_bytes - 4; }
  [[nodiscard]] Status validate() const;
};

class SpscRing {
 public:
  // `memory` must hold geometry.ring_bytes() bytes and stay mapped while the ring is used.
  SpscRing(std::byte* memory, RingGeometry geometry) : base_(memory), geometry_(geometry) {}

  // Writes the header of a fresh ring (creator side only).
  void initialize();
  // Checks the header written by the other side.
  [[nodiscard]] Status check_header() const;

  // Producer: false when full. Messages longer than max_message() are an error.
  [[nodiscard]] Result<bool> push(std::span<const std::byte> message);
  // Consumer: copies the next message into `out` and returns its length; nullopt when empty;
  // kCorrupt when the other side wrote impossible indices or lengths.
  [[nodiscard]] Result<std::optional<std::size_t>> pop(std::span<std::byte> out);
  [[nodiscard]] bool empty() const;

 private:
  [[nodiscard]] std::uint64_t load(std::size_t offset) const;
  void store(std::size_t offset, std::uint64_t value);

  std::byte* base_;
  RingGeometry geometry_;
  // Each side keeps the index it owns privately; shared memory is only its published copy.
  std::uint64_t own_head_ = 0;
  std::uint64_t own_tail_ = 0;
};

}  // namespace kvrelay::shm
