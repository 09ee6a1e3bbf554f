#include "support/test_paths.h"

#include <unistd.h>

#include <atomic>
#include <cstdlib>
#include <fstream>
#include <sstream>
#include <stdexcept>

namespace kvrelay::test {

std::filesystem::path source_dir() {
  return KVRELAY_SOURCE_DIR;
}
std::filesystem::path binary_dir() {
  return KVRELAY_BINARY_DIR;
}

std::filesystem::path kvrelay_binary() {
  if (const char* override_path = std::getenv("KVRELAY_BIN")) return override_path;
  return binary_dir() / "proxy" / "kvrelay";
}

std::optional<std::filesystem::path> stories_model_path() {
  if (const char* override_path = std::getenv("KVRELAY_TEST_MODEL")) {
    if (std::filesystem::exists(override_path)) return std::filesystem::path(override_path);
    return std::nullopt;
  }
  const auto beside = source_dir().parent_path() / "shared" / "models" / "stories260K.bin";
  if (std::filesystem::exists(beside)) return beside;
  return std::nullopt;
}

TempDir::TempDir() {
  static std::atomic<unsigned> counter{0};
  // $KVRELAY_TEST_TMPDIR: test binaries run outside their build tree (scripts/gpu-check.sh).
  const char* override_root = std::getenv("KVRELAY_TEST_TMPDIR");
  const std::filesystem::path root =
      override_root != nullptr ? std::filesystem::path(override_root) : binary_dir() / "test-tmp";
  path_ = root / ("t" + std::to_string(::getpid()) + "-" + std::to_string(counter.fetch_add(1)));
  std::filesystem::remove_all(path_);
  std::filesystem::create_directories(path_);
}

TempDir::~TempDir() {
  std::error_code ignored;
  std::filesystem::remove_all(path_, ignored);
}

void write_file(const std::filesystem::path& path, const std::string& contents) {
  std::ofstream file(path, std::ios::binary | std::ios::trunc);
  file << contents;
  if (!file) throw std::runtime_error("cannot write " + path.string());
}

std::string read_file(const std::filesystem::path& path) {
  std::ifstream file(path, std::ios::binary);
  if (!file) throw std::runtime_error("cannot read " + path.string());
  std::ostringstream contents;
  contents << file.rdbuf();
  return contents.str();
}

}  // namespace kvrelay::test
