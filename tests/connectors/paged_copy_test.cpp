// Paged gather/scatter against an independent index computation, for every layout, element size
// and stride shape the engines hand over, and every refusal.

#include "kvrelay/connectors/paged_copy.h"

#include <catch2/catch.hpp>

#include <array>
#include <cstdint>
#include <cstring>
#include <numeric>
#include <string>
#include <vector>

#include "kvrelay/connectors/kvrelay_paged.h"
#include "kvrelay/core/kv_layout.h"

namespace {

constexpr std::int64_t kBlocks = 7;
constexpr std::int64_t kBlockSize = 4;
constexpr std::int64_t kHeads = 3;
constexpr std::int64_t kHeadDim = 5;

// Logical index (kv, block, slot, head, dim) to the layout's shape positions.
std::array<std::int64_t, 5> layout_index(std::uint32_t layout, std::int64_t kv, std::int64_t block, std::int64_t slot,
                                         std::int64_t head, std::int64_t dim) {
  switch (layout) {
    case KVRELAY_PAGED_FLASH_ATTN:
      return {kv, block, slot, head, dim};
    case KVRELAY_PAGED_FLASHINFER:
      return {block, kv, slot, head, dim};
    default:
      return {kv, block, head, slot, dim};
  }
}

// Distinct enough in every byte that a misplaced element shows up even at elem_size 1.
std::uint32_t pattern(std::int64_t kv, std::int64_t block, std::int64_t slot, std::int64_t head, std::int64_t dim) {
  auto value = static_cast<std::uint32_t>(kv * 100003 + block * 10007 + slot * 1009 + head * 101 + dim * 7 + 1);
  value *= 2654435761U;
  return value ^ (value >> 15);
}

// kSlotsOuter keeps each token row contiguous but not consecutive tokens (row-by-row copies);
// kPermuted puts head_dim outermost (element-by-element copies).
enum class Strides { kContiguous, kSlicedHeads, kSlotsOuter, kPermuted };

// Position of logical axis `logical` (0 kv, 1 block, 2 slot, 3 head, 4 dim) in the layout's shape.
std::size_t axis_of(std::uint32_t layout, int logical) {
  std::array<std::int64_t, 5> one_hot{};
  one_hot[static_cast<std::size_t>(logical)] = 1;
  const auto index = layout_index(layout, one_hot[0], one_hot[1], one_hot[2], one_hot[3], one_hot[4]);
  std::size_t position = 0;
  while (index[position] != 1)
    ++position;
  return position;
}

// One layer's cache tensor in a buffer of its own, with the strides a torch view would have.
struct Cache {
  std::uint32_t layout = 0;
  std::uint32_t elem = 0;
  std::vector<std::uint8_t> buffer;
  kvrelay_paged_tensor tensor{};

  Cache(std::uint32_t layout_value, std::uint32_t elem_size, Strides strides) : layout(layout_value), elem(elem_size) {
    const auto shape = layout_index(layout, 2, kBlocks, kBlockSize, kHeads, kHeadDim);
    // Physical extents: sliced heads allocate 2 extra heads and 3 extra dims, then view a slice.
    auto physical = shape;
    if (strides == Strides::kSlicedHeads) {
      const auto pad = layout_index(layout, 0, 0, 0, 2, 3);
      for (std::size_t axis = 0; axis < 5; ++axis)
        physical[axis] += pad[axis];
    }
    // Storage order of the shape's axes, outermost first.
    std::array<std::size_t, 5> order{0, 1, 2, 3, 4};
    if (strides == Strides::kPermuted) order = {4, 2, 0, 3, 1};
    if (strides == Strides::kSlotsOuter) {
      order = {axis_of(layout, 2), axis_of(layout, 0), axis_of(layout, 1), axis_of(layout, 3), axis_of(layout, 4)};
    }
    std::array<std::int64_t, 5> stride{};
    std::int64_t running = 1;
    for (std::size_t position = 5; position-- > 0;) {
      stride[order[position]] = running;
      running *= physical[order[position]];
    }
    buffer.assign(static_cast<std::size_t>(running) * elem, 0);
    tensor.struct_size = sizeof(kvrelay_paged_tensor);
    tensor.layout = layout;
    tensor.elem_size = elem;
    tensor.data = buffer.data();
    for (std::size_t axis = 0; axis < 5; ++axis) {
      tensor.shape[axis] = shape[axis];
      tensor.strides[axis] = stride[axis];
    }
  }

  [[nodiscard]] std::size_t offset(std::int64_t kv, std::int64_t block, std::int64_t slot, std::int64_t head,
                                   std::int64_t dim) const {
    const auto index = layout_index(layout, kv, block, slot, head, dim);
    std::int64_t element = 0;
    for (std::size_t axis = 0; axis < 5; ++axis)
      element += index[axis] * tensor.strides[axis];
    return static_cast<std::size_t>(element) * elem;
  }

  template <class Visit>
  void for_each(Visit&& visit) const {
    for (std::int64_t kv = 0; kv < 2; ++kv)
      for (std::int64_t block = 0; block < kBlocks; ++block)
        for (std::int64_t slot = 0; slot < kBlockSize; ++slot)
          for (std::int64_t head = 0; head < kHeads; ++head)
            for (std::int64_t dim = 0; dim < kHeadDim; ++dim)
              visit(kv, block, slot, head, dim);
  }

  void fill() {
    for_each([&](std::int64_t kv, std::int64_t block, std::int64_t slot, std::int64_t head, std::int64_t dim) {
      const std::uint32_t value = pattern(kv, block, slot, head, dim);
      std::memcpy(buffer.data() + offset(kv, block, slot, head, dim), &value, elem);
    });
  }

  [[nodiscard]] std::uint32_t at(std::int64_t kv, std::int64_t block, std::int64_t slot, std::int64_t head,
                                 std::int64_t dim) const {
    std::uint32_t value = 0;
    std::memcpy(&value, buffer.data() + offset(kv, block, slot, head, dim), elem);
    return value;
  }
};

std::uint32_t truncated(std::uint32_t value, std::uint32_t elem) {
  return elem == 4 ? value : value & ((1U << (8 * elem)) - 1);
}

std::uint32_t flat_at(const std::vector<std::uint8_t>& flat, std::uint32_t elem, std::uint64_t token, std::int64_t head,
                      std::int64_t dim) {
  std::uint32_t value = 0;
  const auto element = (static_cast<std::int64_t>(token) * kHeads + head) * kHeadDim + dim;
  std::memcpy(&value, flat.data() + static_cast<std::size_t>(element) * elem, elem);
  return value;
}

// The sequence: 5 blocks in a scrambled order; tokens 6..17 (first_token inside block 1).
const std::vector<std::int32_t> kBlockIds{5, 2, 6, 0, 3};
constexpr std::uint64_t kFirstToken = 6;
constexpr std::uint64_t kTokens = 12;

std::size_t flat_bytes(std::uint32_t elem) {
  return kTokens * kHeads * kHeadDim * elem;
}

const char* layout_name(std::uint32_t layout) {
  return layout == KVRELAY_PAGED_FLASH_ATTN ? "flash_attn" : layout == KVRELAY_PAGED_FLASHINFER ? "flashinfer" : "cpu";
}

void check_layout(std::uint32_t layout, std::uint32_t elem, Strides strides) {
  INFO("layout " << layout_name(layout) << ", elem " << elem << ", strides " << static_cast<int>(strides));
  Cache cache(layout, elem, strides);
  cache.fill();
  std::vector<std::uint8_t> k(flat_bytes(elem), 0xEE);
  std::vector<std::uint8_t> v(flat_bytes(elem), 0xEE);
  REQUIRE(kvrelay_paged_gather(&cache.tensor, kBlockIds.data(), kBlockIds.size(), kFirstToken, kTokens, k.data(),
                               v.data()) == KVRELAY_OK);
  std::size_t mismatches = 0;
  for (std::uint64_t token = 0; token < kTokens; ++token) {
    const std::uint64_t position = kFirstToken + token;
    const std::int64_t block = kBlockIds[position / kBlockSize];
    const auto slot = static_cast<std::int64_t>(position % kBlockSize);
    for (std::int64_t head = 0; head < kHeads; ++head) {
      for (std::int64_t dim = 0; dim < kHeadDim; ++dim) {
        mismatches += flat_at(k, elem, token, head, dim) != truncated(pattern(0, block, slot, head, dim), elem);
        mismatches += flat_at(v, elem, token, head, dim) != truncated(pattern(1, block, slot, head, dim), elem);
      }
    }
  }
  CHECK(mismatches == 0);

  // Scatter into a zeroed cache: exactly the sequence's slots change, to the gathered values.
  Cache target(layout, elem, strides);
  const std::vector<std::uint8_t> untouched = target.buffer;
  REQUIRE(kvrelay_paged_scatter(&target.tensor, kBlockIds.data(), kBlockIds.size(), kFirstToken, kTokens, k.data(),
                                v.data()) == KVRELAY_OK);
  std::vector<bool> in_sequence(static_cast<std::size_t>(kBlocks * kBlockSize), false);
  for (std::uint64_t position = kFirstToken; position < kFirstToken + kTokens; ++position) {
    in_sequence[static_cast<std::size_t>(kBlockIds[position / kBlockSize] * kBlockSize +
                                         static_cast<std::int64_t>(position % kBlockSize))] = true;
  }
  std::size_t wrong = 0;
  std::vector<bool> visited(target.buffer.size(), false);
  target.for_each([&](std::int64_t kv, std::int64_t block, std::int64_t slot, std::int64_t head, std::int64_t dim) {
    const std::uint32_t expected = in_sequence[static_cast<std::size_t>(block * kBlockSize + slot)]
                                       ? truncated(pattern(kv, block, slot, head, dim), elem)
                                       : 0;
    wrong += target.at(kv, block, slot, head, dim) != expected;
    for (std::uint32_t byte = 0; byte < elem; ++byte)
      visited[target.offset(kv, block, slot, head, dim) + byte] = true;
  });
  CHECK(wrong == 0);
  // Padding outside the view (sliced heads) stays zero.
  std::size_t padding_written = 0;
  for (std::size_t byte = 0; byte < target.buffer.size(); ++byte) {
    padding_written += !visited[byte] && target.buffer[byte] != untouched[byte];
  }
  CHECK(padding_written == 0);

  // Gather after scatter round-trips.
  std::vector<std::uint8_t> k_again(flat_bytes(elem), 0);
  std::vector<std::uint8_t> v_again(flat_bytes(elem), 0);
  REQUIRE(kvrelay_paged_gather(&target.tensor, kBlockIds.data(), kBlockIds.size(), kFirstToken, kTokens, k_again.data(),
                               v_again.data()) == KVRELAY_OK);
  CHECK(k_again == k);
  CHECK(v_again == v);
}

}  // namespace

TEST_CASE("paged gather and scatter match an independent index computation in every layout and element size",
          "[connectors][paged]") {
  for (const std::uint32_t layout : {KVRELAY_PAGED_FLASH_ATTN, KVRELAY_PAGED_FLASHINFER, KVRELAY_PAGED_CPU}) {
    for (const std::uint32_t elem : {1U, 2U, 4U})
      check_layout(layout, elem, Strides::kContiguous);
  }
}

TEST_CASE("paged copy follows the strides of sliced and permuted tensor views", "[connectors][paged]") {
  for (const std::uint32_t layout : {KVRELAY_PAGED_FLASH_ATTN, KVRELAY_PAGED_FLASHINFER, KVRELAY_PAGED_CPU}) {
    for (const std::uint32_t elem : {1U, 2U, 4U}) {
      check_layout(layout, elem, Strides::kSlicedHeads);
      check_layout(layout, elem, Strides::kSlotsOuter);
      check_layout(layout, elem, Strides::kPermuted);
    }
  }
}

TEST_CASE("paged copy of a whole block-aligned sequence and of no tokens", "[connectors][paged]") {
  Cache cache(KVRELAY_PAGED_FLASH_ATTN, 2, Strides::kContiguous);
  cache.fill();
  const std::vector<std::int32_t> blocks{4, 1};
  std::vector<std::uint8_t> k(8 * kHeads * kHeadDim * 2);
  std::vector<std::uint8_t> v(k.size());
  REQUIRE(kvrelay_paged_gather(&cache.tensor, blocks.data(), blocks.size(), 0, 8, k.data(), v.data()) == KVRELAY_OK);
  CHECK(flat_at(k, 2, 4, 2, 3) == truncated(pattern(0, 1, 0, 2, 3), 2));
  CHECK(flat_at(v, 2, 7, 0, 0) == truncated(pattern(1, 1, 3, 0, 0), 2));
  // No tokens needs no blocks and moves nothing.
  CHECK(kvrelay_paged_gather(&cache.tensor, nullptr, 0, 0, 0, k.data(), v.data()) == KVRELAY_OK);
  CHECK(std::string(kvrelay_paged_last_error()).empty());
  CHECK(kvrelay_paged_abi_version() == KVRELAY_PAGED_ABI_VERSION);
}

TEST_CASE("paged copy refuses bad inputs with their codes and touches nothing", "[connectors][paged]") {
  for (const bool scatter : {false, true}) {
    INFO((scatter ? "scatter" : "gather"));
    Cache cache(KVRELAY_PAGED_FLASH_ATTN, 2, Strides::kContiguous);
    cache.fill();
    const std::vector<std::uint8_t> cache_before = cache.buffer;
    std::vector<std::uint8_t> k(flat_bytes(2), 0xAB);
    std::vector<std::uint8_t> v(flat_bytes(2), 0xCD);
    const std::vector<std::uint8_t> k_before = k;
    const std::vector<std::uint8_t> v_before = v;
    const auto call = [&](const kvrelay_paged_tensor* tensor, const std::vector<std::int32_t>& ids, std::uint64_t first,
                          std::uint64_t tokens, void* k_ptr, void* v_ptr) {
      return scatter ? kvrelay_paged_scatter(tensor, ids.data(), ids.size(), first, tokens, k_ptr, v_ptr)
                     : kvrelay_paged_gather(tensor, ids.data(), ids.size(), first, tokens, k_ptr, v_ptr);
    };
    const auto expect_refused = [&](int code, const kvrelay_paged_tensor& tensor, const std::vector<std::int32_t>& ids,
                                    std::uint64_t first, std::uint64_t tokens, void* k_ptr, void* v_ptr) {
      CHECK(call(&tensor, ids, first, tokens, k_ptr, v_ptr) == code);
      CHECK_FALSE(std::string(kvrelay_paged_last_error()).empty());
      CHECK(cache.buffer == cache_before);
      CHECK(k == k_before);
      CHECK(v == v_before);
    };
    const kvrelay_paged_tensor good = cache.tensor;

    SECTION("a block id out of range, after good ones") {
      expect_refused(KVRELAY_E_OUT_OF_RANGE, good, {5, 2, 6, 0, 7}, kFirstToken, kTokens, k.data(), v.data());
      expect_refused(KVRELAY_E_OUT_OF_RANGE, good, {5, 2, -1, 0, 3}, kFirstToken, kTokens, k.data(), v.data());
    }
    SECTION("too few block ids") {
      expect_refused(KVRELAY_E_OUT_OF_RANGE, good, {5, 2, 6, 0}, kFirstToken, kTokens, k.data(), v.data());
    }
    SECTION("a wrong struct_size, layout, reserved field or element size") {
      kvrelay_paged_tensor bad = good;
      bad.struct_size = sizeof(kvrelay_paged_tensor) - 8;
      expect_refused(KVRELAY_E_INVALID_ARGUMENT, bad, kBlockIds, kFirstToken, kTokens, k.data(), v.data());
      bad = good;
      bad.layout = 4;
      expect_refused(KVRELAY_E_INVALID_ARGUMENT, bad, kBlockIds, kFirstToken, kTokens, k.data(), v.data());
      bad = good;
      bad.reserved = 1;
      expect_refused(KVRELAY_E_INVALID_ARGUMENT, bad, kBlockIds, kFirstToken, kTokens, k.data(), v.data());
      bad = good;
      bad.elem_size = 3;
      expect_refused(KVRELAY_E_INVALID_ARGUMENT, bad, kBlockIds, kFirstToken, kTokens, k.data(), v.data());
    }
    SECTION("a bad shape or stride") {
      kvrelay_paged_tensor bad = good;
      bad.shape[0] = 3;  // K and V are two
      expect_refused(KVRELAY_E_INVALID_ARGUMENT, bad, kBlockIds, kFirstToken, kTokens, k.data(), v.data());
      bad = good;
      bad.shape[3] = 0;
      expect_refused(KVRELAY_E_INVALID_ARGUMENT, bad, kBlockIds, kFirstToken, kTokens, k.data(), v.data());
      bad = good;
      bad.strides[2] = -bad.strides[2];
      expect_refused(KVRELAY_E_INVALID_ARGUMENT, bad, kBlockIds, kFirstToken, kTokens, k.data(), v.data());
    }
    SECTION("overflowing shapes and spans") {
      kvrelay_paged_tensor bad = good;
      bad.shape[1] = std::int64_t{1} << 62;
      expect_refused(KVRELAY_E_OVERFLOW, bad, kBlockIds, kFirstToken, kTokens, k.data(), v.data());
      bad = good;
      bad.shape[3] = std::int64_t{1} << 40;  // heads never stepped through (stride 0), row still too wide
      bad.shape[4] = std::int64_t{1} << 40;
      bad.strides[3] = 0;
      bad.strides[4] = 0;
      expect_refused(KVRELAY_E_OVERFLOW, bad, kBlockIds, kFirstToken, kTokens, k.data(), v.data());
      expect_refused(KVRELAY_E_OVERFLOW, good, kBlockIds, UINT64_MAX - 2, kTokens, k.data(), v.data());
      expect_refused(KVRELAY_E_OVERFLOW, good, kBlockIds, 0, UINT64_MAX / 4, k.data(), v.data());
    }
    SECTION("null pointers") {
      CHECK(call(nullptr, kBlockIds, kFirstToken, kTokens, k.data(), v.data()) == KVRELAY_E_INVALID_ARGUMENT);
      expect_refused(KVRELAY_E_INVALID_ARGUMENT, good, kBlockIds, kFirstToken, kTokens, nullptr, v.data());
      expect_refused(KVRELAY_E_INVALID_ARGUMENT, good, kBlockIds, kFirstToken, kTokens, k.data(), nullptr);
      kvrelay_paged_tensor bad = good;
      bad.data = nullptr;
      expect_refused(KVRELAY_E_INVALID_ARGUMENT, bad, kBlockIds, kFirstToken, kTokens, k.data(), v.data());
      CHECK((scatter ? kvrelay_paged_scatter(&good, nullptr, 5, kFirstToken, kTokens, k.data(), v.data())
                     : kvrelay_paged_gather(&good, nullptr, 5, kFirstToken, kTokens, k.data(), v.data())) ==
            KVRELAY_E_INVALID_ARGUMENT);
      CHECK(cache.buffer == cache_before);
    }
  }
}

TEST_CASE("the C++ paged API reports kvrelay error codes", "[connectors][paged]") {
  Cache cache(KVRELAY_PAGED_CPU, 4, Strides::kContiguous);
  cache.fill();
  kvrelay::connectors::PagedTensorView view;
  view.layout = kvrelay::connectors::PagedLayout::kCpu;
  view.elem_size = 4;
  view.data = cache.buffer.data();
  for (std::size_t axis = 0; axis < 5; ++axis) {
    view.shape[axis] = cache.tensor.shape[axis];
    view.strides[axis] = cache.tensor.strides[axis];
  }
  std::vector<std::uint8_t> k(flat_bytes(4));
  std::vector<std::uint8_t> v(flat_bytes(4));
  const std::vector<std::int32_t> too_high{5, 2, 6, 0, 9};
  const auto refused = kvrelay::connectors::gather_paged(view, {too_high, kFirstToken, kTokens}, k.data(), v.data());
  REQUIRE_FALSE(refused);
  CHECK(refused.error().code == kvrelay::ErrorCode::kOutOfRange);
  CHECK(kvrelay::connectors::gather_paged(view, {kBlockIds, kFirstToken, kTokens}, k.data(), v.data()));
  CHECK(flat_at(k, 4, 0, 1, 2) == pattern(0, 2, 2, 1, 2));
}

TEST_CASE("an fp8 layout's region is exactly what paged gathers of 1-byte elements fill", "[connectors][paged]") {
  // Two layers of one fp8 cache shape gathered into one region at the layout's tensor offsets.
  const kvrelay::KvLayout layout{2, static_cast<std::uint32_t>(kHeads), static_cast<std::uint32_t>(kHeadDim),
                                 kvrelay::DType::kFp8E4M3, kTokens};
  const std::uint64_t total = layout.total_bytes().value();
  CHECK(total == 2ULL * 2 * kTokens * kHeads * kHeadDim * 1);
  CHECK(layout.tensor_bytes().value() == flat_bytes(1));
  std::vector<Cache> layers;
  layers.reserve(2);
  for (int layer = 0; layer < 2; ++layer) {
    layers.emplace_back(KVRELAY_PAGED_FLASH_ATTN, 1, Strides::kContiguous);
    layers.back().fill();
    for (auto& byte : layers.back().buffer)
      byte = static_cast<std::uint8_t>(byte + layer * 29);  // layers differ
  }
  constexpr std::uint8_t kCanary = 0xA5;
  std::vector<std::uint8_t> region(total + 1, kCanary);
  for (std::uint32_t layer = 0; layer < 2; ++layer) {
    std::uint8_t* k = region.data() + layout.tensor_offset(layer, false).value();
    std::uint8_t* v = region.data() + layout.tensor_offset(layer, true).value();
    REQUIRE(kvrelay_paged_gather(&layers[layer].tensor, kBlockIds.data(), kBlockIds.size(), kFirstToken, kTokens, k,
                                 v) == KVRELAY_OK);
  }
  CHECK(region[total] == kCanary);  // nothing past the layout's size
  std::size_t mismatches = 0;
  for (std::uint32_t layer = 0; layer < 2; ++layer) {
    for (std::uint64_t token = 0; token < kTokens; ++token) {
      const std::uint64_t position = kFirstToken + token;
      const std::int64_t block = kBlockIds[position / kBlockSize];
      const auto slot = static_cast<std::int64_t>(position % kBlockSize);
      for (std::int64_t head = 0; head < kHeads; ++head) {
        for (std::int64_t dim = 0; dim < kHeadDim; ++dim) {
          const std::size_t element =
              static_cast<std::size_t>((static_cast<std::int64_t>(token) * kHeads + head) * kHeadDim + dim);
          for (const bool is_value : {false, true}) {
            const auto at = static_cast<std::size_t>(layout.tensor_offset(layer, is_value).value()) + element;
            mismatches += region[at] != layers[layer].at(is_value ? 1 : 0, block, slot, head, dim);
          }
        }
      }
    }
  }
  CHECK(mismatches == 0);
}
