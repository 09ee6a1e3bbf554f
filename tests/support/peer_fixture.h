#pragma once

// A real kvrelay daemon with the peer listener and the Unix-socket data plane enabled, plus
// helpers to inspect it from outside (peer stats over TCP, entries over the Unix socket).

#include <catch2/catch.hpp>
#include <nlohmann/json.hpp>

#include <cstring>
#include <filesystem>
#include <memory>
#include <sstream>
#include <string>
#include <vector>

#include "kvrelay/codec_plugins/frame.h"
#include "kvrelay/codec_plugins/registry.h"
#include "kvrelay/core/block_hash.h"
#include "kvrelay/peer/peer_client.h"
#include "kvrelay/shm_transport/client.h"

#include "daemon_fixture.h"

namespace kvrelay::test {

class PeerDaemon {
 public:
  // `limits`: extra policy limits, merged over the fixture's own; `sections`: top-level policy
  // sections added as they are (a `ucx` section, say).
  explicit PeerDaemon(const nlohmann::json& limits = nlohmann::json::object(),
                      const nlohmann::json& sections = nlohmann::json::object()) {
    auto policy = basic_daemon_policy();
    policy["listen"]["peer"] = "127.0.0.1:0";
    policy["listen"]["unix_socket"] = socket_path_;
    policy["limits"]["kv_store_bytes"] = 1ULL << 31;
    for (const auto& [name, value] : limits.items())
      policy["limits"][name] = value;
    for (const auto& [name, value] : sections.items())
      policy[name] = value;
    daemon_ = std::make_unique<DaemonUnderTest>(policy);
    const auto ready = nlohmann::json::parse(read_file(daemon_->dir() / "ready.json"));
    peer_port_ = ready["peer"].get<std::uint16_t>();
  }

  [[nodiscard]] HostPort peer_address() const { return {"127.0.0.1", peer_port_}; }
  [[nodiscard]] std::string peer_text() const { return "127.0.0.1:" + std::to_string(peer_port_); }
  [[nodiscard]] ChildProcess& process() { return daemon_->process(); }

  [[nodiscard]] peer::PeerServerStats peer_stats() const {
    auto client = peer::PeerClient::connect(peer_address(), {});
    if (!client) FAIL("peer connect: " << client.error().to_string());
    auto stats = client.value().stats();
    if (!stats) FAIL("peer stats: " << stats.error().to_string());
    return stats.value();
  }
  [[nodiscard]] shm::ShmClient data_plane() const {
    auto client = shm::ShmClient::connect(socket_path_);
    if (!client) FAIL("unix socket connect: " << client.error().to_string());
    return std::move(client).value();
  }

 private:
  TempDir socket_dir_;
  std::string socket_path_ = (socket_dir_ / "kvrelay.sock").string();
  std::unique_ptr<DaemonUnderTest> daemon_;
  std::uint16_t peer_port_ = 0;
};

// Distinct bytes per seed, filled a word at a time so 256 MiB stays cheap under ASan.
inline std::vector<std::byte> peer_pattern(std::size_t size, std::uint64_t seed) {
  std::vector<std::byte> bytes(size);
  std::uint64_t state = seed * 0x9E3779B97F4A7C15ULL + 1;
  std::size_t offset = 0;
  for (; offset + 8 <= size; offset += 8) {
    state ^= state << 13;
    state ^= state >> 7;
    state ^= state << 17;
    std::memcpy(bytes.data() + offset, &state, 8);
  }
  for (; offset < size; ++offset)
    bytes[offset] = static_cast<std::byte>(offset * 131 + seed);
  return bytes;
}

inline bool same_bytes(std::span<const std::byte> left, std::span<const std::byte> right) {
  return left.size() == right.size() && (left.empty() || std::memcmp(left.data(), right.data(), left.size()) == 0);
}

// Raw KV of a small model's layout (or `shape`'s), at least `at_least_bytes` of it, and its
// raw-codec frame: what a sidecar pushes and fetches.
// `chain`: token ids of its tokens, one block of all of them, whose hash is the entry's key
// (the receiver checks it).
struct KvFrame {
  KvLayout layout;
  std::vector<std::byte> kv;
  std::vector<std::uint8_t> frame;
  kv_store::EntryChain chain;
  [[nodiscard]] std::span<const std::uint8_t> bytes() const { return frame; }
  [[nodiscard]] kv_store::EntryKey key(std::uint64_t model_id) const { return key_for(model_id, chain); }
  // The same tokens under another chain root: another key (as another tenant's or salt's would be).
  [[nodiscard]] kv_store::EntryChain chain_at(BlockHash root) const {
    auto rooted = chain;
    rooted.root = root;
    return rooted;
  }
  [[nodiscard]] static kv_store::EntryKey key_for(std::uint64_t model_id, const kv_store::EntryChain& of) {
    return {model_id, kv_store::chain_keys(model_id, of, kv_store::ChainScope::kUnscoped).back()};
  }
};
inline KvFrame kv_frame(std::size_t at_least_bytes, std::uint64_t seed, std::string_view codec = "raw",
                        const KvLayout& shape = KvLayout{2, 2, 64, DType::kFloat16, 1}) {
  KvFrame out;
  out.layout = shape;
  const std::uint64_t per_token = out.layout.total_bytes().value();
  out.layout.tokens = std::max<std::uint64_t>(1, (at_least_bytes + per_token - 1) / per_token);
  out.kv = peer_pattern(static_cast<std::size_t>(out.layout.total_bytes().value()), seed);
  out.chain.block_tokens = static_cast<std::uint32_t>(out.layout.tokens);
  for (std::uint64_t token = 0; token < out.layout.tokens; ++token)
    out.chain.tokens.push_back(static_cast<TokenId>((seed * 7919) + token));
  const auto registry = codec::CodecRegistry::with_builtins();
  auto spec = codec::resolve_codec(registry, codec);
  if (!spec) FAIL("codec " << codec << ": " << spec.error().to_string());
  auto frame = codec::encode_frame(*spec.value().codec, out.layout,
                                   std::span(reinterpret_cast<const std::uint8_t*>(out.kv.data()), out.kv.size()));
  if (!frame) FAIL("encode: " << frame.error().to_string());
  out.frame = std::move(frame).value();
  return out;
}

// The raw KV a fetched or pushed frame decodes to.
inline std::vector<std::byte> decoded_kv(std::span<const std::uint8_t> frame) {
  const auto registry = codec::CodecRegistry::with_builtins();
  auto kv = codec::decode_frame(registry, frame, std::uint64_t{1} << 32);
  if (!kv) FAIL("decode: " << kv.error().to_string());
  const auto& bytes = kv.value();
  return {reinterpret_cast<const std::byte*>(bytes.data()),
          reinterpret_cast<const std::byte*>(bytes.data()) + bytes.size()};
}

inline void write_frame_file(const std::filesystem::path& path, const KvFrame& frame) {
  write_file(path, std::string(reinterpret_cast<const char*>(frame.frame.data()), frame.frame.size()));
}

// The frame's token ids as `kvrelay peer send --tokens` reads them.
inline void write_tokens_file(const std::filesystem::path& path, const KvFrame& frame) {
  write_file(path, nlohmann::json(frame.chain.tokens).dump());
}

// The last "progress DONE TOTAL" fraction a `kvrelay peer send|fetch --progress` printed, 0 when none yet.
inline double printed_progress(const ChildProcess& process) {
  std::istringstream lines(process.stdout_text());
  std::string word;
  double fraction = 0;
  std::uint64_t done = 0;
  std::uint64_t total = 0;
  while (lines >> word) {
    if (word == "progress" && lines >> done >> total && total > 0) {
      fraction = static_cast<double>(done) / static_cast<double>(total);
    }
  }
  return fraction;
}

// `kvrelay peer send --progress` of `file` to `daemon` (with its token ids in tokens.json beside
// it, under the chain root `transfer_id`, so each transfer id files the same KV under a key of
// its own), in chunks of `chunk_bytes` with a window of 2; `paced`: at 24 MiB/s. `extra`: more
// options (a transport).
inline std::vector<std::string> peer_send_argv(const PeerDaemon& daemon, std::uint64_t transfer_id,
                                               const std::filesystem::path& file, const KvFrame& frame,
                                               std::uint32_t chunk_bytes, bool paced,
                                               const std::vector<std::string>& extra = {}) {
  std::vector<std::string> argv{kvrelay_binary().string(),
                                "peer",
                                "send",
                                "--to",
                                daemon.peer_text(),
                                "--transfer-id",
                                std::to_string(transfer_id),
                                "--chunk-bytes",
                                std::to_string(chunk_bytes),
                                "--window",
                                "2",
                                "--progress",
                                "--tokens",
                                (file.parent_path() / "tokens.json").string(),
                                "--block-tokens",
                                std::to_string(frame.chain.block_tokens),
                                "--chain-root",
                                block_hash_hex(transfer_id)};
  if (paced) argv.insert(argv.end(), {"--rate-limit-mib", "24"});
  argv.insert(argv.end(), extra.begin(), extra.end());
  argv.push_back(file.string());
  return argv;
}

}  // namespace kvrelay::test
