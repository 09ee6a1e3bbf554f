// Fidelity of stored KV on the data plane: what a publish says is recorded, lossy KV never
// replaces exact KV nor answers a lookup for exact KV, and the wire encoding refuses what it
// cannot mean.
#include <poll.h>
#include <sys/socket.h>
#include <sys/un.h>

#include <catch2/catch.hpp>

#include <cstring>
#include <thread>

#include "kvrelay/shm_transport/control_protocol.h"
#include "kvrelay/kv_store/entry_store.h"
#include "kvrelay/shm_transport/kvrelay_client.h"

#include "shm_fixture.h"

namespace kvrelay::test {

namespace {

std::shared_ptr<kv_store::StoredEntry> entry_of(std::span<const std::byte> bytes, Fidelity fidelity) {
  auto made = kv_store::make_stored_entry(KvLayout{}, bytes);
  REQUIRE(made.has_value());
  made.value()->fidelity = std::move(fidelity);
  return std::move(made).value();
}

kvrelay_fidelity c_fidelity(const char* codec, std::uint64_t exact_tokens) {
  kvrelay_fidelity fidelity{};
  fidelity.struct_size = sizeof(fidelity);
  fidelity.lossy = 1;
  fidelity.exact_tokens = exact_tokens;
  std::strncpy(fidelity.lossy_codec, codec, sizeof(fidelity.lossy_codec) - 1);
  return fidelity;
}

}  // namespace

TEST_CASE("fidelity: prefixes, joins and ordering", "[shm][fidelity]") {
  const auto lossy = Fidelity::lossy("int4", 32);
  CHECK(lossy.prefix(32).is_exact());
  CHECK_FALSE(lossy.prefix(33).is_exact());
  CHECK(Fidelity::exact().then(Fidelity::exact(), 64).is_exact());
  // An exact head of 64 tokens joined to a lossy tail: exact through the head only.
  CHECK(Fidelity::exact().then(Fidelity::lossy("int8"), 64) == Fidelity::lossy("int8", 64));
  // A lossy head stays what it was, whatever follows.
  CHECK(lossy.then(Fidelity::exact(), 64) == lossy);
  CHECK(Fidelity::exact().at_least_as_exact_as(lossy));
  CHECK_FALSE(lossy.at_least_as_exact_as(Fidelity::exact()));
  CHECK(lossy.at_least_as_exact_as(Fidelity::lossy("int8", 16)));
  CHECK_FALSE(Fidelity::lossy("int8", 16).at_least_as_exact_as(lossy));
}

TEST_CASE("fidelity: the store never files lossy KV over exact KV", "[shm][fidelity]") {
  kv_store::InMemoryEntryStore store(1U << 20);
  const kv_store::EntryKey key{1, 2};
  const auto exact_bytes = pattern_bytes(100, 1);
  const auto lossy_bytes = pattern_bytes(100, 2);
  REQUIRE(store.put(key, entry_of(exact_bytes, Fidelity::exact())).has_value());
  const auto refused = store.put(key, entry_of(lossy_bytes, Fidelity::lossy("int4")));
  REQUIRE_FALSE(refused.has_value());
  CHECK(refused.error().code == ErrorCode::kAlreadyExists);
  CHECK(refused.error().message.find("int4") != std::string::npos);
  CHECK(store.stats().refused_downgrades == 1);
  const auto kept = store.get_exact(key);
  REQUIRE(kept != nullptr);
  CHECK(kept->info.checksum == shm::checksum_bytes(exact_bytes));

  // Lossy under a fresh key is filed, but only get() answers with it.
  const kv_store::EntryKey other{1, 3};
  REQUIRE(store.put(other, entry_of(lossy_bytes, Fidelity::lossy("int8"))).has_value());
  CHECK(store.get(other) != nullptr);
  CHECK(store.get_exact(other) == nullptr);
  // Exact KV replaces it.
  REQUIRE(store.put(other, entry_of(exact_bytes, Fidelity::exact())).has_value());
  CHECK(store.get_exact(other) != nullptr);
}

TEST_CASE("fidelity: the wire encoding round-trips and refuses what it cannot mean", "[shm][fidelity][protocol]") {
  for (const auto& fidelity : {Fidelity::exact(), Fidelity::lossy("int4", 48), Fidelity::lossy("int8+zstd")}) {
    ByteWriter writer;
    shm::encode_fidelity(writer, fidelity);
    const auto bytes = writer.take();
    ByteReader reader(bytes);
    const auto decoded = shm::decode_fidelity(reader);
    REQUIRE(decoded.has_value());
    CHECK(decoded.value() == fidelity);
    for (std::size_t length = 0; length < bytes.size(); ++length) {
      ByteReader truncated(std::span(bytes.data(), length));
      CHECK_FALSE(shm::decode_fidelity(truncated).has_value());
    }
  }
  {
    ByteWriter writer;
    writer.put(std::uint64_t{5}).put_string("");
    const auto bytes = writer.take();
    ByteReader reader(bytes);
    const auto decoded = shm::decode_fidelity(reader);
    REQUIRE_FALSE(decoded.has_value());
    CHECK(decoded.error().message.find("exact_tokens") != std::string::npos);
  }
  {
    ByteWriter writer;
    writer.put(std::uint64_t{0}).put_string(std::string(shm::kMaxFidelityCodecBytes + 1, 'x'));
    const auto bytes = writer.take();
    ByteReader reader(bytes);
    CHECK_FALSE(shm::decode_fidelity(reader).has_value());
  }
}

TEST_CASE("fidelity: a lossy publish through the C ABI is kept apart from exact KV", "[shm][fidelity][c_abi]") {
  const std::uint64_t arena_bytes = GENERATE(std::uint64_t{0}, std::uint64_t{16} << 20);
  INFO("arena bytes " << arena_bytes);
  shm::ShmServerOptions options;
  options.arena_bytes = arena_bytes;
  ServerProcess server(options);
  kvrelay_client* client = nullptr;
  REQUIRE(kvrelay_client_connect(server.socket_path().c_str(), &client) == KVRELAY_OK);
  CHECK(kvrelay_abi_version() >= 2);  // fidelity came with version 2
  const kvrelay_key key{77, 78};
  const kvrelay_layout layout{2, 2, 4, 1, 3};  // 384 bytes of fp32 KV
  const auto exact_bytes = pattern_bytes(384, 5);
  const auto lossy_bytes = pattern_bytes(384, 6);
  const auto lossy = c_fidelity("int4", 0);

  // Lossy KV alone: filed, but a lookup by key (a request for the KV as published) misses.
  REQUIRE(kvrelay_publish_context(client, &key, &layout, lossy_bytes.data(), 384, R"({"agent":"a"})", &lossy) ==
          KVRELAY_OK);
  kvrelay_entry* entry = nullptr;
  CHECK(kvrelay_lookup(client, &key, &entry) == KVRELAY_E_NOT_FOUND);
  auto observer = server.connect();
  CHECK(observer.stats().value().entries == 1);

  // Exact KV replaces it and is what lookups get; a lossy publish over it is refused.
  REQUIRE(kvrelay_publish_context(client, &key, &layout, exact_bytes.data(), 384, nullptr, nullptr) == KVRELAY_OK);
  CHECK(kvrelay_publish_context(client, &key, &layout, lossy_bytes.data(), 384, nullptr, &lossy) ==
        KVRELAY_E_ALREADY_EXISTS);
  CHECK(std::string(kvrelay_last_error(client)).find("int4") != std::string::npos);
  REQUIRE(kvrelay_lookup(client, &key, &entry) == KVRELAY_OK);
  CHECK(std::memcmp(kvrelay_entry_data(entry), exact_bytes.data(), 384) == 0);
  kvrelay_entry_release(entry);

  // Malformed fidelity structs are refused before anything is sent.
  auto wrong_size = lossy;
  wrong_size.struct_size = 8;
  CHECK(kvrelay_publish_context(client, &key, &layout, lossy_bytes.data(), 384, nullptr, &wrong_size) ==
        KVRELAY_E_INVALID_ARGUMENT);
  CHECK(std::string(kvrelay_last_error(client)).find("struct_size") != std::string::npos);
  auto no_codec = lossy;
  no_codec.lossy_codec[0] = '\0';
  CHECK(kvrelay_publish_context(client, &key, &layout, lossy_bytes.data(), 384, nullptr, &no_codec) ==
        KVRELAY_E_INVALID_ARGUMENT);
  auto unterminated = lossy;
  std::memset(unterminated.lossy_codec, 'x', sizeof(unterminated.lossy_codec));
  CHECK(kvrelay_publish_context(client, &key, &layout, lossy_bytes.data(), 384, nullptr, &unterminated) ==
        KVRELAY_E_INVALID_ARGUMENT);
  CHECK(observer.stats().value().entries == 1);
  kvrelay_client_close(client);
}

TEST_CASE("fidelity: a resolve without a KV path serves exact KV only, and says so", "[shm][fidelity]") {
  ServerProcess server;
  auto client = server.connect();
  const KvLayout layout{1, 1, 4, DType::kFloat32, 16};  // one 16-token block: 512 bytes
  const auto bytes = pattern_bytes(512, 9);
  shm::ResolveRequest request{42, 16, 20, {1001}, "", shm::kDataPlaneVersion};
  REQUIRE(client.publish_with_context({42, 1001}, layout, bytes, "", Fidelity::lossy("int8")).has_value());
  const auto missed = client.resolve(request);
  REQUIRE_FALSE(missed.has_value());
  CHECK(missed.error().code == ErrorCode::kNotFound);
  REQUIRE(client.publish_with_context({42, 1001}, layout, bytes, "").has_value());
  const auto resolved = client.resolve(request);
  REQUIRE(resolved.has_value());
  CHECK(resolved.value().meta.blocks == 1);
  CHECK(resolved.value().meta.fidelity.is_exact());
}

TEST_CASE("fidelity: lossy KV is not published to a sidecar that could not record it", "[shm][fidelity]") {
  // A version-3 sidecar, as far as its hello goes: it answers the hello and records every later
  // message type it gets.
  TempDir dir;
  const std::string path = (dir / "old.sock").string();
  UniqueFd listener(::socket(AF_UNIX, SOCK_SEQPACKET | SOCK_CLOEXEC, 0));
  sockaddr_un address{};
  address.sun_family = AF_UNIX;
  std::strncpy(address.sun_path, path.c_str(), sizeof(address.sun_path) - 1);
  REQUIRE(::bind(listener.get(), reinterpret_cast<const sockaddr*>(&address), sizeof(address)) == 0);
  REQUIRE(::listen(listener.get(), 1) == 0);
  std::vector<shm::MessageType> received;
  std::thread old_sidecar([&] {
    UniqueFd connection(::accept(listener.get(), nullptr, nullptr));
    if (!connection) return;
    std::byte buffer[256];
    const auto hello = ::recv(connection.get(), buffer, sizeof(buffer), 0);
    if (hello <= 0) return;
    const auto frame = shm::decode_frame(std::span(buffer, static_cast<std::size_t>(hello)));
    if (!frame) return;
    ByteWriter ok;
    ok.put(std::uint32_t{3}).put(std::uint32_t{4}).put(std::uint64_t{1} << 30);
    const auto reply = shm::encode_frame(shm::MessageType::kHelloOk, frame.value().request_id, ok.bytes());
    if (::send(connection.get(), reply.data(), reply.size(), MSG_NOSIGNAL) < 0) return;
    pollfd poll_fd{connection.get(), POLLIN, 0};
    while (::poll(&poll_fd, 1, 500) > 0) {
      const auto got = ::recv(connection.get(), buffer, sizeof(buffer), 0);
      if (got <= 0) return;
      if (auto message = shm::decode_frame(std::span(buffer, static_cast<std::size_t>(got))))
        received.push_back(message.value().type);
    }
  });
  {
    auto client = shm::ShmClient::connect(path);
    REQUIRE(client.has_value());
    CHECK(client.value().server_version() == 3);
    const KvLayout layout{1, 1, 4, DType::kFloat32, 16};
    const auto bytes = pattern_bytes(512, 3);
    const auto refused = client.value().publish_with_context({5, 6}, layout, bytes, "", Fidelity::lossy("int4"));
    REQUIRE_FALSE(refused.has_value());
    CHECK(refused.error().code == ErrorCode::kUnsupported);
    CHECK(refused.error().message.find("lossy") != std::string::npos);
  }
  old_sidecar.join();
  CHECK(received.empty());  // not even a region was asked for
}

}  // namespace kvrelay::test
