// Token ids on the data plane (version 5, issue #25): a worker's CommitContext carries the chain
// its key is the block hash of, the sidecar checks it before filing anything, and a same-host
// peer's lookup gets it back. Real sidecar process, real socket, real memfds; hostile commits are
// hand-built frames on the client's socket.
#include <fcntl.h>
#include <grp.h>
#include <sys/mman.h>
#include <sys/wait.h>
#include <unistd.h>

#include <catch2/catch.hpp>

#include <chrono>
#include <cstring>
#include <thread>

#include "kvrelay/shm_transport/fd_passing.h"
#include "kvrelay/shm_transport/kvrelay_client.h"

#include "refworker/skip.h"
#include "shm_fixture.h"

using namespace kvrelay;
using namespace kvrelay::shm;
using namespace kvrelay::test;

namespace {

constexpr std::uint64_t kModel = 77;
constexpr std::uint32_t kNobody = 65534;

kv_store::EntryChain test_chain(std::size_t tokens, std::uint32_t seed) {
  kv_store::EntryChain chain;
  chain.block_tokens = 16;
  chain.root = kRootBlockHash;
  chain.tokens.resize(tokens);
  for (std::size_t index = 0; index < tokens; ++index)
    chain.tokens[index] = static_cast<TokenId>((index * 2654435761U + seed) % 32000);
  return chain;
}

kv_store::EntryKey key_of(const kv_store::EntryChain& chain) {
  return {kModel, hash_blocks(kModel, chain.tokens, chain.block_tokens, chain.root).back()};
}

// One float per K and V of each token: the smallest KV a layout of `tokens` tokens names.
KvLayout tiny_layout(std::uint64_t tokens) {
  return KvLayout{1, 1, 1, DType::kFloat32, tokens};
}

std::vector<std::byte> tiny_kv(std::uint64_t tokens, std::uint64_t seed) {
  return pattern_bytes(static_cast<std::size_t>(tokens * 2 * sizeof(float)), seed);
}

// A sidecar that also knows a same-host peer running as nobody, whose socket (in `dir`) nobody
// may open.
ShmServerOptions with_peer_nobody(const TempDir& dir) {
  std::filesystem::permissions(dir.path(), std::filesystem::perms::owner_all | std::filesystem::perms::others_exec);
  ShmServerOptions options;
  options.socket_path = (dir / "peer.sock").string();
  options.socket_group = "nogroup";
  options.same_host_peers = [] { return std::vector<SameHostPeerUid>{{"node-b", kNobody}}; };
  return options;
}

// Looks `key` up from a child process running as nobody (a same-host peer's connection) and
// checks the entry's bytes and chain against `expected`; exit 0 on a match, 100 + ErrorCode of
// a failed lookup, 90s for setup and mismatches.
int peer_lookup(const std::string& socket_path, const kv_store::EntryKey& key, const std::vector<std::byte>& bytes,
                const kv_store::EntryChain& expected) {
  const pid_t child = ::fork();
  if (child == 0) {
    if (::setgroups(0, nullptr) != 0 || ::setgid(kNobody) != 0 || ::setuid(kNobody) != 0) ::_exit(90);
    auto client = ShmClient::connect(socket_path);
    if (!client) ::_exit(91);
    auto entry = client.value().lookup(key);
    if (!entry) ::_exit(100 + static_cast<int>(entry.error().code));
    if (!entry.value().chain) ::_exit(92);
    if (!(*entry.value().chain == expected)) ::_exit(93);
    std::vector<std::byte> read(bytes.size());
    if (!entry.value().read(0, read) || read != bytes) ::_exit(94);
    ::_exit(0);
  }
  int status = 0;
  ::waitpid(child, &status, 0);
  return WIFEXITED(status) ? WEXITSTATUS(status) : -1;
}

void skip_unless_root() {
  if (::geteuid() != 0) KVRELAY_SKIP("not root: cannot connect as a same-host peer's uid");
  if (::getgrnam("nogroup") == nullptr) KVRELAY_SKIP("no group nogroup");
}

// A hand-built version-5 CommitContext for a fresh region of `kv`, with `fds` attached; the
// server's reply (an error when refused).
Result<ControlFrame> raw_commit(ShmClient& client, const kv_store::EntryKey& key, const KvLayout& layout,
                                const std::vector<std::byte>& kv, std::optional<ChainHeader> chain,
                                std::span<const int> fds, std::vector<std::byte>& storage) {
  auto region = client.allocate(kv.size());
  REQUIRE(region.has_value());
  std::memcpy(region.value().bytes().data(), kv.data(), kv.size());
  region.value().mapping.reset();
  CommitRequest commit{region.value().id, key, layout, kv.size(), checksum_bytes(kv), "", {}, std::move(chain)};
  const auto frame = encode_frame(MessageType::kCommitContext, 4242, encode_commit(commit, true, kDataPlaneVersion));
  REQUIRE(send_message(client.socket_fd(), frame, fds).has_value());
  auto received = receive_message(client.socket_fd());
  REQUIRE(received.has_value());
  storage = std::move(received.value().bytes);
  auto decoded = decode_frame(storage);
  REQUIRE(decoded.has_value());
  if (decoded.value().type == MessageType::kError) return outcome::failure(decode_error(decoded.value().payload));
  return decoded.value();
}

UniqueFd memfd_with(std::span<const TokenId> tokens, unsigned seals) {
  UniqueFd fd(::memfd_create("test-chain", MFD_CLOEXEC | MFD_ALLOW_SEALING));
  REQUIRE(fd);
  const auto bytes = std::as_bytes(tokens);
  REQUIRE(::write(fd.get(), bytes.data(), bytes.size()) == static_cast<ssize_t>(bytes.size()));
  if (seals != 0) REQUIRE(::fcntl(fd.get(), F_ADD_SEALS, seals) == 0);
  return fd;
}

}  // namespace

TEST_CASE("chain: a commit whose token ids do not hash to its key is refused and nothing is stored",
          "[shm][chain][security]") {
  ServerProcess server;
  auto client = server.connect();
  REQUIRE(client.server_version() >= kChainDataPlaneVersion);
  const auto chain = test_chain(64, 1);
  const auto key = key_of(chain);
  const auto kv = tiny_kv(64, 1);

  auto other = chain;
  other.tokens[40] += 1;  // block 3 differs: the chain hashes to another key
  auto fewer = chain;
  fewer.tokens.resize(48);  // three blocks for a 64-token entry
  auto scoped = chain;
  scoped.tenant = "acme";  // a worker names no tenant
  for (const auto* bad : {&other, &fewer, &scoped}) {
    auto refused = client.publish_with_context(key, tiny_layout(64), kv, "", Fidelity::exact(), bad);
    REQUIRE_FALSE(refused.has_value());
    CHECK(refused.error().code == ErrorCode::kChainMismatch);
    const auto stats = client.stats().value();
    CHECK(stats.entries == 0);
    CHECK(stats.commits == 0);
    CHECK(stats.pending_regions == 0);  // the region was consumed all the same
    CHECK(stats.pending_bytes == 0);
    auto missed = client.lookup(key);
    REQUIRE_FALSE(missed.has_value());
    CHECK(missed.error().code == ErrorCode::kNotFound);
  }

  // The same connection then files the right chain, and a lookup gets the ids back (a same-host
  // sidecar of the workers' uid is identified as a worker, and verifies them as a peer does).
  REQUIRE(client.publish_with_context(key, tiny_layout(64), kv, "", Fidelity::exact(), &chain).has_value());
  CHECK(client.stats().value().entries == 1);
  auto found = client.lookup(key);
  REQUIRE(found.has_value());
  REQUIRE(found.value().chain.has_value());
  CHECK(*found.value().chain == chain);
  CHECK(std::vector<std::byte>(found.value().bytes().begin(), found.value().bytes().end()) == kv);
}

TEST_CASE("chain: commits without a chain still work, from version-5 and older clients, and stay on the node",
          "[shm][chain][security]") {
  skip_unless_root();
  TempDir dir;
  ServerProcess server(with_peer_nobody(dir));
  const auto chain = test_chain(32, 2);
  const auto key = key_of(chain);
  const auto kv = tiny_kv(32, 2);
  auto client = server.connect();
  REQUIRE(client.publish_with_context(key, tiny_layout(32), kv, R"({"agent":"a"})").has_value());
  auto found = client.lookup(key);
  REQUIRE(found.has_value());
  CHECK_FALSE(found.value().chain.has_value());

  // A version-4 client publishes as before; a chain it is given is not sent.
  auto old = ShmClient::connect(server.socket_path(), kFidelityDataPlaneVersion);
  REQUIRE(old.has_value());
  const auto old_chain = test_chain(32, 3);
  REQUIRE(
      old.value()
          .publish_with_context(key_of(old_chain), tiny_layout(32), tiny_kv(32, 3), "", Fidelity::exact(), &old_chain)
          .has_value());
  CHECK(old.value().lookup(key_of(old_chain)).has_value());
  CHECK(client.stats().value().entries == 2);

  // Neither may leave the node: a same-host peer's lookup misses.
  CHECK(peer_lookup(server.socket_path(), key, kv, chain) == 100 + static_cast<int>(ErrorCode::kNotFound));
  CHECK(peer_lookup(server.socket_path(), key_of(old_chain), tiny_kv(32, 3), old_chain) ==
        100 + static_cast<int>(ErrorCode::kNotFound));
}

TEST_CASE("chain: a 40k-token chain round-trips through a commit and a same-host peer's lookup",
          "[shm][chain][security]") {
  skip_unless_root();
  TempDir dir;
  ServerProcess server(with_peer_nobody(dir));
  const auto chain = test_chain(40000, 4);  // 160 KB of ids: more than one datagram holds
  const auto key = key_of(chain);
  const auto kv = tiny_kv(40000, 4);
  auto client = server.connect();
  REQUIRE(client.publish_with_context(key, tiny_layout(40000), kv, "", Fidelity::exact(), &chain).has_value());
  CHECK(peer_lookup(server.socket_path(), key, kv, chain) == 0);
  // The reply's ids are not kept; the server closes them after its send returns, which under load can
  // trail the client's read by a moment, so wait a bounded while for the close.
  std::size_t held = count_memfds(server.pid(), "kvrelay-chain");
  for (int i = 0; i < 200 && held != 0; ++i) {
    std::this_thread::sleep_for(std::chrono::milliseconds(10));
    held = count_memfds(server.pid(), "kvrelay-chain");
  }
  CHECK(held == 0);
}

TEST_CASE("chain: the C ABI publishes with token ids, and a mismatch is KVRELAY_E_CHAIN_MISMATCH",
          "[shm][chain][c_abi]") {
  ServerProcess server;
  kvrelay_client* client = nullptr;
  REQUIRE(kvrelay_client_connect(server.socket_path().c_str(), &client) == KVRELAY_OK);
  const auto chain = test_chain(48, 5);
  const auto key = key_of(chain);
  const kvrelay_key c_key{key.model_id, key.context_hash};
  const kvrelay_layout layout{1, 1, 1, 1, 48};
  const auto kv = tiny_kv(48, 5);
  kvrelay_chain c_chain{sizeof(kvrelay_chain), 16, KVRELAY_ROOT_BLOCK_HASH, chain.tokens.data(), 48};

  auto wrong_root = c_chain;
  wrong_root.root = 1;
  CHECK(kvrelay_publish_chain(client, &c_key, &layout, kv.data(), kv.size(), nullptr, nullptr, &wrong_root) ==
        KVRELAY_E_CHAIN_MISMATCH);
  CHECK_THAT(kvrelay_last_error(client), Catch::Contains("hash to"));
  auto wrong_size = c_chain;
  wrong_size.struct_size = 8;
  CHECK(kvrelay_publish_chain(client, &c_key, &layout, kv.data(), kv.size(), nullptr, nullptr, &wrong_size) ==
        KVRELAY_E_INVALID_ARGUMENT);
  kvrelay_entry* entry = nullptr;
  CHECK(kvrelay_lookup(client, &c_key, &entry) == KVRELAY_E_NOT_FOUND);

  REQUIRE(kvrelay_publish_chain(client, &c_key, &layout, kv.data(), kv.size(), R"({"agent":"a"})", nullptr, &c_chain) ==
          KVRELAY_OK);
  REQUIRE(kvrelay_lookup(client, &c_key, &entry) == KVRELAY_OK);
  CHECK(std::memcmp(kvrelay_entry_data(entry), kv.data(), kv.size()) == 0);
  kvrelay_entry_release(entry);
  kvrelay_client_close(client);
}

TEST_CASE("chain: hostile token-id fds are refused with the reason, and the connection keeps serving",
          "[shm][chain][hostile]") {
  ServerProcess server;
  auto client = server.connect();
  const auto chain = test_chain(64, 6);
  const auto key = key_of(chain);
  const auto kv = tiny_kv(64, 6);
  const auto header = ChainHeader::of(chain);
  const auto baseline_fds = count_fds(server.pid());
  std::vector<std::byte> storage;
  // A commit that decodes consumes its region whatever is wrong with its chain.
  const auto refused_with = [&](std::optional<ChainHeader> sent, std::span<const int> fds, ErrorCode code,
                                const std::string& reason, std::uint64_t pending = 0) {
    auto reply = raw_commit(client, key, tiny_layout(64), kv, std::move(sent), fds, storage);
    REQUIRE_FALSE(reply.has_value());
    INFO(reply.error().message);
    CHECK(reply.error().code == code);
    CHECK_THAT(reply.error().message, Catch::Contains(reason));
    const auto stats = client.stats().value();
    CHECK(stats.entries == 0);
    CHECK(stats.pending_regions == pending);
  };

  const auto good = memfd_with(chain.tokens, F_SEAL_SHRINK | F_SEAL_GROW);
  const auto short_fd = memfd_with(std::span(chain.tokens).first(48), F_SEAL_SHRINK | F_SEAL_GROW);
  const auto unsealed = memfd_with(chain.tokens, 0);
  int pipe_fds[2];
  REQUIRE(::pipe2(pipe_fds, O_CLOEXEC) == 0);
  const UniqueFd pipe_read(pipe_fds[0]);
  const UniqueFd pipe_write(pipe_fds[1]);

  const int one_good[] = {good.get()};
  const int two[] = {good.get(), good.get()};
  const int shorter[] = {short_fd.get()};
  const int no_seals[] = {unsealed.get()};
  const int not_memfd[] = {pipe_read.get()};
  refused_with(header, shorter, ErrorCode::kInvalidArgument, "holds 192 bytes; the frame announces 64 ids");
  refused_with(header, {}, ErrorCode::kProtocol, "takes 1 fd (the ids), got 0");
  refused_with(header, two, ErrorCode::kProtocol, "takes 1 fd (the ids), got 2");
  refused_with(header, not_memfd, ErrorCode::kInvalidArgument, "chain token ids: received fd is not a regular file");
  refused_with(header, no_seals, ErrorCode::kPermissionDenied, "not sealed against shrink and grow");
  refused_with(std::nullopt, one_good, ErrorCode::kProtocol, "commit without a chain with 1 fds attached");
  auto fewer = header;
  fewer.count = 48;  // three blocks of ids for a 64-token entry
  refused_with(fewer, shorter, ErrorCode::kChainMismatch, "commit of 64 tokens carries a chain of 48 token ids");
  // Nothing the hostile commits sent is still held, and the same connection commits correctly.
  CHECK(count_fds(server.pid()) == baseline_fds);
  auto accepted = raw_commit(client, key, tiny_layout(64), kv, header, one_good, storage);
  REQUIRE(accepted.has_value());
  CHECK(accepted.value().type == MessageType::kContextCommitted);
  CHECK(client.stats().value().entries == 1);

  // A header announcing more ids than any chain has does not decode (its region stays pending,
  // as for any malformed commit, until the connection goes).
  auto too_many = header;
  too_many.count = kv_store::kMaxChainTokens + 16;
  auto refused = raw_commit(client, {kModel, 5}, tiny_layout(64), kv, too_many, one_good, storage);
  REQUIRE_FALSE(refused.has_value());
  CHECK(refused.error().code == ErrorCode::kResourceExhausted);
  CHECK_THAT(refused.error().message, Catch::Contains("at most"));
  CHECK(client.stats().value().entries == 1);
}
