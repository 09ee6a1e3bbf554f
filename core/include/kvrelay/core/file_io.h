#pragma once

#include <string>
#include <string_view>

#include "kvrelay/core/result.h"

namespace kvrelay {

// Writes `contents` to `path` through a temporary file and a rename, so a reader polling for the
// file (a supervisor waiting for a ready file) never sees it half written.
[[nodiscard]] Status write_file_atomically(const std::string& path, std::string_view contents);

}  // namespace kvrelay
