// Reservations (data plane version 6) and C ABI 5 (issue #26): the scheduler's Resolve keeps its
// answer in the sidecar, a worker claims it from another connection, once. Real sidecar process,
// real socket, real memfds; the silent sidecar is a listener of our own that answers the hello only.
#include <sys/socket.h>
#include <sys/un.h>
#include <unistd.h>

#include <catch2/catch.hpp>

#include <atomic>
#include <chrono>
#include <cstring>
#include <thread>

#include "kvrelay/core/block_hash.h"
#include "kvrelay/core/model_fingerprint.h"
#include "kvrelay/shm_transport/fd_passing.h"
#include "kvrelay/shm_transport/kvrelay_client.h"

#include "shm_fixture.h"

using namespace kvrelay;
using namespace kvrelay::shm;
using namespace kvrelay::test;

namespace {

constexpr std::uint64_t kReservationModel = 91;
constexpr std::uint32_t kReservationBlock = 16;

std::vector<std::uint32_t> reservation_prompt(std::size_t count, std::uint32_t seed) {
  std::vector<std::uint32_t> ids(count);
  for (std::size_t index = 0; index < count; ++index)
    ids[index] = static_cast<std::uint32_t>((index * 2654435761U + seed) % 32000);
  return ids;
}

// 1 layer, 1 head of 8 fp16 values per token: 32 bytes a token.
kvrelay_layout reservation_layout(std::uint64_t tokens) {
  return kvrelay_layout{1, 1, 8, 2, tokens};
}

// Publishes the first `tokens` ids' KV through kvrelay_region_commit_request; returns its bytes.
std::vector<std::byte> reservation_publish(kvrelay_client* client, const std::vector<std::uint32_t>& ids,
                                           std::uint64_t tokens) {
  const auto layout = reservation_layout(tokens);
  const auto bytes = pattern_bytes(tokens * 32, tokens);
  kvrelay_region* region = nullptr;
  REQUIRE(kvrelay_region_alloc(client, bytes.size(), &region) == KVRELAY_OK);
  std::memcpy(kvrelay_region_data(region), bytes.data(), bytes.size());
  kvrelay_publish_request request{};
  request.struct_size = sizeof(request);
  request.block_tokens = kReservationBlock;
  request.model_id = kReservationModel;
  request.root = KVRELAY_ROOT_BLOCK_HASH;
  request.tokens = ids.data();
  request.count = tokens;
  request.prompt_tokens = ids.size();
  const int committed = kvrelay_region_commit_request(client, region, &request, &layout);
  INFO(kvrelay_last_error(client));
  REQUIRE(committed == KVRELAY_OK);
  return bytes;
}

kvrelay_resolve_request reservation_resolve_request(const std::vector<std::uint32_t>& ids, std::uint32_t flags) {
  kvrelay_resolve_request request{};
  request.struct_size = sizeof(request);
  request.block_tokens = kReservationBlock;
  request.model_id = kReservationModel;
  request.root = KVRELAY_ROOT_BLOCK_HASH;
  request.tokens = ids.data();
  request.count = ids.size();
  request.flags = flags;
  return request;
}

kvrelay_resolved reservation_empty_resolved() {
  kvrelay_resolved out{};
  out.struct_size = sizeof(out);
  return out;
}

std::vector<std::byte> reservation_entry_bytes(const kvrelay_entry* entry) {
  const auto* data = static_cast<const std::byte*>(kvrelay_entry_data(entry));
  return {data, data + kvrelay_entry_size(entry)};
}

kvrelay_client* reservation_connect(const ServerProcess& server) {
  kvrelay_client* client = nullptr;
  REQUIRE(kvrelay_client_connect(server.socket_path().c_str(), &client) == KVRELAY_OK);
  return client;
}

ResolveRequest reservation_cpp_request(const std::vector<std::uint32_t>& ids) {
  ResolveRequest request;
  request.model_id = kReservationModel;
  request.block_tokens = kReservationBlock;
  request.prompt_tokens = ids.size();
  request.block_hashes = hash_blocks(kReservationModel, ids, kReservationBlock);
  return request;
}

}  // namespace

TEST_CASE("kvrelay_model_id is the fingerprint id unsharded and differs per tensor-parallel rank", "[shm][c_api]") {
  kvrelay_model model{};
  model.struct_size = sizeof(model);
  model.layers = 32;
  model.kv_heads = 8;
  model.head_dim = 128;
  model.dtype = 3;
  model.architecture = "llama";
  model.weights = "llama-3-8b";
  std::uint64_t id = 0;
  REQUIRE(kvrelay_model_id(&model, &id) == KVRELAY_OK);
  CHECK(id == ModelFingerprint{"llama", 32, 8, 128, DType::kBFloat16, "llama-3-8b"}.id());
  model.tp_size = 2;
  std::uint64_t rank0 = 0;
  std::uint64_t rank1 = 0;
  std::uint32_t heads = 0;
  REQUIRE(kvrelay_model_id(&model, &rank0) == KVRELAY_OK);
  REQUIRE(kvrelay_model_shard_heads(&model, &heads) == KVRELAY_OK);
  CHECK(heads == 4);
  CHECK(rank0 == ModelFingerprint{"llama", 32, 4, 128, DType::kBFloat16, "llama-3-8b#tp0/2"}.id());
  model.tp_rank = 1;
  REQUIRE(kvrelay_model_id(&model, &rank1) == KVRELAY_OK);
  CHECK(rank1 != rank0);
  CHECK(rank1 != id);
  model.tp_size = 16;  // more ranks than heads: replicated, one head each
  model.tp_rank = 3;
  REQUIRE(kvrelay_model_shard_heads(&model, &heads) == KVRELAY_OK);
  CHECK(heads == 1);
  model.tp_rank = 16;
  CHECK(kvrelay_model_id(&model, &id) == KVRELAY_E_INVALID_ARGUMENT);
  model.tp_rank = 0;
  model.tp_size = 3;  // 8 heads do not split 3 ways
  CHECK(kvrelay_model_id(&model, &id) == KVRELAY_E_INVALID_ARGUMENT);
  model.tp_size = 1;
  model.weights = nullptr;
  CHECK(kvrelay_model_id(&model, &id) == KVRELAY_E_INVALID_ARGUMENT);
  model.weights = "w";
  model.dtype = 9;
  CHECK(kvrelay_model_id(&model, &id) == KVRELAY_E_INVALID_ARGUMENT);
  model.dtype = 3;
  model.struct_size = sizeof(model) - 8;
  CHECK(kvrelay_model_id(&model, &id) == KVRELAY_E_INVALID_ARGUMENT);
}

TEST_CASE("C ABI 5 publishes by request and resolves, reserves and claims the same KV", "[shm][c_api]") {
  ServerProcess server;
  kvrelay_client* scheduler = reservation_connect(server);
  kvrelay_client* worker = reservation_connect(server);
  const auto ids = reservation_prompt(40, 5);  // 2 whole blocks published, the prompt's last token never served

  auto miss = reservation_empty_resolved();
  kvrelay_entry* entry = nullptr;
  auto request = reservation_resolve_request(ids, 0);
  CHECK(kvrelay_resolve(scheduler, &request, &miss, &entry) == KVRELAY_E_NOT_FOUND);
  CHECK(entry == nullptr);

  const auto bytes = reservation_publish(worker, ids, 32);

  auto plain = reservation_empty_resolved();
  REQUIRE(kvrelay_resolve(scheduler, &request, &plain, &entry) == KVRELAY_OK);
  CHECK(plain.tokens == 32);
  CHECK(plain.reservation == 0);
  CHECK(std::string(plain.medium) == "kv_raw");
  CHECK(plain.fidelity.lossy == 0);
  CHECK(reservation_entry_bytes(entry) == bytes);
  kvrelay_entry_release(entry);

  auto reserving = reservation_resolve_request(ids, KVRELAY_RESOLVE_RESERVE);
  auto reserved = reservation_empty_resolved();
  REQUIRE(kvrelay_resolve(scheduler, &reserving, &reserved, nullptr) == KVRELAY_OK);
  CHECK(reserved.tokens == 32);
  CHECK(reserved.reservation != 0);
  CHECK(std::string(reserved.medium) == "kv_raw");

  auto claimed = reservation_empty_resolved();
  kvrelay_entry* loaded = nullptr;
  REQUIRE(kvrelay_claim(worker, reserved.reservation, 0, &claimed, &loaded) == KVRELAY_OK);
  CHECK(claimed.tokens == 32);
  CHECK(std::string(claimed.medium) == "kv_raw");
  CHECK(reservation_entry_bytes(loaded) == bytes);
  kvrelay_entry_release(loaded);
  CHECK(kvrelay_claim(worker, reserved.reservation, 0, nullptr, &loaded) == KVRELAY_E_NOT_FOUND);
  CHECK(std::string(kvrelay_last_error(worker)).find("expired or unknown") != std::string::npos);

  REQUIRE(kvrelay_resolve(scheduler, &reserving, &reserved, nullptr) == KVRELAY_OK);
  CHECK(kvrelay_release_reservation(scheduler, reserved.reservation) == KVRELAY_OK);
  CHECK(kvrelay_release_reservation(scheduler, reserved.reservation) == KVRELAY_OK);  // idempotent
  CHECK(kvrelay_claim(worker, reserved.reservation, 0, nullptr, &loaded) == KVRELAY_E_NOT_FOUND);

  kvrelay_prefill_report report{};
  report.struct_size = sizeof(report);
  report.model_id = kReservationModel;
  report.computed_tokens = 8;
  report.context_tokens = 40;
  report.seconds = 0.01;
  CHECK(kvrelay_report_prefill(worker, &report) == KVRELAY_OK);

  // Sizes the library does not know are refused, naming the struct.
  auto small = request;
  small.struct_size = sizeof(small) - 8;
  CHECK(kvrelay_resolve(scheduler, &small, &plain, &entry) == KVRELAY_E_INVALID_ARGUMENT);
  CHECK(std::string(kvrelay_last_error(scheduler)).find("kvrelay_resolve_request") != std::string::npos);
  auto bad_out = reservation_empty_resolved();
  bad_out.struct_size = 8;
  CHECK(kvrelay_resolve(scheduler, &request, &bad_out, &entry) == KVRELAY_E_INVALID_ARGUMENT);
  report.struct_size = 4;
  CHECK(kvrelay_report_prefill(worker, &report) == KVRELAY_E_INVALID_ARGUMENT);
  kvrelay_region* region = nullptr;
  REQUIRE(kvrelay_region_alloc(worker, 32 * 16, &region) == KVRELAY_OK);
  kvrelay_publish_request publish_request{};
  publish_request.struct_size = sizeof(publish_request) + 8;
  const auto layout = reservation_layout(16);
  CHECK(kvrelay_region_commit_request(worker, region, &publish_request, &layout) == KVRELAY_E_INVALID_ARGUMENT);
  // More tokens than the prompt has is not a prompt's KV.
  REQUIRE(kvrelay_region_alloc(worker, 32 * 16, &region) == KVRELAY_OK);
  publish_request.struct_size = sizeof(publish_request);
  publish_request.block_tokens = kReservationBlock;
  publish_request.model_id = kReservationModel;
  publish_request.root = KVRELAY_ROOT_BLOCK_HASH;
  publish_request.tokens = ids.data();
  publish_request.count = 16;
  publish_request.prompt_tokens = 8;
  CHECK(kvrelay_region_commit_request(worker, region, &publish_request, &layout) == KVRELAY_E_INVALID_ARGUMENT);

  kvrelay_client_close(worker);
  kvrelay_client_close(scheduler);
}

TEST_CASE("Reservations expire and are bounded and a version-5 client still resolves", "[shm]") {
  ShmServerOptions options;
  options.reservation_ttl = std::chrono::milliseconds(200);
  options.max_reservations = 2;
  ServerProcess server(options);
  auto writer = server.connect();
  const auto ids = reservation_prompt(40, 9);
  kv_store::EntryChain chain;
  chain.block_tokens = kReservationBlock;
  chain.root = kRootBlockHash;
  chain.tokens.assign(ids.begin(), ids.begin() + 32);
  const auto hashes = hash_blocks(kReservationModel, chain.tokens, kReservationBlock);
  const auto bytes = pattern_bytes(32 * 32, 3);
  REQUIRE(writer.publish_with_context({kReservationModel, hashes.back()}, KvLayout{1, 1, 8, DType::kFloat16, 32}, bytes,
                                      "", Fidelity::exact(), &chain));

  auto first = writer.reserve(reservation_cpp_request(ids));
  REQUIRE(first);
  CHECK(first.value().meta.blocks == 2);
  auto second = writer.reserve(reservation_cpp_request(ids));
  auto third = writer.reserve(reservation_cpp_request(ids));
  REQUIRE(second);
  REQUIRE(third);
  auto claimer = server.connect();
  // Three filed, two kept: the oldest went.
  const auto dropped = claimer.claim(first.value().id);
  REQUIRE_FALSE(dropped);
  CHECK(dropped.error().code == ErrorCode::kNotFound);
  auto kept = claimer.claim(second.value().id);
  REQUIRE(kept);
  CHECK(kept.value().meta.blocks == 2);
  CHECK(std::vector<std::byte>(kept.value().entry.bytes().begin(), kept.value().entry.bytes().end()) == bytes);
  std::this_thread::sleep_for(std::chrono::milliseconds(300));
  const auto expired = claimer.claim(third.value().id);
  REQUIRE_FALSE(expired);
  CHECK(expired.error().code == ErrorCode::kNotFound);

  auto old = ShmClient::connect(server.socket_path(), 5);
  REQUIRE(old);
  auto resolved = old.value().resolve(reservation_cpp_request(ids));
  REQUIRE(resolved);
  CHECK(resolved.value().meta.blocks == 2);
  CHECK(old.value().reserve(reservation_cpp_request(ids)).error().code == ErrorCode::kUnsupported);
}

TEST_CASE("A resolve past its timeout_ms against a silent sidecar times out and closes the client", "[shm][c_api]") {
  TempDir dir;
  const std::string path = (dir.path() / "silent.sock").string();
  UniqueFd listener(::socket(AF_UNIX, SOCK_SEQPACKET | SOCK_CLOEXEC, 0));
  sockaddr_un address{};
  address.sun_family = AF_UNIX;
  std::memcpy(address.sun_path, path.c_str(), path.size() + 1);
  REQUIRE(::bind(listener.get(), reinterpret_cast<const sockaddr*>(&address), sizeof(address)) == 0);
  REQUIRE(::listen(listener.get(), 4) == 0);
  std::atomic<bool> done{false};
  std::thread sidecar([&] {
    UniqueFd connection(::accept4(listener.get(), nullptr, nullptr, SOCK_CLOEXEC));
    auto hello = receive_message(connection.get());
    if (!hello) return;
    auto frame = decode_frame(hello.value().bytes);
    if (!frame) return;
    ByteWriter out;
    out.put(kDataPlaneVersion).put(static_cast<std::uint32_t>(kMaxFdsPerMessage)).put(std::uint64_t{1} << 30);
    (void)send_message(connection.get(), encode_frame(MessageType::kHelloOk, frame.value().request_id, out.bytes()));
    while (!done)
      std::this_thread::sleep_for(std::chrono::milliseconds(10));  // reads nothing, answers nothing
  });
  kvrelay_client* client = nullptr;
  REQUIRE(kvrelay_client_connect(path.c_str(), &client) == KVRELAY_OK);
  const auto ids = reservation_prompt(40, 1);
  auto request = reservation_resolve_request(ids, 0);
  request.timeout_ms = 100;
  auto out = reservation_empty_resolved();
  kvrelay_entry* entry = nullptr;
  const auto started = std::chrono::steady_clock::now();
  CHECK(kvrelay_resolve(client, &request, &out, &entry) == KVRELAY_E_TIMEOUT);
  const auto waited = std::chrono::steady_clock::now() - started;
  CHECK(waited >= std::chrono::milliseconds(90));
  CHECK(waited < std::chrono::seconds(5));
  request.timeout_ms = 0;
  CHECK(kvrelay_resolve(client, &request, &out, &entry) == KVRELAY_E_IO);
  CHECK(kvrelay_release_reservation(client, 1) == KVRELAY_E_IO);
  kvrelay_client_close(client);
  done = true;
  sidecar.join();
}
