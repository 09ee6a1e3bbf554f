#pragma once

// `kvrelay serve` in a child process for the benchmarks, on kernel-chosen ports found through its
// ready file (as tests/support/daemon_fixture.h starts one): its output goes to daemon.log in
// `dir`; SIGTERM (a drain), then SIGKILL, on destruction.

#include <fcntl.h>
#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <nlohmann/json.hpp>

#include <chrono>
#include <filesystem>
#include <fstream>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

namespace kvrelay::bench {

inline std::string read_text(const std::filesystem::path& path) {
  std::ifstream in(path);
  std::stringstream text;
  text << in.rdbuf();
  return text.str();
}

class DaemonProcess {
 public:
  // Ready once its ready file names every listener in `listeners` ("peer", "admin", ...).
  DaemonProcess(const std::string& binary, const std::filesystem::path& dir, const nlohmann::json& policy,
                std::vector<std::string> listeners = {"peer"})
      : dir_(dir), listeners_(std::move(listeners)) {
    std::filesystem::create_directories(dir_);
    std::ofstream(dir_ / "policy.json") << policy.dump(2);
    std::filesystem::remove(dir_ / "ready.json");
    const std::string config = (dir_ / "policy.json").string();
    const std::string ready_file = (dir_ / "ready.json").string();
    const std::string log = (dir_ / "daemon.log").string();
    pid_ = ::fork();
    if (pid_ == 0) {
      const int out = ::open(log.c_str(), O_WRONLY | O_CREAT | O_TRUNC, 0600);
      if (out >= 0) {
        ::dup2(out, STDOUT_FILENO);
        ::dup2(out, STDERR_FILENO);
      }
      ::execl(binary.c_str(), binary.c_str(), "serve", "--config", config.c_str(), "--ready-file", ready_file.c_str(),
              static_cast<char*>(nullptr));
      std::perror("exec kvrelay");
      ::_exit(127);
    }
    const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(30);
    while (std::chrono::steady_clock::now() < deadline) {
      int status = 0;
      if (::waitpid(pid_, &status, WNOHANG) == pid_) {
        pid_ = -1;
        return;
      }
      if (std::filesystem::exists(dir_ / "ready.json")) {
        // Written once listening; parse until it is complete.
        try {
          ready_ = nlohmann::json::parse(read_text(dir_ / "ready.json"));
          if (ready()) return;
        } catch (const nlohmann::json::exception&) {
        }
      }
      std::this_thread::sleep_for(std::chrono::milliseconds(20));
    }
  }
  DaemonProcess(const DaemonProcess&) = delete;
  DaemonProcess& operator=(const DaemonProcess&) = delete;
  ~DaemonProcess() {
    if (pid_ <= 0) return;
    ::kill(pid_, SIGTERM);
    for (int wait = 0; wait < 500; ++wait) {
      int status = 0;
      if (::waitpid(pid_, &status, WNOHANG) == pid_) return;
      std::this_thread::sleep_for(std::chrono::milliseconds(10));
    }
    ::kill(pid_, SIGKILL);
    int status = 0;
    ::waitpid(pid_, &status, 0);
  }

  [[nodiscard]] bool ready() const {
    if (pid_ <= 0) return false;
    for (const auto& listener : listeners_)
      if (!ready_.contains(listener)) return false;
    return true;
  }
  [[nodiscard]] std::uint16_t port(const std::string& listener) const {
    return ready_.value(listener, std::uint16_t{0});
  }
  [[nodiscard]] std::uint16_t peer_port() const { return port("peer"); }
  [[nodiscard]] std::string log() const { return read_text(dir_ / "daemon.log"); }
  [[nodiscard]] pid_t pid() const { return pid_; }

 private:
  std::filesystem::path dir_;
  std::vector<std::string> listeners_;
  pid_t pid_ = -1;
  nlohmann::json ready_;
};

}  // namespace kvrelay::bench
