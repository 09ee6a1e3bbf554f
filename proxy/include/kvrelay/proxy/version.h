#pragma once

namespace kvrelay::proxy {

inline constexpr const char* kVersion = KVRELAY_VERSION_STRING;

}  // namespace kvrelay::proxy
