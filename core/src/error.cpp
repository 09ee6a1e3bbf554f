#include "kvrelay/core/error.h"

namespace kvrelay {

std::string_view error_code_name(ErrorCode code) noexcept {
  switch (code) {
    case ErrorCode::kOk:
      return "ok";
    case ErrorCode::kInvalidArgument:
      return "invalid_argument";
    case ErrorCode::kOverflow:
      return "overflow";
    case ErrorCode::kOutOfRange:
      return "out_of_range";
    case ErrorCode::kTruncated:
      return "truncated";
    case ErrorCode::kBadMagic:
      return "bad_magic";
    case ErrorCode::kBadVersion:
      return "bad_version";
    case ErrorCode::kUnknownCodec:
      return "unknown_codec";
    case ErrorCode::kLayoutMismatch:
      return "layout_mismatch";
    case ErrorCode::kChecksumMismatch:
      return "checksum_mismatch";
    case ErrorCode::kCorrupt:
      return "corrupt";
    case ErrorCode::kNotFound:
      return "not_found";
    case ErrorCode::kAlreadyExists:
      return "already_exists";
    case ErrorCode::kPermissionDenied:
      return "permission_denied";
    case ErrorCode::kResourceExhausted:
      return "resource_exhausted";
    case ErrorCode::kTimeout:
      return "timeout";
    case ErrorCode::kIo:
      return "io";
    case ErrorCode::kProtocol:
      return "protocol";
    case ErrorCode::kUnsupported:
      return "unsupported";
    case ErrorCode::kCancelled:
      return "cancelled";
    case ErrorCode::kInternal:
      return "internal";
    case ErrorCode::kChainMismatch:
      return "chain_mismatch";
  }
  return "unknown_error";
}

std::string Error::to_string() const {
  std::string text(error_code_name(code));
  if (!message.empty()) {
    text += ": ";
    text += message;
  }
  return text;
}

}  // namespace kvrelay
