#pragma once

#include <sys/types.h>

#include <chrono>
#include <filesystem>
#include <optional>
#include <string>
#include <vector>

namespace kvrelay::test {

// A real child process for end-to-end tests: stdout and stderr go to files so a failing test
// can print them; the destructor kills whatever is still running.
class ChildProcess {
 public:
  ChildProcess(std::vector<std::string> argv, const std::filesystem::path& log_dir,
               std::vector<std::string> extra_env = {});
  ~ChildProcess();
  ChildProcess(const ChildProcess&) = delete;
  ChildProcess& operator=(const ChildProcess&) = delete;

  [[nodiscard]] pid_t pid() const { return pid_; }
  void send_signal(int signal_number) const;
  // Exit status (or 128 + signal) once exited; nullopt if still running after `timeout`.
  std::optional<int> wait_for_exit(std::chrono::milliseconds timeout);
  [[nodiscard]] bool running();
  [[nodiscard]] std::string stdout_text() const;
  [[nodiscard]] std::string stderr_text() const;

 private:
  pid_t pid_ = -1;
  std::optional<int> exit_status_;
  std::filesystem::path stdout_path_;
  std::filesystem::path stderr_path_;
};

// Runs a command to completion and returns {exit status, stdout, stderr}.
struct CommandResult {
  int exit_status = -1;
  std::string out;
  std::string err;
};
[[nodiscard]] CommandResult run_command(std::vector<std::string> argv, const std::filesystem::path& log_dir,
                                        std::chrono::milliseconds timeout = std::chrono::seconds(60));

// Polls `condition` every 10 ms until it holds or `timeout` passes.
template <class Condition>
bool wait_until(Condition condition, std::chrono::milliseconds timeout) {
  const auto deadline = std::chrono::steady_clock::now() + timeout;
  while (std::chrono::steady_clock::now() < deadline) {
    if (condition()) return true;
    struct timespec pause {
      0, 10'000'000
    };
    nanosleep(&pause, nullptr);
  }
  return condition();
}

}  // namespace kvrelay::test
