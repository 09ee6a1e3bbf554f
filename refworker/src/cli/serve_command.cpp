#include <malloc.h>
#include <unistd.h>

#include <boost/asio/io_context.hpp>
#include <boost/asio/signal_set.hpp>
#include <boost/asio/steady_timer.hpp>
#include <climits>
#include <fmt/format.h>
#include <nlohmann/json.hpp>
#include <spdlog/spdlog.h>

#include <chrono>
#include <filesystem>
#include <memory>
#include <optional>

#include "kvrelay/core/file_io.h"
#include "kvrelay/refworker/completion_server.h"
#include "kvrelay/refworker/kv_connector.h"
#include "kvrelay/refworker/sidecar_kv_connector.h"

#include "cli_util.h"
#include "commands.h"

namespace kvrelay::refworker::cli {

namespace {

struct ServeOptions {
  ModelSource source;
  std::string host = "127.0.0.1";
  std::uint16_t port = 0;
  std::string ready_file;
  std::string model_name;
  std::uint32_t max_waiting = 256;
  int blas_threads = 1;
  std::string kvrelay_socket;                  // the local sidecar's data plane; empty: no KV connector
  std::optional<std::size_t> kv_cache_tokens;  // default: the model's seq_len
};

Status write_ready_file(const std::string& path, const nlohmann::json& body) {
  return write_file_atomically(path, body.dump() + "\n");
}

std::string default_model_name(const ModelSource& source) {
  if (!source.checkpoint_path.empty()) return std::filesystem::path(source.checkpoint_path).stem().string();
  return "synthetic";
}

// A serving process keeps the heap memory it freed, as inference servers keep their buffers:
// glibc otherwise trims the heap after a request's buffers are freed and the next request
// faults fresh pages in again. On a VM with shadow paging (~4 ms/MiB) that stalled about a third
// of B's 25-token prefills after a KV import from 25 ms to 50-130 ms (bench/e2e_bench).
void keep_freed_heap() {
  if (mallopt(M_TRIM_THRESHOLD, INT_MAX) != 1) spdlog::warn("mallopt(M_TRIM_THRESHOLD) refused: the heap may shrink");
}

int run_serve(const ServeOptions& options) {
  keep_freed_heap();
  apply_blas_threads(options.blas_threads);
  const auto load_start = std::chrono::steady_clock::now();
  auto model = load_model(options.source);
  if (!model) return report_error(model.error());
  spdlog::info("model {} loaded in {:.1f} s (fingerprint {:016x})", model.value().config().shape_string(),
               std::chrono::duration<double>(std::chrono::steady_clock::now() - load_start).count(),
               model.value().fingerprint().id());

  WorkerMetrics metrics;
  NoKvConnector no_connector;
  std::unique_ptr<SidecarKvConnector> sidecar_connector;
  if (!options.kvrelay_socket.empty()) {
    sidecar_connector = std::make_unique<SidecarKvConnector>(options.kvrelay_socket, model.value().fingerprint().id());
    spdlog::info("KV connector: kvrelay sidecar at {}", options.kvrelay_socket);
  }
  KvConnector& connector = sidecar_connector ? static_cast<KvConnector&>(*sidecar_connector) : no_connector;
  const std::size_t kv_cache_tokens = options.kv_cache_tokens.value_or(model.value().config().seq_len);
  ModelWorker worker(model.value(), connector, metrics, options.max_waiting, kv_cache_tokens);
  spdlog::info("KV cache: {} tokens pre-allocated", kv_cache_tokens);
  ServerContext context;
  context.model = &model.value();
  context.worker = &worker;
  context.metrics = &metrics;
  context.model_name = options.model_name.empty() ? default_model_name(options.source) : options.model_name;
  context.limits = {model.value().config().vocab_size, model.value().config().seq_len};

  boost::asio::io_context io;
  CompletionServer server(io, ServerLimits{}, context);
  if (auto listening = server.listen(options.host, options.port); !listening) return report_error(listening.error());
  spdlog::info("serving '{}' on http://{}:{}", context.model_name, options.host, server.port());
  if (!options.ready_file.empty()) {
    const nlohmann::json ready = {{"pid", ::getpid()},
                                  {"http", server.port()},
                                  {"model", context.model_name},
                                  {"fingerprint_id", fmt::format("{:016x}", model.value().fingerprint().id())}};
    if (auto written = write_ready_file(options.ready_file, ready); !written) return report_error(written.error());
  }

  boost::asio::signal_set signals(io, SIGINT, SIGTERM);
  boost::asio::steady_timer grace(io);
  signals.async_wait([&](boost::system::error_code ec, int signal_number) {
    if (ec) return;
    spdlog::info("signal {}: stopping", signal_number);
    server.stop_accepting();
    worker.stop();
    // Let the answers of the request that was running reach their clients, then exit.
    grace.expires_after(std::chrono::milliseconds(300));
    grace.async_wait([&io](boost::system::error_code) { io.stop(); });
  });
  io.run();
  return 0;
}

}  // namespace

void add_serve_command(CLI::App& app, int& exit_code) {
  auto options = std::make_shared<ServeOptions>();
  auto* command = app.add_subcommand("serve", "Serve the OpenAI completions API (token-id prompts)");
  add_model_options(*command, options->source);
  command->add_option("--host", options->host, "Listen address");
  command->add_option("--port", options->port, "Listen port (0: ephemeral, see --ready-file)");
  command->add_option("--ready-file", options->ready_file, "Write {pid, http, model} here once listening");
  command->add_option("--model-name", options->model_name, "Name served at /v1/models (default: file stem)");
  command->add_option("--max-waiting", options->max_waiting, "Requests that may wait for the model thread")
      ->check(CLI::Range(1U, 1U << 20));
  add_blas_threads_option(*command, options->blas_threads);
  command->add_option("--kvrelay-socket", options->kvrelay_socket,
                      "Local kvrelay sidecar's data-plane socket: look up KV before prefill, publish it after");
  command
      ->add_option("--kv-cache-tokens", options->kv_cache_tokens,
                   "KV cache rows allocated and touched at startup, lent to every request (default: the "
                   "model's seq_len; 0: each request allocates its own)")
      ->check(CLI::Range(std::size_t{0}, std::size_t{1} << 24));
  command->callback([options, &exit_code] { exit_code = run_serve(*options); });
}

}  // namespace kvrelay::refworker::cli
