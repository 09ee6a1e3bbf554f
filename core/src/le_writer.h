#pragma once

#include <bit>
#include <cstdint>
#include <cstring>
#include <string_view>
#include <vector>

namespace kvrelay::detail {

static_assert(std::endian::native == std::endian::little, "kvrelay's canonical encodings assume a little-endian host");

// Appends fixed-width little-endian fields to a byte buffer for hashing.
class LeWriter {
 public:
  template <class Int>
  void put(Int value) {
    const auto offset = bytes_.size();
    bytes_.resize(offset + sizeof(Int));
    std::memcpy(bytes_.data() + offset, &value, sizeof(Int));
  }
  void put_string(std::string_view text) {
    put(static_cast<std::uint32_t>(text.size()));
    bytes_.insert(bytes_.end(), text.begin(), text.end());
  }
  [[nodiscard]] const std::vector<char>& bytes() const { return bytes_; }

 private:
  std::vector<char> bytes_;
};

}  // namespace kvrelay::detail
