// transport_bench: kvrelay's transports on the paths the product runs, each next to its physical
// limit measured in the same run, alternating run by run. Prints one JSON object.
//
// - KV fetch across nodes: a real `kvrelay serve` daemon (a child process) holds the KV, published
//   into its store through its shared-memory socket; this process fetches it as a sidecar's broker
//   does on a handoff (broker::PeerLinks::fetch over TCP, then codec::decode_frame_view, into the
//   links' warm buffers), alternating with a plain loopback socket pair moving the same bytes into
//   a warm buffer (the physical peer). `kv_fetch_vs_raw_tcp_paired`: raw time / fetch time per pair.
// - The same fetch over TLS peers (issue #25; development certificates from
//   scripts/make-dev-certs.sh), in the same pairs: `tls_fetch_vs_plaintext_paired` is plaintext
//   fetch time / TLS fetch time per pair.
// - The same fetch over UCX (issue #29: a holder whose policy has a `ucx` section, a fetching
//   PeerLinks whose peer has transport "ucx"), once with UCX_TLS=tcp and once with posix, each next
//   to ucx_perftest's tag bandwidth of the same size and transport run just before or after it
//   (its physical limit): `ucx_fetch_vs_perftest_paired` is fetch throughput / perftest bandwidth.
// - Worker data plane: ShmClient::publish / commit in place against memcpy, small ring messages.
//
// bench/transport_bench/README.md describes every field.

#include <fcntl.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <signal.h>
#include <stdlib.h>
#include <sys/socket.h>
#include <sys/utsname.h>
#include <sys/wait.h>
#include <unistd.h>

#include <CLI/CLI.hpp>
#include <nlohmann/json.hpp>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <map>
#include <memory>
#include <optional>
#include <random>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

#include "kvrelay/audit/statistics.h"
#include "kvrelay/broker/peer_links.h"
#include "kvrelay/broker/policy_source.h"
#include "kvrelay/codec_plugins/frame.h"
#include "kvrelay/codec_plugins/registry.h"
#include "kvrelay/core/metrics.h"
#include "kvrelay/core/policy.h"
#include "kvrelay/kv_store/entry_chain.h"
#include "kvrelay/kv_store/memfd.h"
#include "kvrelay/peer/peer_tls.h"
#include "kvrelay/peer/ucx_transport.h"
#include "kvrelay/shm_transport/client.h"
#include "kvrelay/shm_transport/server.h"

#include "common/daemon_process.h"
#include "common/spread_json.h"
#include "transport_bench/ucx_perftest.h"

#ifndef KVRELAY_BENCH_DAEMON_BINARY
#define KVRELAY_BENCH_DAEMON_BINARY "kvrelay"
#endif
#ifndef KVRELAY_BENCH_DEV_CERTS
#define KVRELAY_BENCH_DEV_CERTS "scripts/make-dev-certs.sh"
#endif

namespace {

using Clock = std::chrono::steady_clock;
using namespace kvrelay;
using json = nlohmann::json;

constexpr std::size_t kMiB = 1U << 20;
int kRepeats = 15;  // --repeats

double seconds_since(Clock::time_point start) {
  return std::chrono::duration<double>(Clock::now() - start).count();
}
double gbps(std::size_t bytes, double seconds) {
  return static_cast<double>(bytes) / seconds / 1e9;
}
double millis(std::chrono::microseconds duration) {
  return static_cast<double>(duration.count()) / 1e3;
}

// KV as a model writes it: fp16 values of moderate magnitude (random sign and mantissa, exponent
// within a few binades), so the lossless codec sees what it would see, not incompressible noise
// or zeros. Raw fetches move the bytes as they are either way.
std::vector<std::byte> make_payload(std::size_t size) {
  std::vector<std::byte> bytes(size);
  std::uint64_t state = 88172645463325252ULL;
  for (std::size_t offset = 0; offset + 8 <= size; offset += 8) {
    state ^= state << 13;
    state ^= state >> 7;
    state ^= state << 17;
    std::uint64_t halves = 0;
    for (int lane = 0; lane < 4; ++lane) {
      const auto bits = static_cast<std::uint16_t>(state >> (16 * lane));
      const auto exponent = static_cast<std::uint16_t>(11 + (bits >> 10) % 5);  // 2^-4 .. 2^0
      const auto half = static_cast<std::uint16_t>((bits & 0x8000U) | (exponent << 10) | (bits & 0x3FFU));
      halves |= static_cast<std::uint64_t>(half) << (16 * lane);
    }
    std::memcpy(bytes.data() + offset, &halves, 8);
  }
  return bytes;
}

// A KV layout of a real model: Llama-3-8B's (32 layers, 8 KV heads of 128, fp16): 128 KiB per token,
// so 16 MiB is 128 tokens and 256 MiB 2048.
KvLayout kv_layout_for(std::size_t bytes) {
  KvLayout layout;
  layout.layers = 32;
  layout.kv_heads = 8;
  layout.head_dim = 128;
  layout.dtype = DType::kFloat16;
  layout.tokens = bytes / (2ULL * 32 * 8 * 128 * 2);
  return layout;
}

// ---------------------------------------------------------------------------------------------
// Physical limits.

double bench_memcpy(const std::vector<std::byte>& source) {
  std::vector<std::byte> destination(source.size());
  std::memcpy(destination.data(), source.data(), source.size());  // fault the pages in first
  double best = 0;
  for (int repeat = 0; repeat < std::min(kRepeats, 5); ++repeat) {
    const auto start = Clock::now();
    std::memcpy(destination.data(), source.data(), source.size());
    best = std::max(best, gbps(source.size(), seconds_since(start)));
  }
  return best;
}

// pwrite into a fresh memfd from a warm buffer: how ShmClient::publish fills a sealed segment
// (sidecars without an arena, or an arena that is full), and so that path's limit.
double bench_memfd_write(const std::vector<std::byte>& source) {
  double best = 0;
  for (int repeat = 0; repeat < std::min(kRepeats, 3); ++repeat) {
    const auto start = Clock::now();
    auto memfd = kv_store::create_sealed_memfd_to_fill("bench", source.size());
    if (!memfd) return 0;
    if (!kv_store::write_memfd(memfd.value().get(), 0, source)) return 0;
    best = std::max(best, gbps(source.size(), seconds_since(start)));
  }
  return best;
}

// A plain blocking loopback socket pair on one kept connection: a thread of its own reads each
// transfer (an 8-byte length, then the bytes) into one warm buffer and answers one byte; the
// caller writes from memory. The physical peer for the fetch.
class RawTcpPair {
 public:
  explicit RawTcpPair(std::size_t max_bytes) : sink_(max_bytes, std::byte{1}) {
    // Touched from user and kernel mode, as a receive buffer that has been used before is.
    (void)kv_store::touch_pages_for_kernel_write(sink_, nullptr);
    const int listener = ::socket(AF_INET, SOCK_STREAM, 0);
    sockaddr_in address{};
    address.sin_family = AF_INET;
    address.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    socklen_t length = sizeof(address);
    ::bind(listener, reinterpret_cast<sockaddr*>(&address), sizeof(address));
    ::listen(listener, 1);
    ::getsockname(listener, reinterpret_cast<sockaddr*>(&address), &length);
    sender_ = ::socket(AF_INET, SOCK_STREAM, 0);
    if (::connect(sender_, reinterpret_cast<sockaddr*>(&address), sizeof(address)) != 0) return;
    receiver_socket_ = ::accept(listener, nullptr, nullptr);
    ::close(listener);
    const int one = 1;
    ::setsockopt(sender_, IPPROTO_TCP, TCP_NODELAY, &one, sizeof(one));
    ::setsockopt(receiver_socket_, IPPROTO_TCP, TCP_NODELAY, &one, sizeof(one));
    receiver_ = std::thread([this] { receive_loop(); });
  }
  RawTcpPair(const RawTcpPair&) = delete;
  RawTcpPair& operator=(const RawTcpPair&) = delete;
  ~RawTcpPair() {
    ::shutdown(sender_, SHUT_RDWR);
    if (receiver_.joinable()) receiver_.join();
    ::close(sender_);
    ::close(receiver_socket_);
  }

  // Seconds from the first byte written to the receiver's answer; 0 on failure.
  double once(const std::byte* source, std::size_t size) {
    const auto start = Clock::now();
    const std::uint64_t header = size;
    if (!send_all(sender_, reinterpret_cast<const std::byte*>(&header), sizeof(header))) return 0;
    if (!send_all(sender_, source, size)) return 0;
    char done = 0;
    if (::recv(sender_, &done, 1, MSG_WAITALL) != 1) return 0;
    return seconds_since(start);
  }

 private:
  static bool send_all(int socket, const std::byte* bytes, std::size_t size) {
    for (std::size_t sent = 0; sent < size;) {
      const auto n = ::send(socket, bytes + sent, size - sent, MSG_NOSIGNAL);
      if (n <= 0) return false;
      sent += static_cast<std::size_t>(n);
    }
    return true;
  }
  void receive_loop() {
    while (true) {
      std::uint64_t size = 0;
      if (::recv(receiver_socket_, &size, sizeof(size), MSG_WAITALL) != sizeof(size)) return;
      if (size > sink_.size()) return;
      for (std::size_t got = 0; got < size;) {
        const auto n = ::recv(receiver_socket_, sink_.data() + got, size - got, 0);
        if (n <= 0) return;
        got += static_cast<std::size_t>(n);
      }
      const char done = 'k';
      if (::send(receiver_socket_, &done, 1, MSG_NOSIGNAL) != 1) return;
    }
  }

  std::vector<std::byte> sink_;
  int sender_ = -1;
  int receiver_socket_ = -1;
  std::thread receiver_;
};

// ---------------------------------------------------------------------------------------------
// Worker data plane (in-process ShmServer, the daemon's data-plane class).

struct ShmResults {
  double publish_gbps = 0;
  std::vector<double> publish_vs_memcpy_paired;
  std::vector<double> commit_in_place_vs_memcpy_paired;
  double commit_in_place_gbps = 0;
  double first_publish_gbps = 0;
  double small_p50_us = 0;
  double small_p99_us = 0;
};

// Client writes + commits, until the sidecar has validated the entry and can hand it out.
// `arena_bytes` > 0: entries go into the sidecar's arena (the default); 0: one sealed memfd per
// entry. With an arena the first publishes touch its pages and later ones reuse them (the store
// keeps two entries, so the third publish reuses the first one's block).
ShmResults bench_shm(const std::vector<std::byte>& payload, std::uint64_t arena_bytes, bool small_messages) {
  ShmResults results;
  const std::string path = "/tmp/kvrelay-transport-bench-" + std::to_string(::getpid()) + ".sock";
  auto store = std::make_shared<kv_store::InMemoryEntryStore>(payload.size() * 2);
  shm::ShmServerOptions options;
  options.socket_path = path;
  options.arena_bytes = arena_bytes;
  auto server = shm::ShmServer::listen(options, store);
  if (!server) {
    std::fprintf(stderr, "shm server: %s\n", server.error().to_string().c_str());
    return results;
  }
  server.value()->start();
  auto client = shm::ShmClient::connect(path);
  if (!client) return results;
  const int warm_up = arena_bytes > 0 ? static_cast<int>((arena_bytes + payload.size() - 1) / payload.size()) : 0;
  // Each measured arena publish is paired with a memcpy of the same bytes into a warm buffer run
  // just before it, so the ratio's two sides see the same moment of the host.
  std::vector<std::byte> copy_sink(arena_bytes > 0 ? payload.size() : 0);
  std::memcpy(copy_sink.data(), payload.data(), copy_sink.size());
  const auto memcpy_gbps_now = [&] {
    const auto start = Clock::now();
    std::memcpy(copy_sink.data(), payload.data(), copy_sink.size());
    return gbps(copy_sink.size(), seconds_since(start));
  };
  const int measured = arena_bytes > 0 ? kRepeats : std::min(kRepeats, 3);
  for (int repeat = 0; repeat < warm_up + measured; ++repeat) {
    const double copy_gbps = repeat >= warm_up && arena_bytes > 0 ? memcpy_gbps_now() : 0.0;
    const auto start = Clock::now();
    auto published = client.value().publish({1, static_cast<std::uint64_t>(repeat)}, KvLayout{}, payload);
    const double seconds = seconds_since(start);
    if (!published) std::fprintf(stderr, "publish: %s\n", published.error().to_string().c_str());
    if (repeat == 0) results.first_publish_gbps = gbps(payload.size(), seconds);
    if (repeat >= warm_up) results.publish_gbps = std::max(results.publish_gbps, gbps(payload.size(), seconds));
    if (published && copy_gbps > 0)
      results.publish_vs_memcpy_paired.push_back(gbps(payload.size(), seconds) / copy_gbps);
  }
  if (arena_bytes > 0 && server.value()->stats().arena_bytes_in_use == 0) {
    std::fprintf(stderr, "arena publish fell back to sealed segments\n");
    results.publish_gbps = 0;
  }
  // An engine that writes its KV straight into the region (allocate, write, commit_written) pays
  // only the commit: its checksum pass, with the sidecar's check running alongside.
  for (int repeat = 0; arena_bytes > 0 && repeat < measured; ++repeat) {
    auto region = client.value().allocate(payload.size());
    if (!region || !region.value().in_arena()) break;
    std::memcpy(region.value().bytes().data(), payload.data(), payload.size());
    const double copy_gbps = memcpy_gbps_now();
    const auto start = Clock::now();
    const kv_store::EntryKey key{2, static_cast<std::uint64_t>(repeat)};
    const Status committed = client.value().commit_written(std::move(region).value(), key, KvLayout{});
    const double seconds = seconds_since(start);
    if (!committed) break;
    results.commit_in_place_gbps = std::max(results.commit_in_place_gbps, gbps(payload.size(), seconds));
    results.commit_in_place_vs_memcpy_paired.push_back(gbps(payload.size(), seconds) / copy_gbps);
  }
  if (small_messages) {
    std::vector<std::byte> message(64, std::byte{7});
    std::vector<std::byte> answer(256);
    std::vector<double> samples;
    for (int index = 0; index < 20000; ++index) {
      const auto start = Clock::now();
      auto called = client.value().ring_call(message, answer);
      const double micros = seconds_since(start) * 1e6;
      if (!called) break;
      if (index >= 1000) samples.push_back(micros);  // skip warm-up
    }
    std::sort(samples.begin(), samples.end());
    if (!samples.empty()) {
      results.small_p50_us = samples[samples.size() / 2];
      results.small_p99_us = samples[samples.size() * 99 / 100];
    }
  }
  server.value()->stop();
  return results;
}

// ---------------------------------------------------------------------------------------------
// KV fetch through a real daemon.

// The policy the fetching side's broker reads, fixed for the run.
class FixedPolicy final : public broker::PolicySource {
 public:
  explicit FixedPolicy(Policy policy) : policy_(std::make_shared<const Policy>(std::move(policy))) {}
  [[nodiscard]] std::shared_ptr<const Policy> current() const override { return policy_; }
  void set_engine_observer(EngineObserver /*observer*/) override {}

 private:
  std::shared_ptr<const Policy> policy_;
};

using bench::DaemonProcess;
using bench::read_text;

constexpr std::uint64_t kModelId = 0x6b76;  // "kv"
// The token ids of the entry of `bytes` (one block of all its tokens): a holder serves peers
// only entries published with them.
kv_store::EntryChain chain_for(std::size_t bytes) {
  kv_store::EntryChain chain;
  const std::uint64_t tokens = kv_layout_for(bytes).tokens;
  chain.block_tokens = static_cast<std::uint32_t>(tokens);
  for (std::uint64_t token = 0; token < tokens; ++token)
    chain.tokens.push_back(static_cast<TokenId>((bytes / kMiB * 100000) + token));
  return chain;
}

std::uint64_t chain_hash_for(std::uint64_t model_id, std::size_t bytes) {
  return kv_store::chain_keys(model_id, chain_for(bytes), kv_store::ChainScope::kUnscoped).back();
}

// One memory strategy under test: the holding daemon (its policy carries the strategy) and the
// fetching side's links (whose policy carries it too).
struct StrategyRun {
  std::string strategy;
  // TLS peers on both sides, certificates under certs/; the entries are filed under a real
  // model's id so that the holder's fetch authorization lets the fetcher's agent have them.
  bool tls = false;
  // Set: chunk streams over UCX with this UCX_TLS on both sides (the holder's ucx.tls, the
  // fetching links' UCP context); control frames stay on the TCP peer connection.
  std::string ucx_tls;
  std::uint64_t model_id = kModelId;
  std::filesystem::path dir;
  std::unique_ptr<DaemonProcess> daemon;
  std::shared_ptr<FixedPolicy> policy;
  std::unique_ptr<metrics::Registry> registry;
  std::unique_ptr<broker::PeerLinks> links;
  std::string error;
};

// One measured fetch's figures.
struct FetchSample {
  double seconds = 0;  // PeerLinks::fetch + decode_frame_view: what KvPath records as the link's share
  double reply_wait_ms = 0;
  double transfer_ms = 0;
  double decode_ms = 0;
  double request_ms = 0;  // the rest: connect (first use only), the request's write, bookkeeping
  std::size_t frame_bytes = 0;
};

std::optional<FetchSample> fetch_once(StrategyRun& run, const codec::CodecRegistry& codecs, std::size_t bytes,
                                      const std::string& codec, std::uint64_t& request_id, std::string& error) {
  peer::FetchRequest request;
  request.request_id = ++request_id;
  request.model_id = run.model_id;
  request.codec = codec;
  request.hashes = {chain_hash_for(run.model_id, bytes)};
  const auto policy = run.policy->current();
  const auto started = Clock::now();
  auto fetched =
      run.links->fetch("holder", request, started + std::chrono::seconds(60), policy->limits.kv_store_bytes, codecs);
  const auto received = Clock::now();
  if (!fetched) {
    error = fetched.error().to_string();
    return std::nullopt;
  }
  if (!fetched.value()) {
    error = "the holder answered: none held";
    return std::nullopt;
  }
  if (const auto& transport = fetched.value()->transport; transport != (run.ucx_tls.empty() ? "tcp" : "ucx")) {
    error = "the KV came over " + transport + (run.ucx_tls.empty() ? ", not tcp" : ", not ucx");
    return std::nullopt;
  }
  const auto frame = fetched.value()->frame();
  auto decoded = codec::decode_frame_view(codecs, frame, policy->limits.kv_store_bytes, run.links->buffers());
  const auto decoded_at = Clock::now();
  if (!decoded) {
    error = decoded.error().to_string();
    return std::nullopt;
  }
  if (decoded.value().kv.size() != bytes) {
    error = "decoded KV of " + std::to_string(decoded.value().kv.size()) + " bytes";
    return std::nullopt;
  }
  FetchSample sample;
  sample.seconds = std::chrono::duration<double>(decoded_at - started).count();
  sample.reply_wait_ms = millis(fetched.value()->reply_wait);
  sample.transfer_ms = millis(fetched.value()->transfer);
  sample.decode_ms = std::chrono::duration<double, std::milli>(decoded_at - received).count();
  sample.request_ms =
      std::chrono::duration<double, std::milli>(received - started).count() - sample.reply_wait_ms - sample.transfer_ms;
  sample.frame_bytes = frame.size();
  return sample;
}

// The TLS run's agent, on the fetching node: its model's id is what the entries are filed under.
json bench_agent(const std::string& node) {
  return {{"id", "reader"},
          {"node", node},
          {"upstream", "http://127.0.0.1:1"},
          {"model",
           {{"architecture", "llama"},
            {"layers", 32},
            {"kv_heads", 8},
            {"head_dim", 128},
            {"dtype", "fp16"},
            {"weights", "transport-bench"}}}};
}

json tls_files(const std::string& node, const std::filesystem::path& dir) {
  const auto certs = dir / "certs";
  return {{"certificate", (certs / (node + ".pem")).string()},
          {"private_key", (certs / (node + "-key.pem")).string()},
          {"ca_bundle", (certs / "ca.pem").string()}};
}

// scheduler.mode of the holder, whose fetch replies the link scheduler queues ("": its default).
std::string holder_scheduler_mode;
// scheduler.chunk_bytes of the holder (0: its default): a gated fetch reply's chunk size.
std::uint32_t holder_scheduler_chunk_bytes = 0;
// ucx.rndv_thresh_bytes of both sides of a UCX run (0: left out, UCX chooses).
std::uint64_t ucx_rndv_thresh_bytes = 0;

json ucx_section(const StrategyRun& run) {
  json ucx{{"tls", run.ucx_tls}};
  if (ucx_rndv_thresh_bytes > 0) ucx["rndv_thresh_bytes"] = ucx_rndv_thresh_bytes;
  return ucx;
}

json holder_policy(const StrategyRun& run, std::uint64_t arena_bytes, std::uint64_t peer_buffer_bytes) {
  json limits{{"shm_arena_bytes", arena_bytes}, {"kv_store_bytes", 1ULL << 30}, {"peer_summary_interval_ms", 0}};
  if (peer_buffer_bytes > 0) limits["peer_buffer_bytes"] = peer_buffer_bytes;
  if (!run.strategy.empty()) limits["memory_strategy"] = run.strategy;
  json policy{
      {"schema_version", 1},
      {"node", {{"id", "kv-holder"}}},
      {"listen",
       {{"http", "127.0.0.1:0"}, {"peer", "127.0.0.1:0"}, {"unix_socket", (run.dir / "kvrelay.sock").string()}}},
      {"limits", std::move(limits)},
      {"logging", {{"level", "warn"}}}};
  if (!holder_scheduler_mode.empty()) policy["scheduler"]["mode"] = holder_scheduler_mode;
  if (holder_scheduler_chunk_bytes > 0) policy["scheduler"]["chunk_bytes"] = holder_scheduler_chunk_bytes;
  if (!run.ucx_tls.empty()) policy["ucx"] = ucx_section(run);
  if (run.tls) {
    policy["peer_tls"] = tls_files("kv-holder", run.dir);
    policy["peers"] = json::array({{{"id", "kv-fetcher"}, {"address", "127.0.0.1:1"}, {"identity", "kv-fetcher"}}});
    policy["agents"] = json::array({bench_agent("kv-fetcher")});
  }
  return policy;
}

json fetcher_policy(const StrategyRun& run, std::uint16_t peer_port, std::uint64_t peer_buffer_bytes) {
  json limits{{"kv_store_bytes", 1ULL << 30}, {"peer_summary_interval_ms", 0}};
  if (peer_buffer_bytes > 0) limits["peer_buffer_bytes"] = peer_buffer_bytes;
  if (!run.strategy.empty()) limits["memory_strategy"] = run.strategy;
  json holder{{"id", "holder"}, {"address", "127.0.0.1:" + std::to_string(peer_port)}};
  if (run.tls) holder["identity"] = "kv-holder";
  if (!run.ucx_tls.empty()) holder["transport"] = "ucx";
  json policy{{"schema_version", 1},
              {"node", {{"id", "kv-fetcher"}}},
              {"listen", {{"http", "127.0.0.1:0"}}},
              {"peers", json::array({holder})},
              {"limits", std::move(limits)},
              {"logging", {{"level", "warn"}}}};
  if (run.tls) policy["peer_tls"] = tls_files("kv-fetcher", run.dir);
  if (!run.ucx_tls.empty()) policy["ucx"] = ucx_section(run);
  return policy;
}

// Starts the holder for `run.strategy` ("" = the field left out: the daemon's default), publishes
// one entry of each size through its data plane, and builds the fetching side. `run.error` on failure.
void start_strategy(StrategyRun& run, const std::string& binary, const std::vector<std::size_t>& sizes,
                    const std::vector<std::byte>& payload, std::uint64_t peer_buffer_bytes) {
  std::uint64_t total = 0;
  for (const std::size_t bytes : sizes)
    total += bytes;
  const std::uint64_t arena_bytes = total + 64 * kMiB;  // every entry in the arena, as the daemon prefers
  if (run.tls) {
    const std::string make_certs =
        std::string(KVRELAY_BENCH_DEV_CERTS) + " " + (run.dir / "certs").string() + " kv-holder kv-fetcher > /dev/null";
    if (std::system(make_certs.c_str()) != 0) {
      run.error = "could not make development certificates: " + make_certs;
      return;
    }
    auto parsed = parse_policy(holder_policy(run, arena_bytes, peer_buffer_bytes).dump(), "holder policy");
    if (!parsed) {
      run.error = parsed.error().to_string();
      return;
    }
    run.model_id = parsed.value().find_agent("reader")->model.id();
  }
  const json policy = holder_policy(run, arena_bytes, peer_buffer_bytes);
  // The daemon's own parser first: a field this build does not know is refused here by name.
  if (auto parsed = parse_policy(policy.dump(), "holder policy"); !parsed) {
    run.error = parsed.error().to_string();
    return;
  }
  run.daemon = std::make_unique<DaemonProcess>(binary, run.dir, policy);
  if (!run.daemon->ready()) {
    run.error = "kvrelay serve did not start: " + run.daemon->log();
    return;
  }
  auto client = shm::ShmClient::connect((run.dir / "kvrelay.sock").string());
  if (!client) {
    run.error = "data plane: " + client.error().to_string();
    return;
  }
  for (const std::size_t bytes : sizes) {
    const auto chain = chain_for(bytes);
    auto published =
        client.value().publish_with_context({run.model_id, chain_hash_for(run.model_id, bytes)}, kv_layout_for(bytes),
                                            std::span(payload.data(), bytes), "", Fidelity::exact(), &chain);
    if (!published) {
      run.error = "publish: " + published.error().to_string();
      return;
    }
  }
  auto fetching =
      parse_policy(fetcher_policy(run, run.daemon->peer_port(), peer_buffer_bytes).dump(), "fetcher policy");
  if (!fetching) {
    run.error = fetching.error().to_string();
    return;
  }
  run.policy = std::make_shared<FixedPolicy>(std::move(fetching).value());
  run.registry = std::make_unique<metrics::Registry>();
  run.links = std::make_unique<broker::PeerLinks>(run.policy, *run.registry);  // no prober: not started
  if (run.tls) {
    auto tls = peer::PeerTls::load(run.policy->current()->peer_tls);
    if (!tls) {
      run.error = "fetcher TLS: " + tls.error().to_string();
      return;
    }
    run.links->set_tls(std::move(tls).value());
  }
  if (!run.ucx_tls.empty()) {
    // As the daemon makes its context from its policy's ucx section.
    auto context = peer::UcxContext::create(run.policy->current()->ucx);
    if (!context) {
      run.error = "fetcher UCX context: " + context.error().to_string();
      return;
    }
    run.links->set_ucx(std::move(context).value());
  }
}

// Where a run's figures go under memory_strategies.
std::string run_label(const StrategyRun& run) {
  if (run.tls) return run.strategy + "+tls";
  if (!run.ucx_tls.empty()) return run.strategy + "+ucx-" + run.ucx_tls;
  return run.strategy;
}

std::string size_key(std::size_t bytes) {
  return std::to_string(bytes / kMiB) + "MiB";
}

// The figures of one (strategy, codec) variant at one size.
struct VariantRuns {
  std::vector<double> paired;  // raw time / fetch time
  std::vector<double> gbps;    // raw KV bytes / fetch time
  std::vector<double> reply_wait_ms, transfer_ms, decode_ms, request_ms;
  std::size_t frame_bytes = 0;
  std::string error;
};

json median_of(const std::vector<double>& values) {
  return values.empty() ? json(nullptr) : json(audit::median(values));
}

nlohmann::json machine() {
  utsname name{};
  ::uname(&name);
  std::string cpu;
  std::ifstream cpuinfo("/proc/cpuinfo");
  for (std::string line; std::getline(cpuinfo, line);) {
    if (line.rfind("model name", 0) == 0) {
      cpu = line.substr(line.find(':') + 2);
      break;
    }
  }
  return {
      {"host", name.nodename}, {"kernel", name.release}, {"cpu", cpu}, {"cores", std::thread::hardware_concurrency()}};
}

json load_average() {
  double loads[3] = {0, 0, 0};
  std::ifstream in("/proc/loadavg");
  in >> loads[0] >> loads[1] >> loads[2];
  return json::array({loads[0], loads[1], loads[2]});
}

}  // namespace

int main(int argc, char** argv) {
  CLI::App app{
      "transport_bench: a KV fetch through a real kvrelay daemon next to raw loopback TCP, and the "
      "shared-memory data plane next to memcpy (JSON)"};
  std::vector<std::size_t> sizes_mib{16, 256};
  std::string memory_strategy = "both";
  std::vector<std::string> codec_names{"raw"};
  std::string daemon_binary = KVRELAY_BENCH_DAEMON_BINARY;
  bool skip_shm = false;
  std::uint64_t peer_buffer_mib = 0;
  app.add_option("--repeats", kRepeats,
                 "pairs at 64 MiB and up (proportionally more below: 16 MiB gets 4x); shm runs per measurement")
      ->check(CLI::Range(1, 1000));
  app.add_option("--sizes-mib", sizes_mib, "KV sizes to fetch, in MiB (default 16 256)")
      ->check(CLI::Range(std::size_t{1}, std::size_t{1024}));
  app.add_option("--memory-strategy", memory_strategy,
                 "limits.memory_strategy of both sides: portable, prefault or both (alternated in one run)")
      ->check(CLI::IsMember({"portable", "prefault", "both"}));
  app.add_option("--codecs", codec_names, "fetch codecs, each alternated with the raw socket (raw, lossless, ...)");
  app.add_option("--kvrelay", daemon_binary, "the kvrelay binary to run as the holding daemon");
  app.add_option("--peer-buffer-mib", peer_buffer_mib,
                 "limits.peer_buffer_bytes of both sides in MiB (0: the policy default, left out)");
  app.add_flag("--skip-shm", skip_shm, "measure only the KV fetch and its raw baseline");
  bool skip_tls = false;
  app.add_flag("--skip-tls", skip_tls, "no TLS peer run (tls_fetch_vs_plaintext_paired)");
  bool skip_ucx = false;
  app.add_flag("--skip-ucx", skip_ucx, "no UCX peer runs and no ucx_perftest (ucx_fetch_vs_perftest_paired)");
  std::vector<std::string> ucx_transports{"tcp", "posix"};
  app.add_option("--ucx-transports", ucx_transports, "UCX_TLS of the UCX runs, one run each (default tcp posix)")
      ->check(CLI::IsMember({"tcp", "posix"}));
  std::string perftest_path = "/usr/bin/ucx_perftest";
  app.add_option("--ucx-perftest", perftest_path, "ucx_perftest, the UCX runs' limit (else the first on PATH)");
  std::string perftest_wait_mode = "poll";
  app.add_option("--perftest-wait-mode", perftest_wait_mode,
                 "ucx_perftest -E: poll (default: both sides spin in ucp_worker_progress, the limit) or sleep "
                 "(they wait for UCX's wake-up events, as kvrelay's workers do)")
      ->check(CLI::IsMember({"poll", "sleep"}));
  std::size_t perftest_mib = 512;
  app.add_option("--perftest-mib", perftest_mib,
                 "MiB ucx_perftest measures per sample (at least 4 messages, and an eighth as many unmeasured first)")
      ->check(CLI::Range(std::size_t{16}, std::size_t{65536}));
  app.add_option("--scheduler-mode", holder_scheduler_mode,
                 "scheduler.mode of the holding daemon: wrr, fifo or off (default: the policy default, wrr)")
      ->check(CLI::IsMember({"wrr", "fifo", "off"}));
  std::uint32_t scheduler_chunk_kib = 0;
  app.add_option("--scheduler-chunk-kib", scheduler_chunk_kib,
                 "scheduler.chunk_bytes of the holding daemon in KiB, the chunk size of its (gated) fetch replies "
                 "(default: the policy default, 256)")
      ->check(CLI::Range(4U, 65536U));
  app.add_option("--ucx-rndv-thresh-bytes", ucx_rndv_thresh_bytes,
                 "ucx.rndv_thresh_bytes of both sides of the UCX runs (default: left out, UCX chooses)");
  CLI11_PARSE(app, argc, argv);
  holder_scheduler_chunk_bytes = scheduler_chunk_kib * 1024U;
  // The JSON alone on stdout: UCX logs there (UCX_LOG_FILE's default), so whatever libraries
  // write to it goes to stderr instead.
  const int json_fd = ::dup(STDOUT_FILENO);
  std::FILE* json_out = json_fd >= 0 ? ::fdopen(json_fd, "w") : nullptr;
  if (json_out == nullptr || ::dup2(STDERR_FILENO, STDOUT_FILENO) < 0) {
    std::perror("stdout");
    return 1;
  }

  std::vector<std::size_t> sizes;
  for (const std::size_t mib : sizes_mib)
    sizes.push_back(mib * kMiB);
  const std::size_t largest = *std::max_element(sizes.begin(), sizes.end());
  const auto payload = make_payload(std::max(largest, 256 * kMiB));
  json result;
  result["bench"] = "transport_bench";
  result["machine"] = machine();
  result["machine"]["load_average_start"] = load_average();
  result["repeats"] = kRepeats;
  result["scheduler_mode"] = holder_scheduler_mode.empty() ? "default (wrr)" : holder_scheduler_mode;
  if (holder_scheduler_chunk_bytes > 0) result["scheduler_chunk_bytes"] = holder_scheduler_chunk_bytes;
  if (ucx_rndv_thresh_bytes > 0) result["ucx_rndv_thresh_bytes"] = ucx_rndv_thresh_bytes;

  // Data plane (worker <-> its sidecar).
  result["memcpy_gbps"] = bench_memcpy(payload);
  if (!skip_shm) {
    const std::vector<std::byte> shm_payload(payload.begin(),
                                             payload.begin() + static_cast<std::ptrdiff_t>(256 * kMiB));
    result["memfd_write_gbps"] = bench_memfd_write(shm_payload);
    // Arena big enough for the two entries the store keeps plus the one being written.
    const auto shm_results = bench_shm(shm_payload, 3 * shm_payload.size(), true);
    const auto sealed_results = bench_shm(shm_payload, 0, false);
    const double memcpy_gbps = result["memcpy_gbps"].get<double>();
    result["shm_publish_gbps"] = shm_results.publish_gbps;
    result["shm_first_publish_gbps"] = shm_results.first_publish_gbps;
    result["shm_publish_vs_memcpy_paired"] = bench::spread_json(shm_results.publish_vs_memcpy_paired);
    result["shm_commit_in_place_gbps"] = shm_results.commit_in_place_gbps;
    result["shm_commit_in_place_vs_memcpy_paired"] = bench::spread_json(shm_results.commit_in_place_vs_memcpy_paired);
    result["shm_publish_sealed_segments_gbps"] = sealed_results.publish_gbps;
    result["shm_publish_sealed_segments_vs_memfd_write"] =
        sealed_results.publish_gbps / result["memfd_write_gbps"].get<double>();
    result["shm_publish_vs_memcpy_best"] = shm_results.publish_gbps / memcpy_gbps;
    result["shm_small_msg_p50_us"] = shm_results.small_p50_us;
    result["shm_small_msg_p99_us"] = shm_results.small_p99_us;
  }

  // KV fetch across nodes, one holding daemon per memory strategy.
  char dir_template[] = "/tmp/kvrelay-tbench-XXXXXX";
  if (::mkdtemp(dir_template) == nullptr) {
    std::perror("mkdtemp");
    return 1;
  }
  const std::filesystem::path base_dir = dir_template;
  const std::uint64_t peer_buffer_bytes = peer_buffer_mib * kMiB;  // 0: left out of the policies
  std::vector<std::string> wanted =
      memory_strategy == "both" ? std::vector<std::string>{"portable", "prefault"} : std::vector{memory_strategy};
  std::vector<std::unique_ptr<StrategyRun>> runs;
  json strategy_notes = json::object();
  for (const auto& strategy : wanted) {
    auto run = std::make_unique<StrategyRun>();
    run->strategy = strategy;
    run->dir = base_dir / strategy;
    std::filesystem::create_directories(run->dir);
    start_strategy(*run, daemon_binary, sizes, payload, peer_buffer_bytes);
    if (!run->error.empty() && strategy == "portable" && run->error.find("memory_strategy") != std::string::npos) {
      // This build has no limits.memory_strategy: portable is what it does, with the field left out.
      strategy_notes[strategy] = "limits.memory_strategy refused by this build (" + run->error +
                                 "); ran with the field left out, which is portable";
      run = std::make_unique<StrategyRun>();
      run->strategy = "";
      run->dir = base_dir / strategy;
      start_strategy(*run, daemon_binary, sizes, payload, peer_buffer_bytes);
      run->strategy = strategy;
    }
    if (!run->error.empty()) {
      strategy_notes[strategy] = "not run: " + run->error;
      std::fprintf(stderr, "memory strategy %s: %s\n", strategy.c_str(), run->error.c_str());
      continue;
    }
    runs.push_back(std::move(run));
  }
  // The TLS run: the headline strategy's settings with TLS peers on both sides.
  std::optional<std::size_t> tls_index;
  json tls_note;
  if (!runs.empty() && !skip_tls) {
    auto run = std::make_unique<StrategyRun>();
    run->strategy = runs.front()->strategy;
    run->tls = true;
    run->dir = base_dir / "tls";
    std::filesystem::create_directories(run->dir);
    start_strategy(*run, daemon_binary, sizes, payload, peer_buffer_bytes);
    if (run->error.empty()) {
      tls_index = runs.size();
      runs.push_back(std::move(run));
    } else {
      tls_note = "not run: " + run->error;
      std::fprintf(stderr, "TLS run: %s\n", run->error.c_str());
    }
  }
  // The UCX runs (issue #29): the headline strategy's settings with chunk streams over UCX, one
  // holder per UCX_TLS, each measured next to ucx_perftest of the same transport.
  std::map<std::string, std::size_t> ucx_index;  // UCX_TLS -> its run
  json ucx_notes = json::object();               // UCX_TLS -> why it did not run
  std::string ucx_skipped;
  const std::string perftest_binary = bench::find_ucx_perftest(perftest_path);
  if (skip_ucx) {
    ucx_skipped = "--skip-ucx";
  } else if (!peer::ucx_built()) {
    ucx_skipped = "this build has no UCX (peer::ucx_built() is false: libucx-dev was absent at configure time)";
  } else if (perftest_binary.empty()) {
    ucx_skipped =
        "no ucx_perftest (" + perftest_path + ", nor on PATH; it is in ucx-utils): no limit to measure against";
  } else if (runs.empty()) {
    ucx_skipped = "no TCP run started";
  }
  for (const auto& transport : ucx_transports) {
    if (!ucx_skipped.empty()) break;
    auto run = std::make_unique<StrategyRun>();
    run->strategy = runs.front()->strategy;
    run->ucx_tls = transport;
    run->dir = base_dir / ("ucx-" + transport);
    std::filesystem::create_directories(run->dir);
    start_strategy(*run, daemon_binary, sizes, payload, peer_buffer_bytes);
    if (run->error.empty()) {
      ucx_index[transport] = runs.size();
      runs.push_back(std::move(run));
    } else {
      ucx_notes[transport] = "not run: " + run->error;
      std::fprintf(stderr, "UCX run (UCX_TLS=%s): %s\n", transport.c_str(), run->error.c_str());
    }
  }
  std::optional<bench::UcxPerftest> perftest;
  if (!ucx_index.empty()) {
    // The same UCX configuration as the runs it is the limit of.
    std::vector<std::string> perftest_environment{"UCX_NET_DEVICES=" +
                                                  runs[ucx_index.begin()->second]->policy->current()->ucx.net_devices};
    if (ucx_rndv_thresh_bytes > 0)
      perftest_environment.push_back("UCX_RNDV_THRESH=" + std::to_string(ucx_rndv_thresh_bytes));
    perftest.emplace(perftest_binary, base_dir / "perftest", std::move(perftest_environment), perftest_wait_mode);
  }
  const auto perftest_iterations = [&](std::size_t bytes) {
    return static_cast<int>(std::max<std::size_t>(4, perftest_mib * kMiB / bytes));
  };
  const auto perftest_warmup = [&](std::size_t bytes) { return std::max(1, perftest_iterations(bytes) / 8); };
  if (runs.empty()) {
    std::fprintf(stderr, "no memory strategy could run\n");
    std::fprintf(json_out, "%s\n", result.dump(2).c_str());
    return 1;
  }

  const auto codecs = codec::CodecRegistry::with_builtins();
  // A UCX run fetches codec raw only: what it is compared with, perftest, moves bytes as they are.
  const auto codecs_of = [&](std::size_t index) {
    return runs[index]->ucx_tls.empty() ? codec_names : std::vector<std::string>{"raw"};
  };
  RawTcpPair raw_pair(largest);
  std::uint64_t request_id = 0;
  // variants[(strategy index, codec)][size]
  std::map<std::pair<std::size_t, std::string>, std::map<std::size_t, VariantRuns>> variants;
  std::map<std::size_t, std::vector<double>> raw_gbps;
  std::map<std::size_t, std::vector<double>> tls_vs_plaintext;  // per pair, raw codec
  // Per UCX_TLS, per size: perftest GB/s, UCX fetch throughput / perftest bandwidth per pair, and
  // plaintext TCP fetch time / UCX fetch time per pair; the last perftest error.
  std::map<std::string, std::map<std::size_t, std::vector<double>>> perftest_gbps, ucx_vs_perftest, ucx_vs_tcp_fetch;
  std::map<std::string, std::map<std::size_t, std::string>> perftest_errors;
  for (const std::size_t bytes : sizes) {
    const auto run_perftest = [&](const std::string& transport) -> double {
      const auto sample = perftest->run(transport, bytes, perftest_iterations(bytes), perftest_warmup(bytes),
                                        std::chrono::seconds(120));
      if (!sample.error.empty()) {
        perftest_errors[transport][bytes] = sample.error;
        std::fprintf(stderr, "ucx_perftest (UCX_TLS=%s, %zu MiB): %s\n", transport.c_str(), bytes / kMiB,
                     sample.error.c_str());
      }
      return sample.gbps;
    };
    // Unmeasured first: connects, fills the warm buffers on both sides, settles the daemon.
    for (int warm = 0; warm < 2; ++warm) {
      (void)raw_pair.once(payload.data(), bytes);
      for (std::size_t index = 0; index < runs.size(); ++index) {
        for (const auto& codec : codecs_of(index)) {
          std::string error;
          if (!fetch_once(*runs[index], codecs, bytes, codec, request_id, error))
            variants[{index, codec}][bytes].error = error;
        }
      }
      for (const auto& [transport, index] : ucx_index)
        if (warm == 0) (void)run_perftest(transport);
    }
    const int pairs = kRepeats * static_cast<int>(std::max<std::size_t>(1, 64 * kMiB / bytes));
    // The measured things of one pair, in an order rotated pair by pair so that neither side is
    // always first (first after a pause, or right after the other's writes to memory). A UCX run
    // and its ucx_perftest are one step: side by side, which of them first alternating pair by pair.
    struct PairStep {
      enum class Kind : std::uint8_t { kRawSocket, kFetch, kUcxAndPerftest };
      Kind kind = Kind::kRawSocket;
      std::size_t index = 0;  // the run (kFetch, kUcxAndPerftest)
      std::string codec;      // kFetch
    };
    std::vector<PairStep> order{{PairStep::Kind::kRawSocket, 0, ""}};
    for (std::size_t index = 0; index < runs.size(); ++index) {
      if (!runs[index]->ucx_tls.empty()) {
        order.push_back({PairStep::Kind::kUcxAndPerftest, index, "raw"});
        continue;
      }
      for (const auto& codec : codec_names)
        order.push_back({PairStep::Kind::kFetch, index, codec});
    }
    for (int pair = 0; pair < pairs; ++pair) {
      double raw_seconds = 0;
      std::vector<std::pair<std::pair<std::size_t, std::string>, FetchSample>> samples;
      std::map<std::string, double> perftest_now;  // UCX_TLS -> this pair's perftest GB/s
      const auto fetch_step = [&](std::size_t index, const std::string& codec) {
        std::string error;
        const auto key = std::make_pair(index, codec);
        if (auto sample = fetch_once(*runs[index], codecs, bytes, codec, request_id, error)) {
          samples.emplace_back(key, *sample);
        } else {
          variants[key][bytes].error = error;
        }
      };
      for (std::size_t step = 0; step < order.size(); ++step) {
        const auto& next = order[(step + static_cast<std::size_t>(pair)) % order.size()];
        switch (next.kind) {
          case PairStep::Kind::kRawSocket:
            raw_seconds = raw_pair.once(payload.data(), bytes);
            break;
          case PairStep::Kind::kFetch:
            fetch_step(next.index, next.codec);
            break;
          case PairStep::Kind::kUcxAndPerftest: {
            const auto& transport = runs[next.index]->ucx_tls;
            const bool perftest_first = pair % 2 == 1;
            if (perftest_first) perftest_now[transport] = run_perftest(transport);
            fetch_step(next.index, "raw");
            if (!perftest_first) perftest_now[transport] = run_perftest(transport);
            break;
          }
        }
      }
      double plaintext_seconds = 0;
      double tls_seconds = 0;
      std::map<std::string, double> ucx_seconds;
      for (const auto& [key, sample] : samples) {
        if (key.second != "raw") continue;
        if (tls_index && key.first == *tls_index) tls_seconds = sample.seconds;
        if (key.first == 0) plaintext_seconds = sample.seconds;
        if (!runs[key.first]->ucx_tls.empty()) ucx_seconds[runs[key.first]->ucx_tls] = sample.seconds;
      }
      if (plaintext_seconds > 0 && tls_seconds > 0) tls_vs_plaintext[bytes].push_back(plaintext_seconds / tls_seconds);
      for (const auto& [transport, limit_gbps] : perftest_now) {
        if (limit_gbps <= 0) continue;
        perftest_gbps[transport][bytes].push_back(limit_gbps);
        if (ucx_seconds.contains(transport))
          ucx_vs_perftest[transport][bytes].push_back(gbps(bytes, ucx_seconds[transport]) / limit_gbps);
      }
      for (const auto& [transport, seconds] : ucx_seconds)
        if (plaintext_seconds > 0) ucx_vs_tcp_fetch[transport][bytes].push_back(plaintext_seconds / seconds);
      if (raw_seconds <= 0) continue;
      raw_gbps[bytes].push_back(gbps(bytes, raw_seconds));
      for (const auto& [key, sample] : samples) {
        auto& figures = variants[key][bytes];
        figures.paired.push_back(raw_seconds / sample.seconds);
        figures.gbps.push_back(gbps(bytes, sample.seconds));
        figures.reply_wait_ms.push_back(sample.reply_wait_ms);
        figures.transfer_ms.push_back(sample.transfer_ms);
        figures.decode_ms.push_back(sample.decode_ms);
        figures.request_ms.push_back(sample.request_ms);
        figures.frame_bytes = sample.frame_bytes;
      }
    }
  }

  json raw_json = json::object();
  for (const auto& [bytes, values] : raw_gbps)
    raw_json[size_key(bytes)] = bench::spread_json(values);
  json by_strategy = json::object();
  for (std::size_t index = 0; index < runs.size(); ++index) {
    json figures = json::object();
    figures["holder_peer_buffer_bytes"] = runs[index]->policy->current()->limits.peer_buffer_bytes;
    for (const auto& codec : codecs_of(index)) {
      const std::string prefix = codec == "raw" ? "kv_fetch" : "kv_fetch_" + codec;
      json paired = json::object();
      json rate = json::object();
      json rate_spread = json::object();
      json steps = json::object();
      json errors = json::object();
      for (const std::size_t bytes : sizes) {
        const auto& runs_of = variants[{index, codec}][bytes];
        const auto key = size_key(bytes);
        paired[key] = bench::spread_json(runs_of.paired);
        rate[key] = median_of(runs_of.gbps);
        rate_spread[key] = bench::spread_json(runs_of.gbps);
        steps[key] = {{"request_ms", median_of(runs_of.request_ms)},
                      {"reply_wait_ms", median_of(runs_of.reply_wait_ms)},
                      {"transfer_ms", median_of(runs_of.transfer_ms)},
                      {"decode_ms", median_of(runs_of.decode_ms)},
                      {"frame_bytes", runs_of.frame_bytes}};
        if (!runs_of.error.empty()) errors[key] = runs_of.error;
      }
      figures[prefix + "_vs_raw_tcp_paired"] = std::move(paired);
      figures[prefix + "_gbps"] = std::move(rate);
      figures[prefix + "_gbps_runs"] = std::move(rate_spread);
      figures[prefix + "_steps_median"] = std::move(steps);
      if (!errors.empty()) figures[prefix + "_errors"] = std::move(errors);
    }
    // What the holder said, where a fetch from it failed.
    bool failed = false;
    for (const auto& codec : codecs_of(index))
      for (const std::size_t bytes : sizes)
        failed = failed || !variants[{index, codec}][bytes].error.empty();
    if (failed) {
      const std::string log = runs[index]->daemon->log();
      figures["holder_log_tail"] = log.substr(log.size() > 4000 ? log.size() - 4000 : 0);
    }
    by_strategy[run_label(*runs[index])] = std::move(figures);
  }
  // The headline: the first strategy that ran (portable, the default, unless only prefault was asked for).
  const std::string headline = runs.front()->strategy;
  result["memory_strategy"] = headline;
  result["kv_fetch_codecs"] = codec_names;
  result["kv_layout"] = "32 layers x 8 KV heads x 128, fp16 (Llama-3-8B): 128 KiB per token";
  result["kv_fetch_vs_raw_tcp_paired"] = by_strategy[headline]["kv_fetch_vs_raw_tcp_paired"];
  result["kv_fetch_gbps"] = by_strategy[headline]["kv_fetch_gbps"];
  json raw_median = json::object();
  for (const auto& [bytes, values] : raw_gbps)
    raw_median[size_key(bytes)] = audit::median(values);
  result["raw_tcp_gbps"] = std::move(raw_median);
  result["raw_tcp_gbps_runs"] = std::move(raw_json);
  if (tls_index) {
    json paired = json::object();
    for (const std::size_t bytes : sizes)
      paired[size_key(bytes)] = bench::spread_json(tls_vs_plaintext[bytes]);
    const std::string tls_key = runs[*tls_index]->strategy + "+tls";
    result["tls_fetch_vs_plaintext_paired"] = std::move(paired);
    result["tls_fetch_gbps"] = by_strategy[tls_key]["kv_fetch_gbps"];
    result["tls_fetch_vs_raw_tcp_paired"] = by_strategy[tls_key]["kv_fetch_vs_raw_tcp_paired"];
    if (by_strategy[tls_key].contains("kv_fetch_errors"))
      result["tls_fetch_errors"] = by_strategy[tls_key]["kv_fetch_errors"];
  } else if (!skip_tls) {
    result["tls_fetch_vs_plaintext_paired"] = tls_note;
  }
  if (!ucx_skipped.empty()) {
    result["ucx_skipped"] = ucx_skipped;
  } else {
    // UCX_TLS=tcp's figures under the plain names, posix's with "_posix".
    const auto named = [](const std::string& stem, const std::string& transport) {
      return transport == "tcp" ? "ucx_" + stem : "ucx_" + transport + "_" + stem;
    };
    const auto per_size = [&](const std::map<std::size_t, std::vector<double>>& values, bool spread) {
      json out = json::object();
      for (const std::size_t bytes : sizes) {
        const auto found = values.find(bytes);
        const std::vector<double> none;
        const auto& of = found == values.end() ? none : found->second;
        out[size_key(bytes)] = spread ? bench::spread_json(of) : median_of(of);
      }
      return out;
    };
    json medians = json::object();
    for (const std::size_t bytes : sizes)
      medians[size_key(bytes)] = {{"kvrelay_tcp_fetch", result["kv_fetch_gbps"][size_key(bytes)]},
                                  {"raw_tcp", result["raw_tcp_gbps"].value(size_key(bytes), json(nullptr))}};
    for (const auto& transport : ucx_transports) {
      if (!ucx_index.contains(transport)) {
        result[named("fetch_vs_perftest_paired", transport)] = ucx_notes[transport];
        continue;
      }
      const std::string label = run_label(*runs[ucx_index[transport]]);
      result[named("fetch_vs_perftest_paired", transport)] = per_size(ucx_vs_perftest[transport], true);
      result[named("fetch_gbps", transport)] = by_strategy[label]["kv_fetch_gbps"];
      result[named("fetch_vs_tcp_fetch_paired", transport)] = per_size(ucx_vs_tcp_fetch[transport], true);
      result["perftest_" + transport + "_gbps"] = per_size(perftest_gbps[transport], false);
      result["perftest_" + transport + "_gbps_runs"] = per_size(perftest_gbps[transport], true);
      if (by_strategy[label].contains("kv_fetch_errors"))
        result[named("fetch_errors", transport)] = by_strategy[label]["kv_fetch_errors"];
      for (const std::size_t bytes : sizes) {
        auto& at = medians[size_key(bytes)];
        at["ucx_fetch_" + transport] = by_strategy[label]["kv_fetch_gbps"][size_key(bytes)];
        at["perftest_" + transport] = median_of(perftest_gbps[transport][bytes]);
      }
    }
    result["ucx_gbps_medians"] = std::move(medians);
    // Which moves the KV faster here, by the paired median of TCP fetch time / UCX fetch time.
    if (ucx_index.contains("tcp")) {
      json faster = json::object();
      for (const std::size_t bytes : sizes) {
        const auto& paired = ucx_vs_tcp_fetch["tcp"][bytes];
        faster[size_key(bytes)] = paired.empty()                ? json("unknown: no pair of both")
                                  : audit::median(paired) > 1.0 ? json("ucx (UCX_TLS=tcp)")
                                                                : json("kvrelay tcp fetch");
      }
      result["faster_on_this_machine"] = std::move(faster);
    }
    if (perftest) {  // none when no UCX run started
      json iterations = json::object();
      json errors = json::object();
      for (const std::size_t bytes : sizes)
        iterations[size_key(bytes)] = {{"measured", perftest_iterations(bytes)}, {"warmup", perftest_warmup(bytes)}};
      for (const auto& [transport, by_size] : perftest_errors)
        for (const auto& [bytes, error] : by_size)
          errors[transport][size_key(bytes)] = error;
      std::string perftest_environment_text = "UCX_TLS=<transport>";
      for (const auto& setting : perftest->environment())
        perftest_environment_text += " " + setting;
      perftest_environment_text += ", no other UCX_ variable";
      std::string client = perftest_binary;
      for (const auto& argument :
           bench::UcxPerftest::client_arguments("PORT", "SIZE", "MEASURED", "WARMUP", perftest_wait_mode))
        client += " " + argument;
      json perftest_report{{"binary", perftest_binary},
                           {"server", perftest_binary + " -p PORT"},
                           {"wait_mode", perftest_wait_mode},
                           {"client", client},
                           {"environment", perftest_environment_text},
                           {"figure", "overall bandwidth of the measured iterations (MB/s of 2^20 bytes) as GB/s"},
                           {"iterations", std::move(iterations)}};
      if (!errors.empty()) perftest_report["errors"] = std::move(errors);
      result["ucx_perftest"] = std::move(perftest_report);
    }
  }
  result["memory_strategies"] = std::move(by_strategy);
  if (!strategy_notes.empty()) result["memory_strategy_notes"] = std::move(strategy_notes);
  result["machine"]["load_average_end"] = load_average();
  result["goals"] = {{"kv_fetch_vs_raw_tcp_paired", ">= 0.8 (median)"},
                     {"shm_publish_vs_memcpy_paired", ">= 0.8 (median)"},
                     {"tls_fetch_vs_plaintext_paired", ">= 0.5 (median)"},
                     {"ucx_fetch_vs_perftest_paired", ">= 0.8 (median)"},
                     {"shm_small_msg_p50_us", "< 20"}};
  runs.clear();  // drain the daemons before their directory goes
  std::error_code ignored;
  std::filesystem::remove_all(base_dir, ignored);
  std::fprintf(json_out, "%s\n", result.dump(2).c_str());
  std::fclose(json_out);
  return 0;
}
