// fp8 KV (ABI 6, issue #26) through a real sidecar process's shared memory: published in place,
// looked up, resolved, reserved and claimed, bit for bit, with its dtype tag and its 1-byte size.
#include <catch2/catch.hpp>

#include <cstring>
#include <vector>

#include "kvrelay/core/block_hash.h"
#include "kvrelay/core/model_fingerprint.h"
#include "kvrelay/shm_transport/kvrelay_client.h"

#include "shm_fixture.h"

using namespace kvrelay;
using namespace kvrelay::test;

namespace {

constexpr std::uint32_t kFp8Block = 16;

// 2 layers, 2 heads of 8 fp8 elements: 2 * 2 * 2 * 8 = 64 bytes a token.
kvrelay_layout fp8_layout(std::uint32_t dtype, std::uint64_t tokens) {
  return kvrelay_layout{2, 2, 8, dtype, tokens};
}

std::vector<std::uint32_t> fp8_prompt(std::size_t count, std::uint32_t seed) {
  std::vector<std::uint32_t> ids(count);
  for (std::size_t index = 0; index < count; ++index)
    ids[index] = static_cast<std::uint32_t>((index * 40503U + seed * 7U) % 32000U);
  return ids;
}

std::uint64_t fp8_model_id(std::uint32_t dtype) {
  kvrelay_model model{};
  model.struct_size = sizeof(model);
  model.layers = 2;
  model.kv_heads = 2;
  model.head_dim = 8;
  model.dtype = dtype;
  model.architecture = "llama";
  model.weights = "fp8-test";
  std::uint64_t id = 0;
  REQUIRE(kvrelay_model_id(&model, &id) == KVRELAY_OK);
  return id;
}

std::vector<std::byte> fp8_entry_bytes(const kvrelay_entry* entry) {
  const auto* data = static_cast<const std::byte*>(kvrelay_entry_data(entry));
  return {data, data + kvrelay_entry_size(entry)};
}

}  // namespace

TEST_CASE("fp8 KV is published, resolved and claimed through a sidecar bit for bit with its dtype", "[shm][c_abi]") {
  const std::uint64_t arena_bytes = GENERATE(std::uint64_t{0}, std::uint64_t{16} << 20);
  const std::uint32_t dtype = GENERATE(std::uint32_t{KVRELAY_DTYPE_FP8_E4M3}, std::uint32_t{KVRELAY_DTYPE_FP8_E5M2});
  INFO("arena bytes " << arena_bytes << ", dtype " << dtype);
  shm::ShmServerOptions options;
  options.arena_bytes = arena_bytes;
  ServerProcess server(options);
  kvrelay_client* worker = nullptr;
  kvrelay_client* scheduler = nullptr;
  REQUIRE(kvrelay_client_connect(server.socket_path().c_str(), &worker) == KVRELAY_OK);
  REQUIRE(kvrelay_client_connect(server.socket_path().c_str(), &scheduler) == KVRELAY_OK);

  const std::uint64_t model_id = fp8_model_id(dtype);
  CHECK(model_id != fp8_model_id(KVRELAY_DTYPE_BF16));
  const auto ids = fp8_prompt(50, dtype);
  const std::uint64_t tokens = 48;
  const auto layout = fp8_layout(dtype, tokens);
  const std::uint64_t size = std::uint64_t{2} * 2 * tokens * 2 * 8;  // layers * K,V * tokens * heads * dim * 1 B
  // Every byte value, NaN patterns included: nothing on the way may read them as numbers.
  std::vector<std::byte> bytes(size);
  for (std::size_t i = 0; i < bytes.size(); ++i)
    bytes[i] = static_cast<std::byte>(i * 151 + dtype);

  // A region of the bf16 size for the same layout is refused: the sizes are 1 byte an element.
  kvrelay_region* region = nullptr;
  REQUIRE(kvrelay_region_alloc(worker, size * 2, &region) == KVRELAY_OK);
  kvrelay_publish_request request{};
  request.struct_size = sizeof(request);
  request.block_tokens = kFp8Block;
  request.model_id = model_id;
  request.root = KVRELAY_ROOT_BLOCK_HASH;
  request.tokens = ids.data();
  request.count = tokens;
  request.prompt_tokens = ids.size();
  CHECK(kvrelay_region_commit_request(worker, region, &request, &layout) == KVRELAY_E_LAYOUT_MISMATCH);

  REQUIRE(kvrelay_region_alloc(worker, size, &region) == KVRELAY_OK);
  std::memcpy(kvrelay_region_data(region), bytes.data(), bytes.size());
  {
    const int committed = kvrelay_region_commit_request(worker, region, &request, &layout);
    INFO(kvrelay_last_error(worker));
    REQUIRE(committed == KVRELAY_OK);
  }

  const auto hashes = hash_blocks(model_id, std::span(ids.data(), tokens), kFp8Block);
  const kvrelay_key key{model_id, hashes.back()};
  kvrelay_entry* entry = nullptr;
  REQUIRE(kvrelay_lookup(scheduler, &key, &entry) == KVRELAY_OK);
  CHECK(fp8_entry_bytes(entry) == bytes);
  kvrelay_layout got{};
  kvrelay_entry_layout(entry, &got);
  CHECK(got.dtype == dtype);
  CHECK(got.tokens == tokens);
  kvrelay_entry_release(entry);

  kvrelay_resolve_request resolve{};
  resolve.struct_size = sizeof(resolve);
  resolve.block_tokens = kFp8Block;
  resolve.model_id = model_id;
  resolve.root = KVRELAY_ROOT_BLOCK_HASH;
  resolve.tokens = ids.data();
  resolve.count = ids.size();
  kvrelay_resolved resolved{};
  resolved.struct_size = sizeof(resolved);
  REQUIRE(kvrelay_resolve(scheduler, &resolve, &resolved, &entry) == KVRELAY_OK);
  CHECK(resolved.tokens == tokens);
  CHECK(std::string(resolved.medium) == "kv_raw");
  CHECK(fp8_entry_bytes(entry) == bytes);
  kvrelay_entry_layout(entry, &got);
  CHECK(got.dtype == dtype);
  kvrelay_entry_release(entry);

  resolve.flags = KVRELAY_RESOLVE_RESERVE;
  kvrelay_resolved reserved{};
  reserved.struct_size = sizeof(reserved);
  REQUIRE(kvrelay_resolve(scheduler, &resolve, &reserved, nullptr) == KVRELAY_OK);
  kvrelay_resolved claimed{};
  claimed.struct_size = sizeof(claimed);
  REQUIRE(kvrelay_claim(worker, reserved.reservation, 0, &claimed, &entry) == KVRELAY_OK);
  CHECK(claimed.tokens == tokens);
  CHECK(fp8_entry_bytes(entry) == bytes);
  kvrelay_entry_layout(entry, &got);
  CHECK(got.dtype == dtype);
  kvrelay_entry_release(entry);

  kvrelay_client_close(scheduler);
  kvrelay_client_close(worker);
}

TEST_CASE("the C ABI refuses dtypes past fp8_e5m2", "[shm][c_abi]") {
  ServerProcess server;
  kvrelay_client* client = nullptr;
  REQUIRE(kvrelay_client_connect(server.socket_path().c_str(), &client) == KVRELAY_OK);
  const kvrelay_key key{5, 6};
  const std::vector<std::byte> bytes(64);
  for (const std::uint32_t dtype : {0U, 6U, 255U, 256U + KVRELAY_DTYPE_FP8_E4M3}) {
    INFO(dtype);
    const kvrelay_layout layout{2, 2, 8, dtype, 1};
    CHECK(kvrelay_publish(client, &key, &layout, bytes.data(), bytes.size()) == KVRELAY_E_INVALID_ARGUMENT);
  }
  const kvrelay_layout fp8{2, 2, 8, KVRELAY_DTYPE_FP8_E5M2, 1};
  CHECK(kvrelay_publish(client, &key, &fp8, bytes.data(), bytes.size()) == KVRELAY_OK);
  kvrelay_client_close(client);
}
