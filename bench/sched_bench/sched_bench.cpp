// sched_bench: what the link scheduler buys a small urgent handoff sharing a link with a bulk one
// (issue #27, "Must show"). Real `kvrelay serve` daemons hold the KV; this program is the peer
// that fetches it over loopback TCP, as a sidecar's fetch stage does. Each daemon paces its link
// to --link-mbps (the NIC model), so the figures are about queueing, not about this host's copy
// speed. Printed as one JSON object:
// - urgent_p99_ms_idle: a 1 MiB fetch on an urgent route, alone on the link;
// - urgent_p99_ms_loaded_scheduled: the same while a bulk fetch on a low-priority route is kept in
//   flight on the same link, under scheduler.mode wrr;
// - urgent_p99_ms_loaded_fifo: the same against a daemon with scheduler.mode fifo;
// - critical_share_achieved against critical_share_reserved: a critical route's share of the
//   link (reserved bytes over bytes granted while it had work, from GET /admin/state) while bulk
//   fetches saturate it;
// with the goals (loaded_scheduled <= 3 x idle and <= 0.25 x fifo; achieved >= 0.9 x reserved).
#include <unistd.h>

#include <CLI/CLI.hpp>
#include <boost/asio/connect.hpp>
#include <boost/asio/ip/tcp.hpp>
#include <boost/beast/core.hpp>
#include <boost/beast/http.hpp>
#include <nlohmann/json.hpp>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <iostream>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

#include "kvrelay/audit/statistics.h"
#include "kvrelay/codec_plugins/frame.h"
#include "kvrelay/codec_plugins/registry.h"
#include "kvrelay/kv_store/entry_chain.h"
#include "kvrelay/peer/peer_client.h"

#include "common/daemon_process.h"
#include "common/spread_json.h"

namespace {

using namespace kvrelay;
using nlohmann::json;
using Clock = std::chrono::steady_clock;
namespace beast = boost::beast;
namespace http = beast::http;

constexpr std::size_t kMiB = 1U << 20;
constexpr std::uint64_t kModel = 0x5c4ed;
constexpr const char* kAsker = "sched-bench";

double seconds_since(Clock::time_point start) {
  return std::chrono::duration<double>(Clock::now() - start).count();
}

// A holding daemon, ready once it listens for peers and for the admin API.
class Daemon : public bench::DaemonProcess {
 public:
  Daemon(const std::string& binary, const std::filesystem::path& dir, const json& policy)
      : DaemonProcess(binary, dir, policy, {"peer", "admin"}) {}
  [[nodiscard]] HostPort peer() const { return {"127.0.0.1", peer_port()}; }
  [[nodiscard]] std::uint16_t admin_port() const { return port("admin"); }
};

// GET on the daemon's admin listener (read-only endpoints need no token).
json admin_get(std::uint16_t port, const std::string& target) {
  boost::asio::io_context io;
  boost::asio::ip::tcp::socket socket(io);
  socket.connect({boost::asio::ip::make_address("127.0.0.1"), port});
  http::request<http::empty_body> request{http::verb::get, target, 11};
  request.set(http::field::host, "127.0.0.1");
  http::write(socket, request);
  beast::flat_buffer buffer;
  http::response<http::string_body> response;
  http::read(socket, buffer, response);
  return json::parse(response.body());
}

// A raw KV frame of `bytes` with token ids whose chain hashes to its key (one block).
struct Entry {
  kv_store::EntryChain chain;
  kv_store::EntryKey key;
  std::vector<std::uint8_t> frame;
};
Entry make_entry(std::size_t bytes, std::uint32_t seed) {
  KvLayout layout{32, 8, 128, DType::kFloat16, 1};
  layout.tokens = std::max<std::uint64_t>(1, bytes / layout.total_bytes().value());
  std::vector<std::uint8_t> kv(static_cast<std::size_t>(layout.total_bytes().value()));
  for (std::size_t index = 0; index < kv.size(); ++index)
    kv[index] = static_cast<std::uint8_t>((index * 2654435761U + seed) >> 13);
  Entry entry;
  entry.chain.block_tokens = static_cast<std::uint32_t>(layout.tokens);
  for (std::uint64_t token = 0; token < layout.tokens; ++token)
    entry.chain.tokens.push_back(static_cast<TokenId>(seed * 100000 + token));
  entry.key = {kModel, kv_store::chain_keys(kModel, entry.chain, kv_store::ChainScope::kUnscoped).back()};
  const auto registry = codec::CodecRegistry::with_builtins();
  auto raw = codec::resolve_codec(registry, "raw");
  entry.frame = codec::encode_frame(*raw.value().codec, layout, kv).value();
  return entry;
}

json daemon_policy(const std::string& mode, double link_bytes_per_s, double reserved_share) {
  const json model = {{"architecture", "llama"}, {"layers", 32},    {"kv_heads", 8},
                      {"head_dim", 128},         {"dtype", "fp16"}, {"weights", "sched-bench"}};
  json agents = json::array();
  for (const auto& [id, priority] :
       std::vector<std::pair<std::string, int>>{{"archiver", 0}, {"planner", 7}, {"coder", 0}, {"monitor", 0}}) {
    agents.push_back({{"id", id}, {"upstream", "http://127.0.0.1:9"}, {"model", model}, {"role_priority", priority}});
  }
  return {{"schema_version", 1},
          {"node", {{"id", "holder"}}},
          {"listen", {{"http", "127.0.0.1:0"}, {"admin", "127.0.0.1:0"}, {"peer", "127.0.0.1:0"}}},
          {"agents", agents},
          {"routes", json::array({{{"id", "bulk"}, {"from", "archiver"}, {"to", "coder"}, {"priority", 0}},
                                  {{"id", "urgent"}, {"from", "planner"}, {"to", "coder"}, {"priority", 7}},
                                  {{"id", "sync"},
                                   {"from", "monitor"},
                                   {"to", "coder"},
                                   {"critical", true},
                                   {"reserved_share", reserved_share}}})},
          {"limits",
           {{"kv_store_bytes", 2ULL << 30},
            {"peer_buffer_bytes", 640ULL << 20},
            {"read_timeout_ms", 30000},
            {"peer_summary_interval_ms", 0}}},
          {"scheduler", {{"mode", mode}, {"link_bytes_per_s", link_bytes_per_s}}},
          {"logging", {{"level", "warn"}}}};
}

peer::PeerClient connect_client(const HostPort& address) {
  peer::PeerClientOptions options;
  options.node_id = kAsker;
  options.read_timeout = std::chrono::seconds(60);
  auto client = peer::PeerClient::connect(address, options);
  if (!client) throw std::runtime_error("peer connect: " + client.error().to_string());
  return std::move(client).value();
}

// Where one fetch's time went, in ms: from the request to the reply's header (the holder's
// lookup, read and encode, and a round trip), then the chunks.
struct Split {
  double reply_wait_ms = 0.0;
  double transfer_ms = 0.0;
};

// One fetch on `route`; its wall time in seconds (and its split, when asked).
double fetch_once(peer::PeerClient& client, const Entry& entry, const std::string& route, std::uint64_t id,
                  Split* split = nullptr) {
  peer::FetchRequest request{id, kModel, "raw", {entry.key.context_hash}};
  request.route = route;
  const auto started = Clock::now();
  auto fetched = client.fetch(request, std::uint64_t{4} << 30);
  if (!fetched || !fetched.value()) {
    throw std::runtime_error("fetch on " + route + ": " + (fetched ? "miss" : fetched.error().to_string()));
  }
  if (split != nullptr) {
    split->reply_wait_ms = static_cast<double>(fetched.value()->reply_wait.count()) / 1e3;
    split->transfer_ms = static_cast<double>(fetched.value()->transfer.count()) / 1e3;
  }
  return seconds_since(started);
}

struct Holder {
  Holder(const std::string& binary, const std::filesystem::path& dir, const std::string& mode, double rate,
         double reserved, const std::vector<const Entry*>& entries)
      : daemon(binary, dir, daemon_policy(mode, rate, reserved)) {
    if (!daemon.ready()) throw std::runtime_error("kvrelay serve did not start: " + daemon.log());
    auto loader = connect_client(daemon.peer());
    std::uint64_t id = 1;
    for (const Entry* entry : entries) {
      if (auto pushed = loader.push_encoded(id++, entry->key, entry->chain, entry->frame); !pushed) {
        throw std::runtime_error("push: " + pushed.error().to_string());
      }
    }
  }
  Daemon daemon;
};

// Urgent fetches one after another, with a bulk fetch kept in flight meanwhile when `loaded`.
std::vector<double> urgent_latencies(const Holder& holder, const Entry& urgent, const Entry& bulk, int count,
                                     bool loaded, std::vector<Split>* splits = nullptr) {
  std::atomic<bool> stop{false};
  std::atomic<int> bulk_fetches{0};
  std::thread background;
  if (loaded) {
    background = std::thread([&] {
      auto client = connect_client(holder.daemon.peer());
      for (std::uint64_t id = 1000; !stop.load(); ++id) {
        (void)fetch_once(client, bulk, "bulk", id);
        ++bulk_fetches;
      }
    });
    // The bulk reply is on the link before the first urgent one asks.
    const auto deadline = Clock::now() + std::chrono::seconds(30);
    while (Clock::now() < deadline) {
      const auto state = admin_get(holder.daemon.admin_port(), "/admin/state?limit=1");
      if (state["links"].contains(kAsker) && state["links"][kAsker]["grants"].get<std::uint64_t>() > 8) break;
      std::this_thread::sleep_for(std::chrono::milliseconds(5));
    }
  }
  auto client = connect_client(holder.daemon.peer());
  std::vector<double> latencies;
  for (int index = 0; index < count; ++index) {
    Split split;
    latencies.push_back(fetch_once(client, urgent, "urgent", 10 + static_cast<std::uint64_t>(index), &split) * 1e3);
    if (splits != nullptr) splits->push_back(split);
    // Spread the asks over the bulk reply's phases (its start, middle and end).
    std::this_thread::sleep_for(std::chrono::milliseconds(3 + (index * 7) % 11));
  }
  stop = true;
  if (background.joinable()) background.join();
  return latencies;
}

}  // namespace

int main(int argc, char** argv) {
  CLI::App app{
      "sched_bench: an urgent handoff's p99 alone and behind a bulk one, wrr vs fifo, and a critical "
      "route's reserved share, through real kvrelay daemons (JSON)"};
  std::string binary = KVRELAY_BENCH_DAEMON_BINARY;
  double link_mbps = 1000.0;
  std::size_t bulk_mib = 256;
  std::size_t critical_mib = 64;
  int count = 200;
  double reserved = 0.3;
  app.add_option("--kvrelay", binary, "the kvrelay binary to run as the holding daemons");
  app.add_option("--link-mbps", link_mbps, "each daemon's paced link, in MB/s (scheduler.link_bytes_per_s)")
      ->check(CLI::Range(10.0, 100000.0));
  app.add_option("--bulk-mib", bulk_mib, "the low-priority transfer kept in flight, MiB")
      ->check(CLI::Range(std::size_t{8}, std::size_t{1024}));
  app.add_option("--critical-mib", critical_mib, "the critical route's transfers, MiB")
      ->check(CLI::Range(std::size_t{1}, std::size_t{1024}));
  app.add_option("--count", count, "urgent fetches per measurement")->check(CLI::Range(10, 10000));
  app.add_option("--reserved-share", reserved, "routes[].reserved_share of the critical route")
      ->check(CLI::Range(0.05, 0.5));
  CLI11_PARSE(app, argc, argv);

  const double rate = link_mbps * 1e6;
  const Entry urgent = make_entry(kMiB, 1);
  const Entry bulk = make_entry(bulk_mib * kMiB, 2);
  const Entry critical = make_entry(critical_mib * kMiB, 3);
  const auto dir = std::filesystem::temp_directory_path() / ("sched_bench-" + std::to_string(::getpid()));
  json result{{"bench", "sched_bench"},
              {"link_bytes_per_s", rate},
              {"bulk_bytes", bulk.frame.size()},
              {"urgent_bytes", urgent.frame.size()},
              {"count", count}};
  try {
    std::vector<double> idle;
    std::vector<double> scheduled;
    std::vector<double> fifo;
    json scheduled_state;
    {
      Holder wrr(binary, dir / "wrr", "wrr", rate, reserved, {&urgent, &bulk, &critical});
      idle = urgent_latencies(wrr, urgent, bulk, count, false);
      std::vector<Split> splits;
      scheduled = urgent_latencies(wrr, urgent, bulk, count, true, &splits);
      // The slowest tenth of the scheduled urgent fetches: waiting for the reply's header (the
      // holder busy before it sends) or in the chunks (the link).
      std::vector<std::size_t> order(scheduled.size());
      for (std::size_t index = 0; index < order.size(); ++index)
        order[index] = index;
      std::sort(order.begin(), order.end(), [&](auto a, auto b) { return scheduled[a] > scheduled[b]; });
      std::vector<double> slow_reply_wait;
      std::vector<double> slow_transfer;
      for (std::size_t rank = 0; rank < std::max<std::size_t>(1, order.size() / 10); ++rank) {
        slow_reply_wait.push_back(splits[order[rank]].reply_wait_ms);
        slow_transfer.push_back(splits[order[rank]].transfer_ms);
      }
      result["loaded_scheduled_slowest_tenth"] = {{"reply_wait_ms", bench::spread_json(slow_reply_wait)},
                                                  {"transfer_ms", bench::spread_json(slow_transfer)}};
      scheduled_state = admin_get(wrr.daemon.admin_port(), "/admin/state?limit=1")["links"][kAsker];

      // Saturation: two bulk fetch loops and a critical one; the critical route's share of the
      // bytes granted while it had work, from the daemon's own counters over the overlap.
      const auto before = admin_get(wrr.daemon.admin_port(), "/admin/state?limit=1")["links"][kAsker];
      std::atomic<bool> stop{false};
      std::vector<std::thread> loops;
      for (int loop = 0; loop < 2; ++loop) {
        loops.emplace_back([&, loop] {
          auto client = connect_client(wrr.daemon.peer());
          for (std::uint64_t id = 5000 + 1000 * static_cast<std::uint64_t>(loop); !stop.load(); ++id)
            (void)fetch_once(client, bulk, "bulk", id);
        });
      }
      std::this_thread::sleep_for(std::chrono::milliseconds(200));
      {
        auto client = connect_client(wrr.daemon.peer());
        for (std::uint64_t id = 9000; id < 9004; ++id)
          (void)fetch_once(client, critical, "sync", id);
      }
      const auto after = admin_get(wrr.daemon.admin_port(), "/admin/state?limit=1")["links"][kAsker];
      stop = true;
      for (auto& loop : loops)
        loop.join();
      const double reserved_bytes = after["reserved_bytes"].get<double>() - before["reserved_bytes"].get<double>();
      const double while_reserved =
          after["bytes_while_reserved"].get<double>() - before["bytes_while_reserved"].get<double>();
      result["critical_share_reserved"] = reserved;
      result["critical_share_achieved"] = while_reserved > 0 ? reserved_bytes / while_reserved : 0.0;
    }
    {
      Holder fifo_holder(binary, dir / "fifo", "fifo", rate, reserved, {&urgent, &bulk});
      fifo = urgent_latencies(fifo_holder, urgent, bulk, count, true);
    }
    result["urgent_p99_ms_idle"] = audit::quantile(idle, 0.99);
    result["urgent_p99_ms_loaded_scheduled"] = audit::quantile(scheduled, 0.99);
    result["urgent_p99_ms_loaded_fifo"] = audit::quantile(fifo, 0.99);
    result["urgent_ms_idle"] = bench::spread_json(idle);
    result["urgent_ms_loaded_scheduled"] = bench::spread_json(scheduled);
    result["urgent_ms_loaded_fifo"] = bench::spread_json(fifo);
    result["scheduled_link"] = scheduled_state;
    const double idle_p99 = result["urgent_p99_ms_idle"];
    const double scheduled_p99 = result["urgent_p99_ms_loaded_scheduled"];
    const double fifo_p99 = result["urgent_p99_ms_loaded_fifo"];
    const double achieved = result["critical_share_achieved"];
    result["goals"] = {{"loaded_scheduled_le_3x_idle", scheduled_p99 <= 3.0 * idle_p99},
                       {"loaded_scheduled_le_quarter_fifo", scheduled_p99 <= 0.25 * fifo_p99},
                       {"critical_share_ge_0.9x_reserved", achieved >= 0.9 * reserved}};
    result["pass"] = scheduled_p99 <= 3.0 * idle_p99 && scheduled_p99 <= 0.25 * fifo_p99 && achieved >= 0.9 * reserved;
  } catch (const std::exception& error) {
    result["error"] = error.what();
    std::cout << result.dump(2) << "\n";
    std::filesystem::remove_all(dir);
    return 1;
  }
  std::cout << result.dump(2) << "\n";
  std::filesystem::remove_all(dir);
  return 0;
}
