// `kvrelay peer send`, `fetch` and `probe`: the peer plane from the command line, for
// operators checking links (and which transport and UCX lanes they use) and for tests that kill
// a real sender or receiver mid-transfer.
// `send` pushes a KV frame exactly as a sidecar's push does (PeerClient::push_encoded).

#include <fcntl.h>
#include <sys/stat.h>

#include <fmt/format.h>
#include <nlohmann/json.hpp>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <iterator>
#include <memory>
#include <vector>

#include "kvrelay/codec_plugins/frame.h"
#include "kvrelay/core/policy.h"
#include "kvrelay/kv_store/entry_chain.h"
#include "kvrelay/kv_store/memfd.h"
#include "kvrelay/peer/peer_client.h"

#include "commands.h"

namespace kvrelay::cli {

namespace {

// How chunk streams travel (issue #29): --transport, else the policy's peer entry, else TCP.
struct TransportOptions {
  std::string transport;  // "", "tcp" or "ucx"
  std::string ucx_tls;    // without a policy: UCX_TLS (default: the environment's, else the policy default)
};

void add_transport_options(CLI::App& command, TransportOptions& options) {
  command
      .add_option("--transport", options.transport,
                  "Chunk streams over tcp or ucx (default: the policy's peer "
                  "entry, else tcp)")
      ->check(CLI::IsMember({"tcp", "ucx"}));
  command.add_option("--ucx-tls", options.ucx_tls,
                     "UCX_TLS for --transport ucx without --config (default: $UCX_TLS, else posix,tcp)");
}

// Sets client.ucx when the chosen transport is UCX, with the policy's ucx section where there is one.
Status apply_transport(const TransportOptions& options, const Policy* policy, const PeerPolicy* peer,
                       peer::PeerClientOptions& client) {
  const bool ucx = options.transport.empty() ? peer != nullptr && peer->transport == PeerTransport::kUcx
                                             : options.transport == "ucx";
  if (!ucx) return ok();
  UcxPolicy settings;
  if (policy != nullptr) {
    settings = policy->ucx;
  } else if (!options.ucx_tls.empty()) {
    settings.tls = options.ucx_tls;
  } else if (const char* from_environment = std::getenv("UCX_TLS"); from_environment != nullptr) {
    settings.tls = from_environment;
  }
  auto context = peer::UcxContext::create(settings);
  if (!context) return context.error();
  client.ucx = std::move(context).value();
  return ok();
}

// --progress: "progress DONE TOTAL" on stdout after each chunk acknowledged (send) or checked (fetch).
void print_progress(std::uint64_t done, std::uint64_t total) {
  std::printf("progress %llu %llu\n", static_cast<unsigned long long>(done), static_cast<unsigned long long>(total));
  std::fflush(stdout);
}

struct SendOptions {
  std::string to;
  std::string config;  // with peer_id: the address comes from the policy
  std::string peer_id;
  std::uint64_t transfer_id = 0;
  std::uint64_t model_id = 1;
  // The frame's token ids (a JSON array), which the receiver hashes to the key it files it under.
  std::string tokens_file;
  std::uint32_t block_tokens = kDefaultBlockTokens;
  std::string chain_root;  // 16 hex digits; "" the unsalted root
  std::string tenant;
  std::uint32_t chunk_bytes = 1U << 20;
  std::uint32_t window = 8;
  double rate_limit_mib_per_s = 0;
  bool progress = false;
  bool no_staging = false;
  bool no_split = false;
  std::string node_id = "kvrelay-cli";
  std::string route;  // the route the push is for, which the receiver authorizes (issue #25)
  std::string file;
  TransportOptions transport;
};

struct ProbeOptions {
  std::string address;
  unsigned count = 5;
  TransportOptions transport;
};

struct FetchOptions {
  std::string address;
  std::uint64_t model_id = 1;
  std::string key;  // the entry's context hash, 16 hex digits
  std::string codec = "raw";
  std::string out;  // where the frame goes ("": not written)
  std::uint32_t deadline_ms = 30'000;
  bool progress = false;
  std::string node_id = "kvrelay-cli";
  TransportOptions transport;
};

int fail_with(const std::string& message) {
  std::fprintf(stderr, "kvrelay peer: %s\n", message.c_str());
  return 1;
}

// The chain --tokens names, checked against the frame's token count.
Result<kv_store::EntryChain> read_chain(const SendOptions& options, std::uint64_t frame_tokens) {
  std::ifstream file(options.tokens_file, std::ios::binary);
  const std::string text((std::istreambuf_iterator<char>(file)), std::istreambuf_iterator<char>());
  if (!file.good() && !file.eof()) return fail(ErrorCode::kIo, "cannot read " + options.tokens_file);
  const auto ids = nlohmann::json::parse(text, nullptr, /*allow_exceptions=*/false);
  if (!ids.is_array())
    return fail(ErrorCode::kInvalidArgument, options.tokens_file + ": expected a JSON array of token ids");
  kv_store::EntryChain chain;
  chain.block_tokens = options.block_tokens;
  chain.tenant = options.tenant;
  for (std::size_t index = 0; index < ids.size(); ++index) {
    if (!ids[index].is_number_unsigned() || ids[index].get<std::uint64_t>() > UINT32_MAX) {
      return fail(ErrorCode::kInvalidArgument,
                  fmt::format("{}: /{}: expected a token id (0..4294967295)", options.tokens_file, index));
    }
    chain.tokens.push_back(ids[index].get<TokenId>());
  }
  if (chain.tokens.size() != frame_tokens || frame_tokens % chain.block_tokens != 0) {
    return fail(ErrorCode::kInvalidArgument,
                fmt::format("{} holds {} token ids; the frame has {} tokens, which must be whole blocks of {}",
                            options.tokens_file, chain.tokens.size(), frame_tokens, chain.block_tokens));
  }
  if (!options.chain_root.empty()) {
    const auto root = parse_block_hash_hex(options.chain_root);
    if (!root) return fail(ErrorCode::kInvalidArgument, "--chain-root: expected 16 hex digits");
    chain.root = *root;
  }
  return chain;
}

// What the receiver files the entry under: the chain's last block (in the tenant's scope with --tenant).
Result<kv_store::EntryKey> chain_key(const SendOptions& options, const kv_store::EntryChain& chain) {
  const auto scope = options.tenant.empty() ? kv_store::ChainScope::kUnscoped : kv_store::ChainScope::kTenant;
  const auto keys = kv_store::chain_keys(options.model_id, chain, scope);
  if (keys.empty()) return fail(ErrorCode::kInvalidArgument, "a frame of no tokens has no key");
  return kv_store::EntryKey{options.model_id, keys.back()};
}

int run_send(const SendOptions& options) {
  peer::PeerClientOptions client_options;
  HostPort target;
  Status transport = ok();
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
    transport = apply_transport(options.transport, &policy.value(), peer, client_options);
  } else {
    if (options.to.empty()) return fail_with("give --to HOST:PORT or --config with --peer ID");
    auto address = parse_host_port(options.to);
    if (!address) return fail_with(address.error().to_string());
    target = address.value();
    client_options.node_id = options.node_id;
    transport = apply_transport(options.transport, nullptr, nullptr, client_options);
  }
  if (!transport) return fail_with(transport.error().to_string());
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
  auto chain = read_chain(options, header.value().layout.tokens);
  if (!chain) return fail_with(chain.error().message);
  const auto key = chain_key(options, chain.value());
  if (!key) return fail_with(key.error().message);

  client_options.chunk_bytes = options.chunk_bytes;
  client_options.window_chunks = options.window;
  if (options.no_staging) client_options.stage_chunks = false;
  if (options.no_split) client_options.split_single_chunk = false;
  client_options.rate_limit_bytes_per_s = static_cast<std::uint64_t>(options.rate_limit_mib_per_s * 1024 * 1024);
  if (options.progress) {
    client_options.on_progress = print_progress;
  }
  const auto started = std::chrono::steady_clock::now();
  auto client = peer::PeerClient::connect(target, client_options);
  if (!client) return fail_with(client.error().to_string());
  if (auto sent = client.value().push_encoded(options.transfer_id, key.value(), chain.value(), frame, options.route);
      !sent) {
    return fail_with(sent.error().to_string());
  }
  const double seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - started).count();
  nlohmann::json result{{"outcome", "committed"},
                        {"transfer_id", options.transfer_id},
                        {"bytes", mapping.value().size()},
                        {"peer", client.value().remote().node_id},
                        {"transport", client.value().transport()},
                        {"seconds", seconds}};
  std::printf("%s\n", result.dump().c_str());
  return 0;
}

int run_probe(const ProbeOptions& options) {
  auto address = parse_host_port(options.address);
  if (!address) return fail_with(address.error().to_string());
  peer::PeerClientOptions client_options;
  if (auto transport = apply_transport(options.transport, nullptr, nullptr, client_options); !transport) {
    return fail_with(transport.error().to_string());
  }
  auto client = peer::PeerClient::connect(address.value(), client_options);
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
                        {"transport", client.value().transport()},
                        {"ucx_lanes", client.value().transport_lanes()},
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

// Fetches one entry as a peer sidecar's lookup would (PeerClient::fetch) and writes its frame.
int run_fetch(const FetchOptions& options) {
  auto address = parse_host_port(options.address);
  if (!address) return fail_with(address.error().to_string());
  const auto hash = parse_block_hash_hex(options.key);
  if (!hash) return fail_with("--key: expected 16 hex digits");
  peer::PeerClientOptions client_options;
  client_options.node_id = options.node_id;
  if (auto transport = apply_transport(options.transport, nullptr, nullptr, client_options); !transport) {
    return fail_with(transport.error().to_string());
  }
  if (options.progress) {
    client_options.on_progress = print_progress;
  }
  const auto started = std::chrono::steady_clock::now();
  auto client = peer::PeerClient::connect(address.value(), client_options,
                                          started + std::chrono::milliseconds(options.deadline_ms));
  if (!client) return fail_with(client.error().to_string());
  peer::FetchRequest request;
  request.request_id = 1;
  request.model_id = options.model_id;
  request.codec = options.codec;
  request.hashes = {*hash};
  auto fetched =
      client.value().fetch(request, std::uint64_t{64} << 30, started + std::chrono::milliseconds(options.deadline_ms));
  if (!fetched) return fail_with(fetched.error().to_string());
  if (!fetched.value()) {
    std::printf("%s\n", nlohmann::json{{"outcome", "miss"}, {"peer", client.value().remote().node_id}}.dump().c_str());
    return 0;
  }
  const auto& frame = *fetched.value();
  if (!options.out.empty()) {
    std::ofstream file(options.out, std::ios::binary | std::ios::trunc);
    file.write(reinterpret_cast<const char*>(frame.frame().data()), static_cast<std::streamsize>(frame.frame_bytes));
    if (!file) return fail_with("cannot write " + options.out);
  }
  const double seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - started).count();
  nlohmann::json result{{"outcome", "fetched"},
                        {"peer", client.value().remote().node_id},
                        {"transport", frame.transport},
                        {"frame_bytes", frame.frame_bytes},
                        {"tokens", frame.chain.tokens.size()},
                        {"fidelity_product", frame.fidelity_product},
                        {"seconds", seconds}};
  std::printf("%s\n", result.dump().c_str());
  return 0;
}

}  // namespace

void add_peer_command(CLI::App& app, int& exit_code) {
  auto* peer = app.add_subcommand("peer", "Talk to another sidecar over the peer plane (chunks over TCP or UCX)");
  peer->require_subcommand(1);

  auto send = std::make_shared<SendOptions>();
  auto* send_command =
      peer->add_subcommand("send", "Push a KV frame file (kvrelay codec encode) to a peer sidecar, which files it");
  send_command->add_option("--to", send->to, "Peer address HOST:PORT");
  send_command->add_option("--config", send->config, "Policy file; with --peer, the peer's address");
  send_command->add_option("--peer", send->peer_id, "Peer id from the policy's peers[]");
  send_command->add_option("--transfer-id", send->transfer_id, "Id of the push (its chunks carry it)")->required();
  send_command->add_option("--model-id", send->model_id, "Entry key: model fingerprint id");
  send_command
      ->add_option("--tokens", send->tokens_file,
                   "JSON array of the frame's token ids; the entry's key is their block-hash chain")
      ->required()
      ->check(CLI::ExistingFile);
  send_command->add_option("--block-tokens", send->block_tokens, "Tokens per block of the chain")
      ->check(CLI::Range(1U, kv_store::kMaxChainTokens));
  send_command->add_option("--chain-root", send->chain_root, "Root of the chain, 16 hex digits (a tenant's)");
  send_command->add_option("--tenant", send->tenant, "Tenant whose store scope the entry is filed in");
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
  add_transport_options(*send_command, send->transport);
  send_command->add_option("file", send->file, "KV frame to push")->required()->check(CLI::ExistingFile);
  send_command->callback([send, &exit_code] { exit_code = run_send(*send); });

  auto fetch = std::make_shared<FetchOptions>();
  auto* fetch_command =
      peer->add_subcommand("fetch",
                           "Fetch one entry from a peer sidecar as a lookup would, and write its frame (JSON "
                           "summary on stdout)");
  fetch_command->add_option("address", fetch->address, "Peer address HOST:PORT")->required();
  fetch_command->add_option("--model-id", fetch->model_id, "Entry key: model fingerprint id");
  fetch_command->add_option("--key", fetch->key, "Entry key: context hash, 16 hex digits")->required();
  fetch_command->add_option("--codec", fetch->codec, "Codec spec the peer encodes with (raw, lossless, int8, ...)");
  fetch_command->add_option("--out", fetch->out, "Where to write the fetched frame");
  fetch_command->add_option("--deadline-ms", fetch->deadline_ms, "The whole fetch, connect included");
  fetch_command->add_flag("--progress", fetch->progress, "Print 'progress DONE TOTAL' after each chunk checked");
  fetch_command->add_option("--node-id", fetch->node_id, "Node id announced in the hello");
  add_transport_options(*fetch_command, fetch->transport);
  fetch_command->callback([fetch, &exit_code] { exit_code = run_fetch(*fetch); });

  auto probe = std::make_shared<ProbeOptions>();
  auto* probe_command = peer->add_subcommand("probe", "Hello, RTT pings and receiver counters of a peer (JSON)");
  probe_command->add_option("address", probe->address, "Peer address HOST:PORT")->required();
  probe_command->add_option("--count", probe->count, "Pings to send");
  add_transport_options(*probe_command, probe->transport);
  probe_command->callback([probe, &exit_code] { exit_code = run_probe(*probe); });
}

}  // namespace kvrelay::cli
