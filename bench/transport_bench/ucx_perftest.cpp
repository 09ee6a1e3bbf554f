#include "ucx_perftest.h"

#include <fcntl.h>
#include <netinet/in.h>
#include <signal.h>
#include <spawn.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include <charconv>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <sstream>
#include <thread>

#include "common/daemon_process.h"

extern char** environ;  // NOLINT(readability-redundant-declaration): POSIX declares it nowhere

namespace kvrelay::bench {

namespace ucx_perftest_detail {

bool is_executable(const std::string& path) {
  struct stat status {};
  return !path.empty() && ::stat(path.c_str(), &status) == 0 && S_ISREG(status.st_mode) &&
         ::access(path.c_str(), X_OK) == 0;
}

// This process's environment without its UCX_ variables (UcxContext::create sets some), plus UCX_TLS.
std::vector<std::string> perftest_environment(const std::string& tls) {
  std::vector<std::string> entries;
  for (char** entry = environ; entry != nullptr && *entry != nullptr; ++entry) {
    if (std::strncmp(*entry, "UCX_", 4) != 0) entries.emplace_back(*entry);
  }
  entries.push_back("UCX_TLS=" + tls);
  return entries;
}

std::vector<char*> c_strings(std::vector<std::string>& strings) {
  std::vector<char*> pointers;
  pointers.reserve(strings.size() + 1);
  for (auto& text : strings)
    pointers.push_back(text.data());
  pointers.push_back(nullptr);
  return pointers;
}

// Started with stdout and stderr in `log`; -1 when it could not be.
pid_t spawn_logged(std::vector<std::string> argv, std::vector<std::string> environment,
                   const std::filesystem::path& log) {
  posix_spawn_file_actions_t actions;
  if (::posix_spawn_file_actions_init(&actions) != 0) return -1;
  ::posix_spawn_file_actions_addopen(&actions, STDOUT_FILENO, log.c_str(), O_WRONLY | O_CREAT | O_TRUNC, 0600);
  ::posix_spawn_file_actions_adddup2(&actions, STDOUT_FILENO, STDERR_FILENO);
  auto arguments = c_strings(argv);
  auto variables = c_strings(environment);
  pid_t pid = -1;
  const int spawned = ::posix_spawn(&pid, arguments[0], &actions, nullptr, arguments.data(), variables.data());
  ::posix_spawn_file_actions_destroy(&actions);
  return spawned == 0 ? pid : -1;
}

// Its wait status once it exited by `deadline`; nullopt while it still runs then.
std::optional<int> wait_until(pid_t pid, std::chrono::steady_clock::time_point deadline) {
  while (true) {
    int status = 0;
    if (::waitpid(pid, &status, WNOHANG) == pid) return status;
    if (std::chrono::steady_clock::now() >= deadline) return std::nullopt;
    std::this_thread::sleep_for(std::chrono::milliseconds(2));
  }
}

void kill_and_reap(pid_t pid) {
  ::kill(pid, SIGKILL);
  int status = 0;
  ::waitpid(pid, &status, 0);
}

// A TCP port nothing listens on now (perftest's server binds every address).
std::string free_port() {
  const int probe = ::socket(AF_INET, SOCK_STREAM, 0);
  sockaddr_in address{};
  address.sin_family = AF_INET;
  address.sin_addr.s_addr = htonl(INADDR_ANY);
  socklen_t length = sizeof(address);
  std::string port = "13337";
  if (::bind(probe, reinterpret_cast<sockaddr*>(&address), sizeof(address)) == 0 &&
      ::getsockname(probe, reinterpret_cast<sockaddr*>(&address), &length) == 0) {
    port = std::to_string(ntohs(address.sin_port));
  }
  ::close(probe);
  return port;
}

std::string last_line(const std::string& text) {
  std::istringstream lines(text);
  std::string last;
  for (std::string line; std::getline(lines, line);) {
    if (line.find_first_not_of(" \t\r") != std::string::npos) last = line;
  }
  return last;
}

std::string describe_exit(int status) {
  if (WIFEXITED(status)) return "exited " + std::to_string(WEXITSTATUS(status));
  if (WIFSIGNALED(status)) return "killed by signal " + std::to_string(WTERMSIG(status));
  return "ended";
}

}  // namespace ucx_perftest_detail

std::string find_ucx_perftest(const std::string& preferred) {
  using ucx_perftest_detail::is_executable;
  if (is_executable(preferred)) return preferred;
  const char* path = std::getenv("PATH");
  std::istringstream directories(path != nullptr ? path : "");
  for (std::string directory; std::getline(directories, directory, ':');) {
    const std::string candidate = (std::filesystem::path(directory) / "ucx_perftest").string();
    if (is_executable(candidate)) return candidate;
  }
  return "";
}

std::optional<double> parse_perftest_bandwidth(std::string_view output, std::size_t message_bytes, std::string& error) {
  std::optional<std::vector<double>> summary;
  std::size_t start = 0;
  while (start < output.size()) {
    std::size_t end = output.find('\n', start);
    if (end == std::string_view::npos) end = output.size();
    std::string line(output.substr(start, end - start));
    start = end + 1;
    if (const auto label = line.find("Final:"); label != std::string::npos) line.erase(0, label + 6);
    std::istringstream words(line);
    std::vector<double> numbers;
    bool all_numbers = true;
    for (std::string word; words >> word;) {
      double value = 0;
      const auto [rest, parsed] = std::from_chars(word.data(), word.data() + word.size(), value);
      if (parsed != std::errc{} || rest != word.data() + word.size()) {
        all_numbers = false;
        break;
      }
      numbers.push_back(value);
    }
    if (all_numbers && numbers.size() == 8) summary = std::move(numbers);
  }
  if (!summary) {
    error = "no final summary line of 8 numbers in ucx_perftest's output";
    return std::nullopt;
  }
  const auto& columns = *summary;
  const double overall_usec = columns[3];
  const double bandwidth = columns[5] * 1048576.0;  // MB/s of 2^20 bytes
  if (!(overall_usec > 0) || !(bandwidth > 0)) {
    error = "ucx_perftest's summary has no bandwidth";
    return std::nullopt;
  }
  const double from_overhead = static_cast<double>(message_bytes) / (overall_usec * 1e-6);
  if (std::abs(from_overhead / bandwidth - 1.0) > 0.02) {
    error = "ucx_perftest's summary columns disagree (bandwidth " + std::to_string(bandwidth) +
            " B/s, size / overhead " + std::to_string(from_overhead) + " B/s): unknown output format";
    return std::nullopt;
  }
  return bandwidth;
}

UcxPerftest::UcxPerftest(std::string binary, std::filesystem::path dir, std::vector<std::string> environment,
                         std::string wait_mode)
    : binary_(std::move(binary)),
      dir_(std::move(dir)),
      environment_(std::move(environment)),
      wait_mode_(std::move(wait_mode)) {
  std::filesystem::create_directories(dir_);
}

std::vector<std::string> UcxPerftest::client_arguments(std::string port, std::string bytes, std::string iterations,
                                                       std::string warmup, std::string wait_mode) {
  return {"127.0.0.1",          "-p", std::move(port),       "-t", "tag_bw",          "-s",
          std::move(bytes),     "-n", std::move(iterations), "-w", std::move(warmup), "-E",
          std::move(wait_mode), "-f"};
}

PerftestSample UcxPerftest::run(const std::string& tls, std::size_t bytes, int iterations, int warmup,
                                std::chrono::seconds timeout) const {
  using namespace ucx_perftest_detail;
  PerftestSample sample;
  auto environment = perftest_environment(tls);
  environment.insert(environment.end(), environment_.begin(), environment_.end());
  const std::string port = free_port();
  const auto server_log = dir_ / "perftest-server.log";
  const auto client_log = dir_ / "perftest-client.log";
  const pid_t server = spawn_logged({binary_, "-p", port}, environment, server_log);
  if (server < 0) {
    sample.error = "could not start " + binary_;
    return sample;
  }
  const auto deadline = std::chrono::steady_clock::now() + timeout;
  // The server listens once its context is up; until then the client's connect is refused.
  const auto listen_deadline = std::chrono::steady_clock::now() + std::chrono::seconds(5);
  std::vector<std::string> client_argv{binary_};
  for (auto& argument :
       client_arguments(port, std::to_string(bytes), std::to_string(iterations), std::to_string(warmup), wait_mode_))
    client_argv.push_back(std::move(argument));
  while (true) {
    const pid_t client = spawn_logged(client_argv, environment, client_log);
    if (client < 0) {
      kill_and_reap(server);
      sample.error = "could not start the ucx_perftest client";
      return sample;
    }
    const auto status = wait_until(client, deadline);
    if (!status) {
      kill_and_reap(client);
      kill_and_reap(server);
      sample.error = "ucx_perftest did not finish within " + std::to_string(timeout.count()) + " s";
      return sample;
    }
    if (WIFEXITED(*status) && WEXITSTATUS(*status) == 0) break;
    const std::string said = read_text(client_log);
    int server_status = 0;
    const bool server_running = ::waitpid(server, &server_status, WNOHANG) == 0;
    if (said.find("Connection refused") != std::string::npos && server_running &&
        std::chrono::steady_clock::now() < listen_deadline) {
      std::this_thread::sleep_for(std::chrono::milliseconds(10));
      continue;
    }
    if (server_running) kill_and_reap(server);
    sample.error = "ucx_perftest client " + describe_exit(*status) + ": " + last_line(said) +
                   (server_running ? "" : "; server: " + last_line(read_text(server_log)));
    return sample;
  }
  // The server ends with the test; it has nothing left to report.
  if (!wait_until(server, std::chrono::steady_clock::now() + std::chrono::seconds(5))) kill_and_reap(server);
  std::string error;
  const auto bandwidth = parse_perftest_bandwidth(read_text(client_log), bytes, error);
  if (!bandwidth) {
    sample.error = error + ": " + last_line(read_text(client_log));
    return sample;
  }
  sample.gbps = *bandwidth / 1e9;
  return sample;
}

}  // namespace kvrelay::bench
