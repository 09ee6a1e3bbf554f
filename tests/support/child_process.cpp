#include "support/child_process.h"

#include <fcntl.h>
#include <signal.h>
#include <spawn.h>
#include <sys/wait.h>
#include <unistd.h>

#include <atomic>
#include <ctime>
#include <stdexcept>

#include "support/test_paths.h"

extern char** environ;

namespace kvrelay::test {

namespace {

int decode_status(int status) {
  if (WIFEXITED(status)) return WEXITSTATUS(status);
  if (WIFSIGNALED(status)) return 128 + WTERMSIG(status);
  return -1;
}

}  // namespace

ChildProcess::ChildProcess(std::vector<std::string> argv, const std::filesystem::path& log_dir,
                           std::vector<std::string> extra_env) {
  static std::atomic<unsigned> counter{0};
  const auto tag = std::filesystem::path(argv.at(0)).filename().string() + "-" + std::to_string(counter.fetch_add(1));
  stdout_path_ = log_dir / (tag + ".out");
  stderr_path_ = log_dir / (tag + ".err");

  posix_spawn_file_actions_t actions;
  posix_spawn_file_actions_init(&actions);
  posix_spawn_file_actions_addopen(&actions, 0, "/dev/null", O_RDONLY, 0);
  posix_spawn_file_actions_addopen(&actions, 1, stdout_path_.c_str(), O_WRONLY | O_CREAT | O_TRUNC, 0644);
  posix_spawn_file_actions_addopen(&actions, 2, stderr_path_.c_str(), O_WRONLY | O_CREAT | O_TRUNC, 0644);

  std::vector<char*> args;
  for (auto& arg : argv)
    args.push_back(arg.data());
  args.push_back(nullptr);
  std::vector<std::string> env_storage;
  for (char** entry = environ; *entry != nullptr; ++entry)
    env_storage.emplace_back(*entry);
  for (auto& entry : extra_env)
    env_storage.push_back(std::move(entry));
  std::vector<char*> env;
  for (auto& entry : env_storage)
    env.push_back(entry.data());
  env.push_back(nullptr);

  const int rc = posix_spawn(&pid_, args[0], &actions, nullptr, args.data(), env.data());
  posix_spawn_file_actions_destroy(&actions);
  if (rc != 0) throw std::runtime_error("posix_spawn " + argv[0] + " failed: " + std::to_string(rc));
}

ChildProcess::~ChildProcess() {
  if (pid_ > 0 && !exit_status_) {
    ::kill(pid_, SIGKILL);
    int status = 0;
    ::waitpid(pid_, &status, 0);
  }
}

void ChildProcess::send_signal(int signal_number) const {
  if (pid_ > 0) ::kill(pid_, signal_number);
}

std::optional<int> ChildProcess::wait_for_exit(std::chrono::milliseconds timeout) {
  if (exit_status_) return exit_status_;
  const bool exited = wait_until(
      [&] {
        int status = 0;
        const pid_t result = ::waitpid(pid_, &status, WNOHANG);
        if (result == pid_) exit_status_ = decode_status(status);
        return exit_status_.has_value();
      },
      timeout);
  return exited ? exit_status_ : std::nullopt;
}

bool ChildProcess::running() {
  return !wait_for_exit(std::chrono::milliseconds(0)).has_value();
}

std::string ChildProcess::stdout_text() const {
  return read_file(stdout_path_);
}
std::string ChildProcess::stderr_text() const {
  return read_file(stderr_path_);
}

CommandResult run_command(std::vector<std::string> argv, const std::filesystem::path& log_dir,
                          std::chrono::milliseconds timeout) {
  ChildProcess child(std::move(argv), log_dir);
  CommandResult result;
  const auto status = child.wait_for_exit(timeout);
  result.exit_status = status.value_or(-1);
  result.out = child.stdout_text();
  result.err = child.stderr_text();
  return result;
}

}  // namespace kvrelay::test
