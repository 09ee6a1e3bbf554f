#include "kvrelay/shm_transport/spsc_ring.h"

#include <fmt/format.h>

#include <bit>
#include <cstring>

namespace kvrelay::shm {

namespace {

constexpr std::size_t kMagicOffset = 0;
constexpr std::size_t kSlotsOffset = 4;
constexpr std::size_t kSlotBytesOffset = 8;
constexpr std::size_t kHeadOffset = 64;
constexpr std::size_t kTailOffset = 128;
constexpr std::size_t kSlotsStart = 192;

}  // namespace

Status RingGeometry::validate() const {
  if (slots == 0 || slots > 65536 || !std::has_single_bit(slots)) {
    return fail(ErrorCode::kInvalidArgument, "ring slots must be a power of two up to 65536");
  }
  if (slot_bytes < 8 || slot_bytes > 65536 || slot_bytes % 8 != 0) {
    return fail(ErrorCode::kInvalidArgument, "ring slot size must be a multiple of 8 in [8, 65536]");
  }
  return ok();
}

std::uint64_t SpscRing::load(std::size_t offset) const {
  auto* word = reinterpret_cast<std::uint64_t*>(base_ + offset);
  return std::atomic_ref<std::uint64_t>(*word).load(std::memory_order_acquire);
}

void SpscRing::store(std::size_t offset, std::uint64_t value) {
  auto* word = reinterpret_cast<std::uint64_t*>(base_ + offset);
  std::atomic_ref<std::uint64_t>(*word).store(value, std::memory_order_release);
}

void SpscRing::initialize() {
  std::memset(base_, 0, kSlotsStart);
  std::memcpy(base_ + kMagicOffset, &kRingMagic, 4);
  std::memcpy(base_ + kSlotsOffset, &geometry_.slots, 4);
  std::memcpy(base_ + kSlotBytesOffset, &geometry_.slot_bytes, 4);
  own_head_ = 0;
  own_tail_ = 0;
}

Status SpscRing::check_header() const {
  std::uint32_t magic = 0;
  std::uint32_t slots = 0;
  std::uint32_t slot_bytes = 0;
  std::memcpy(&magic, base_ + kMagicOffset, 4);
  std::memcpy(&slots, base_ + kSlotsOffset, 4);
  std::memcpy(&slot_bytes, base_ + kSlotBytesOffset, 4);
  if (magic != kRingMagic) return fail(ErrorCode::kBadMagic, "ring header magic mismatch");
  if (slots != geometry_.slots || slot_bytes != geometry_.slot_bytes) {
    return fail(ErrorCode::kCorrupt, "ring geometry differs from the announced one");
  }
  return ok();
}

Result<bool> SpscRing::push(std::span<const std::byte> message) {
  if (message.size() > geometry_.max_message()) {
    return fail(ErrorCode::kInvalidArgument,
                fmt::format("ring message of {} bytes exceeds {}", message.size(), geometry_.max_message()));
  }
  const std::uint64_t tail = load(kTailOffset);
  if (own_head_ - tail > geometry_.slots) return fail(ErrorCode::kCorrupt, "ring tail moved past head");
  if (own_head_ - tail == geometry_.slots) return false;
  std::byte* slot = base_ + kSlotsStart + (own_head_ & (geometry_.slots - 1)) * geometry_.slot_bytes;
  const auto length = static_cast<std::uint32_t>(message.size());
  std::memcpy(slot, &length, 4);
  if (!message.empty()) std::memcpy(slot + 4, message.data(), message.size());
  ++own_head_;
  store(kHeadOffset, own_head_);
  return true;
}

Result<std::optional<std::size_t>> SpscRing::pop(std::span<std::byte> out) {
  const std::uint64_t head = load(kHeadOffset);
  if (head == own_tail_) return std::optional<std::size_t>{};
  if (head - own_tail_ > geometry_.slots) return fail(ErrorCode::kCorrupt, "ring head is beyond capacity");
  const std::byte* slot = base_ + kSlotsStart + (own_tail_ & (geometry_.slots - 1)) * geometry_.slot_bytes;
  std::uint32_t length = 0;
  std::memcpy(&length, slot, 4);
  if (length > geometry_.max_message()) return fail(ErrorCode::kCorrupt, "ring slot length exceeds the slot");
  if (length > out.size()) return fail(ErrorCode::kInvalidArgument, "ring output buffer too small");
  if (length > 0) std::memcpy(out.data(), slot + 4, length);
  ++own_tail_;
  store(kTailOffset, own_tail_);
  return std::optional<std::size_t>{length};
}

bool SpscRing::empty() const {
  return load(kHeadOffset) == own_tail_;
}

}  // namespace kvrelay::shm
