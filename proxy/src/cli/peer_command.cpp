// `kvrelay peer send` and `kvrelay peer probe`: the peer plane from the command line, for
// operators checking links and for tests that kill a real sender or receiver mid-transfer.
// `send` pushes a KV frame exactly as a sidecar's push does (PeerClient::push_encoded).

#include <fcntl.h>
#include <sys/stat.h>

#include <nlohmann/json.hpp>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <memory>
#include <vector>

#include "kvrelay/codec_plugins/frame.h"
#include "kvrelay/core/policy.h"
#include "kvrelay/kv_store/memfd.h"
#include "kvrelay/peer/peer_client.h"

#include "commands.h"

namespace kvrelay::cli {

namespace {

struct SendOptions {
  std::string to;
  std::string config;  // with peer_id: the address comes from the policy
  std::string peer_id;
  std::uint64_t transfer_id = 0;
  std::uint64_t model_id = 1;
  std::uint64_t context_hash = 0;  // 0: use the transfer id
  std::uint32_t chunk_bytes = 1U << 20;
  std::uint32_t window = 8;
  double rate_limit_mib_per_s = 0;
  bool progress = false;
  bool no_staging = false;
  bool no_split = false;
  std::string node_id = "kvrelay-cli";
  std::string route;  // the route the push is for, which the receiver authorizes (issue #25)
  std::string file;
};

struct ProbeOptions {
  std::string address;
  unsigned count = 5;
};

int fail_with(const std::string& message) {
  std::fprintf(stderr, "kvrelay peer: %s\n", message.c_str());
  return 1;
}

int run_send(const SendOptions& options) {
  peer::PeerClientOptions client_options;
  HostPort target;
  if (!options.peer_id.empty()) {
    if (options.config.empty()) return fail_with("--peer needs --config");
    auto policy = load_policy_file(options.config, PolicySecrets::kSkip);  // the peers, not the admin token
    if (!policy) return fail_with(policy.error().message);
    const PeerPolicy* peer = policy.value().find_peer(options.peer_id);
    if (peer == nullptr) return fail_with("no peer '" + options.peer_id + "' in " + options.config);
    client_options = peer::peer_client_options(policy.value());
    target = peer->address;
    if (policy.value().peer_tls.enabled()) {  // as the daemon of that policy connects (issue #25)
      auto tls = peer::PeerTls::load(policy.value().peer_tls);
      if (!tls) return fail_with(tls.error().to_string());
      client_options.tls = std::move(tls).value();
      client_options.identity = peer_identity(*peer);
    }
  } else {
    if (options.to.empty()) return fail_with("give --to HOST:PORT or --config with --peer ID");
    auto address = parse_host_port(options.to);
    if (!address) return fail_with(address.error().to_string());
    target = address.value();
    client_options.node_id = options.node_id;
  }
  UniqueFd file(::open(options.file.c_str(), O_RDONLY | O_CLOEXEC));
  if (!file) return fail_with("cannot open " + options.file);
  struct stat info {};
  if (::fstat(file.get(), &info) != 0) return fail_with("cannot stat " + options.file);
  if (info.st_size == 0) return fail_with(options.file + " is empty, not a KV frame");
  auto mapping = kv_store::Mapping::map(file.get(), static_cast<std::uint64_t>(info.st_size), false);
  if (!mapping) return fail_with(mapping.error().to_string());
  const auto frame =
      std::span(reinterpret_cast<const std::uint8_t*>(mapping.value().bytes().data()), mapping.value().bytes().size());
  // Refused here with the frame's own error, before a peer has to refuse it.
  auto header = codec::inspect_frame(frame);
  if (!header) return fail_with(options.file + " is not a KV frame: " + header.error().to_string());

  client_options.chunk_bytes = options.chunk_bytes;
  client_options.window_chunks = options.window;
  if (options.no_staging) client_options.stage_chunks = false;
  if (options.no_split) client_options.split_single_chunk = false;
  client_options.rate_limit_bytes_per_s = static_cast<std::uint64_t>(options.rate_limit_mib_per_s * 1024 * 1024);
  if (options.progress) {
    client_options.on_progress = [](std::uint64_t done, std::uint64_t total) {
      std::printf("progress %llu %llu\n", static_cast<unsigned long long>(done),
                  static_cast<unsigned long long>(total));
      std::fflush(stdout);
    };
  }
  const auto started = std::chrono::steady_clock::now();
  auto client = peer::PeerClient::connect(target, client_options);
  if (!client) return fail_with(client.error().to_string());
  const kv_store::EntryKey key{options.model_id,
                               options.context_hash != 0 ? options.context_hash : options.transfer_id};
  if (auto sent = client.value().push_encoded(options.transfer_id, key, frame, options.route); !sent) {
    return fail_with(sent.error().to_string());
  }
  const double seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - started).count();
  nlohmann::json result{{"outcome", "committed"},
                        {"transfer_id", options.transfer_id},
                        {"bytes", mapping.value().size()},
                        {"peer", client.value().remote().node_id},
                        {"seconds", seconds}};
  std::printf("%s\n", result.dump().c_str());
  return 0;
}

int run_probe(const ProbeOptions& options) {
  auto address = parse_host_port(options.address);
  if (!address) return fail_with(address.error().to_string());
  auto client = peer::PeerClient::connect(address.value(), {});
  if (!client) return fail_with(client.error().to_string());
  std::vector<double> rtts;
  for (unsigned index = 0; index < std::max(1U, options.count); ++index) {
    auto rtt = client.value().ping();
    if (!rtt) return fail_with(rtt.error().to_string());
    rtts.push_back(static_cast<double>(rtt.value().count()));
  }
  std::sort(rtts.begin(), rtts.end());
  auto stats = client.value().stats();
  if (!stats) return fail_with(stats.error().to_string());
  const auto& remote = client.value().remote();
  nlohmann::json result{{"node", remote.node_id},
                        {"protocol_version", remote.protocol_version},
                        {"capabilities", remote.capabilities},
                        {"shm_socket", remote.shm_socket},
                        {"rtt_us_min", rtts.front()},
                        {"rtt_us_p50", rtts[rtts.size() / 2]},
                        {"stats",
                         {{"sessions", stats.value().sessions},
                          {"active_transfers", stats.value().active_transfers},
                          {"committed_transfers", stats.value().committed_transfers},
                          {"duplicate_transfers", stats.value().duplicate_transfers},
                          {"failed_transfers", stats.value().failed_transfers},
                          {"bytes_received", stats.value().bytes_received},
                          {"chunks_received", stats.value().chunks_received},
                          {"fetches_served", stats.value().fetches_served}}}};
  std::printf("%s\n", result.dump().c_str());
  return 0;
}

}  // namespace

void add_peer_command(CLI::App& app, int& exit_code) {
  auto* peer = app.add_subcommand("peer", "Talk to another sidecar over the TCP peer plane");
  peer->require_subcommand(1);

  auto send = std::make_shared<SendOptions>();
  auto* send_command =
      peer->add_subcommand("send", "Push a KV frame file (kvrelay codec encode) to a peer sidecar, which files it");
  send_command->add_option("--to", send->to, "Peer address HOST:PORT");
  send_command->add_option("--config", send->config, "Policy file; with --peer, the peer's address");
  send_command->add_option("--peer", send->peer_id, "Peer id from the policy's peers[]");
  send_command->add_option("--transfer-id", send->transfer_id, "Id of the push (its chunks carry it)")->required();
  send_command->add_option("--model-id", send->model_id, "Entry key: model fingerprint id");
  send_command->add_option("--context-hash", send->context_hash, "Entry key: context digest (default: transfer id)");
  send_command->add_option("--chunk-bytes", send->chunk_bytes, "Chunk size")->check(CLI::Range(1U, 16U << 20));
  send_command->add_option("--window", send->window, "Unacknowledged chunks in flight")->check(CLI::Range(1U, 1024U));
  send_command->add_option("--rate-limit-mib", send->rate_limit_mib_per_s, "Pace the transfer (MiB/s, 0 = off)");
  send_command->add_flag("--progress", send->progress, "Print 'progress DONE TOTAL' after each acknowledged chunk");
  send_command->add_flag("--no-staging", send->no_staging,
                         "Write chunks straight from the file's mapping, not through a reused buffer");
  send_command->add_flag("--no-split", send->no_split,
                         "Send a file that fits one chunk as one chunk, not as two halves that pipeline");
  send_command->add_option("--node-id", send->node_id, "Node id announced in the hello");
  send_command->add_option("--route", send->route,
                           "Route the push is for (a receiver that knows this node authorizes it; "
                           "docs/security.md)");
  send_command->add_option("file", send->file, "KV frame to push")->required()->check(CLI::ExistingFile);
  send_command->callback([send, &exit_code] { exit_code = run_send(*send); });

  auto probe = std::make_shared<ProbeOptions>();
  auto* probe_command = peer->add_subcommand("probe", "Hello, RTT pings and receiver counters of a peer (JSON)");
  probe_command->add_option("address", probe->address, "Peer address HOST:PORT")->required();
  probe_command->add_option("--count", probe->count, "Pings to send");
  probe_command->callback([probe, &exit_code] { exit_code = run_probe(*probe); });
}

}  // namespace kvrelay::cli
