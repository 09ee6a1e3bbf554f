#include "load_generator.h"

#include <boost/asio/connect.hpp>
#include <boost/asio/io_context.hpp>
#include <boost/asio/ip/tcp.hpp>
#include <boost/beast/core/flat_buffer.hpp>
#include <boost/beast/http.hpp>

#include <algorithm>
#include <mutex>
#include <thread>
#include <vector>

namespace kvrelay::bench {

namespace asio = boost::asio;
namespace http = boost::beast::http;
using tcp = asio::ip::tcp;

LoadResult run_load(std::uint16_t port, const std::string& target, const std::string& body,
                    const std::map<std::string, std::string>& headers, unsigned connections,
                    std::chrono::milliseconds duration) {
  std::mutex merge_mutex;
  std::vector<double> latencies_us;
  LoadResult result;
  const auto started = std::chrono::steady_clock::now();
  const auto deadline = started + duration;

  std::vector<std::thread> workers;
  for (unsigned index = 0; index < connections; ++index) {
    workers.emplace_back([&] {
      std::vector<double> local;
      std::uint64_t errors = 0;
      std::uint64_t bytes = 0;
      asio::io_context io;
      tcp::socket socket(io);
      boost::system::error_code ec;
      socket.connect({asio::ip::make_address("127.0.0.1"), port}, ec);
      if (ec) {
        const std::lock_guard lock(merge_mutex);
        ++result.errors;
        return;
      }
      socket.set_option(tcp::no_delay(true));
      http::request<http::string_body> request{body.empty() ? http::verb::get : http::verb::post, target, 11};
      request.set(http::field::host, "127.0.0.1");
      request.set(http::field::content_type, "application/json");
      for (const auto& [name, value] : headers)
        request.set(name, value);
      request.body() = body;
      request.prepare_payload();
      boost::beast::flat_buffer buffer;
      while (std::chrono::steady_clock::now() < deadline) {
        const auto sent = std::chrono::steady_clock::now();
        http::write(socket, request, ec);
        http::response<http::string_body> response;
        if (!ec) http::read(socket, buffer, response, ec);
        if (ec || response.result_int() != 200) {
          ++errors;
          break;
        }
        bytes += response.body().size();
        local.push_back(std::chrono::duration<double, std::micro>(std::chrono::steady_clock::now() - sent).count());
        if (!response.keep_alive()) break;
      }
      const std::lock_guard lock(merge_mutex);
      latencies_us.insert(latencies_us.end(), local.begin(), local.end());
      result.errors += errors;
      result.response_bytes += bytes;
    });
  }
  for (auto& worker : workers)
    worker.join();
  result.seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - started).count();
  std::sort(latencies_us.begin(), latencies_us.end());
  result.latencies_us = std::move(latencies_us);
  return merge_runs({std::move(result)});
}

LoadResult merge_runs(const std::vector<LoadResult>& runs) {
  LoadResult merged;
  for (const auto& run : runs) {
    merged.errors += run.errors;
    merged.response_bytes += run.response_bytes;
    merged.seconds += run.seconds;
    merged.latencies_us.insert(merged.latencies_us.end(), run.latencies_us.begin(), run.latencies_us.end());
  }
  std::sort(merged.latencies_us.begin(), merged.latencies_us.end());
  merged.requests = merged.latencies_us.size();
  if (merged.seconds > 0) merged.requests_per_second = static_cast<double>(merged.requests) / merged.seconds;
  if (!merged.latencies_us.empty()) {
    const auto at = [&](double quantile) {
      return merged
          .latencies_us[static_cast<std::size_t>(quantile * static_cast<double>(merged.latencies_us.size() - 1))];
    };
    merged.p50_us = at(0.50);
    merged.p99_us = at(0.99);
  }
  return merged;
}

}  // namespace kvrelay::bench
