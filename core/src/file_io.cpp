#include "kvrelay/core/file_io.h"

#include <fmt/format.h>

#include <filesystem>
#include <fstream>

namespace kvrelay {

Status write_file_atomically(const std::string& path, std::string_view contents) {
  const std::string temporary = path + ".tmp";
  {
    std::ofstream file(temporary, std::ios::binary | std::ios::trunc);
    file.write(contents.data(), static_cast<std::streamsize>(contents.size()));
    if (!file) return fail(ErrorCode::kIo, fmt::format("cannot write {}", temporary));
  }
  std::error_code ec;
  std::filesystem::rename(temporary, path, ec);
  if (ec) return fail(ErrorCode::kIo, fmt::format("cannot rename {} to {}: {}", temporary, path, ec.message()));
  return ok();
}

}  // namespace kvrelay
