#pragma once

#include <filesystem>
#include <optional>
#include <string>

namespace kvrelay::test {

// Source and build trees, fixed at configure time.
[[nodiscard]] std::filesystem::path source_dir();
[[nodiscard]] std::filesystem::path binary_dir();

// The kvrelay binary under test ($KVRELAY_BIN overrides).
[[nodiscard]] std::filesystem::path kvrelay_binary();

// The trained stories260K checkpoint: $KVRELAY_TEST_MODEL, else ../shared/models beside the
// source tree. nullopt when absent, so tests can SKIP rather than fail.
[[nodiscard]] std::optional<std::filesystem::path> stories_model_path();

// A fresh empty directory under the build tree, removed by the destructor.
class TempDir {
 public:
  TempDir();
  ~TempDir();
  TempDir(const TempDir&) = delete;
  TempDir& operator=(const TempDir&) = delete;
  [[nodiscard]] const std::filesystem::path& path() const { return path_; }
  [[nodiscard]] std::filesystem::path operator/(const std::string& name) const { return path_ / name; }

 private:
  std::filesystem::path path_;
};

void write_file(const std::filesystem::path& path, const std::string& contents);
[[nodiscard]] std::string read_file(const std::filesystem::path& path);

}  // namespace kvrelay::test
