#pragma once

// Little-endian field writer and bounds-checked reader for kvrelay's binary protocols.
// The reader never reads past its span: every get reports truncation instead.

#include <bit>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <optional>
#include <span>
#include <string>
#include <string_view>
#include <type_traits>
#include <vector>

namespace kvrelay {

static_assert(std::endian::native == std::endian::little, "wire formats assume a little-endian host");

class ByteWriter {
 public:
  template <class Int>
  requires std::is_integral_v<Int> ByteWriter& put(Int value) {
    const auto offset = bytes_.size();
    bytes_.resize(offset + sizeof(Int));
    std::memcpy(bytes_.data() + offset, &value, sizeof(Int));
    return *this;
  }
  ByteWriter& put_bytes(std::span<const std::byte> data) {
    bytes_.insert(bytes_.end(), data.begin(), data.end());
    return *this;
  }
  ByteWriter& put_string(std::string_view text) {
    put(static_cast<std::uint16_t>(text.size()));
    put_bytes(std::as_bytes(std::span(text.data(), text.size())));
    return *this;
  }
  // Overwrites an already written field (lengths known only at the end).
  template <class Int>
  void patch(std::size_t offset, Int value) {
    std::memcpy(bytes_.data() + offset, &value, sizeof(Int));
  }
  [[nodiscard]] std::size_t size() const { return bytes_.size(); }
  [[nodiscard]] const std::vector<std::byte>& bytes() const { return bytes_; }
  [[nodiscard]] std::vector<std::byte> take() { return std::move(bytes_); }

 private:
  std::vector<std::byte> bytes_;
};

// Reads fields in order. A read that runs past the end fails, and so does every read after it:
// decoders may check only a message's last field, because a shorter field cannot succeed
// after a longer one failed and hand back bytes from the wrong offset.
class ByteReader {
 public:
  explicit ByteReader(std::span<const std::byte> data) : data_(data) {}

  template <class Int>
  requires std::is_integral_v<Int>
  [[nodiscard]] std::optional<Int> get() {
    if (failed_ || data_.size() - offset_ < sizeof(Int)) {
      failed_ = true;
      return std::nullopt;
    }
    Int value{};
    std::memcpy(&value, data_.data() + offset_, sizeof(Int));
    offset_ += sizeof(Int);
    return value;
  }
  [[nodiscard]] std::optional<std::span<const std::byte>> get_bytes(std::size_t count) {
    if (failed_ || data_.size() - offset_ < count) {
      failed_ = true;
      return std::nullopt;
    }
    auto view = data_.subspan(offset_, count);
    offset_ += count;
    return view;
  }
  [[nodiscard]] std::optional<std::string> get_string() {
    const auto length = get<std::uint16_t>();
    if (!length) return std::nullopt;
    const auto view = get_bytes(*length);
    if (!view) return std::nullopt;
    return std::string(reinterpret_cast<const char*>(view->data()), view->size());
  }
  [[nodiscard]] std::size_t remaining() const { return data_.size() - offset_; }
  [[nodiscard]] bool failed() const { return failed_; }

 private:
  std::span<const std::byte> data_;
  std::size_t offset_ = 0;
  bool failed_ = false;
};

}  // namespace kvrelay
