#pragma once

// A kvrelay-refworker serving in its own process, found through its ready file. Header-only so
// end-to-end tests of any folder can start workers without linking the engine.

#include <nlohmann/json.hpp>

#include <chrono>
#include <cstdlib>
#include <filesystem>
#include <memory>
#include <stdexcept>
#include <string>
#include <vector>

#include "support/child_process.h"
#include "support/test_paths.h"

namespace kvrelay::test {

// $KVRELAY_REFWORKER_BIN, else the build tree's refworker/kvrelay-refworker.
inline std::filesystem::path refworker_binary() {
  if (const char* override_path = std::getenv("KVRELAY_REFWORKER_BIN")) return override_path;
  return binary_dir() / "refworker" / "kvrelay-refworker";
}

class RefworkerUnderTest {
 public:
  // `model_args`: {"--model", path} or {"--synthetic", shape, "--seed", n}; `extra_args` follow.
  explicit RefworkerUnderTest(const std::vector<std::string>& model_args, const std::vector<std::string>& extra_args = {},
                              std::chrono::milliseconds startup = std::chrono::seconds(60)) {
    std::vector<std::string> argv{refworker_binary().string(), "serve"};
    argv.insert(argv.end(), model_args.begin(), model_args.end());
    argv.insert(argv.end(), {"--ready-file", (dir_ / "ready.json").string()});
    argv.insert(argv.end(), extra_args.begin(), extra_args.end());
    process_ = std::make_unique<ChildProcess>(argv, dir_.path());
    wait_until([&] { return std::filesystem::exists(dir_ / "ready.json") || !process_->running(); }, startup);
    if (!std::filesystem::exists(dir_ / "ready.json")) {
      throw std::runtime_error("refworker did not start: " + process_->stderr_text());
    }
    ready_ = nlohmann::json::parse(read_file(dir_ / "ready.json"));
    port_ = ready_["http"].get<std::uint16_t>();
  }

  [[nodiscard]] std::uint16_t port() const { return port_; }
  [[nodiscard]] const nlohmann::json& ready() const { return ready_; }
  [[nodiscard]] ChildProcess& process() { return *process_; }

 private:
  TempDir dir_;
  std::unique_ptr<ChildProcess> process_;
  nlohmann::json ready_;
  std::uint16_t port_ = 0;
};

}  // namespace kvrelay::test
