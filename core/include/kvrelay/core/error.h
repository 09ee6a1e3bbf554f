#pragma once

#include <cstdint>
#include <string>
#include <string_view>

namespace kvrelay {

// One enum for every data-path failure, so codes can cross the C ABI and show up in metrics
// by name. New codes are appended; values never change once released.
enum class ErrorCode : std::uint16_t {
  kOk = 0,
  kInvalidArgument,
  kOverflow,
  kOutOfRange,
  kTruncated,
  kBadMagic,
  kBadVersion,
  kUnknownCodec,
  kLayoutMismatch,
  kChecksumMismatch,
  kCorrupt,
  kNotFound,
  kAlreadyExists,
  kPermissionDenied,
  kResourceExhausted,
  kTimeout,
  kIo,
  kProtocol,
  kUnsupported,
  kCancelled,
  kInternal,
  kChainMismatch,  // KV whose token ids do not hash to the key it is filed under
};

// Stable lower_snake name, used in logs, metrics labels and CLI exit messages.
[[nodiscard]] std::string_view error_code_name(ErrorCode code) noexcept;

struct Error {
  ErrorCode code = ErrorCode::kInternal;
  std::string message;

  // "checksum_mismatch: frame payload checksum 0x12 != 0x34"
  [[nodiscard]] std::string to_string() const;
};

[[nodiscard]] inline Error make_error(ErrorCode code, std::string message) {
  return Error{code, std::move(message)};
}

}  // namespace kvrelay
