#include <fcntl.h>
#include <sys/eventfd.h>
#include <sys/mman.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/un.h>

#include <catch2/catch.hpp>

#include <cstring>

#include "kvrelay/core/byte_io.h"
#include "kvrelay/shm_transport/fd_passing.h"

#include "shm_fixture.h"
#include "support/skip.h"

namespace kvrelay::test {

namespace {

std::vector<std::byte> size_payload(std::uint64_t size) {
  ByteWriter writer;
  writer.put(size);
  return writer.take();
}

// Sends a raw datagram (with fds) on the client's socket and returns the server's answer.
Error raw_exchange_error(shm::ShmClient& client, std::span<const std::byte> datagram, std::span<const int> fds = {}) {
  REQUIRE(shm::send_message(client.socket_fd(), datagram, fds).has_value());
  auto reply = shm::receive_message(client.socket_fd());
  REQUIRE(reply.has_value());
  REQUIRE(reply.value().fds.empty());
  auto frame = shm::decode_frame(reply.value().bytes);
  REQUIRE(frame.has_value());
  REQUIRE(frame.value().type == shm::MessageType::kError);
  return shm::decode_error(frame.value().payload);
}

void expect_still_serving(shm::ShmClient& client) {
  const std::byte hello[] = {std::byte{1}, std::byte{2}};
  auto pong = client.ping(hello);
  REQUIRE(pong.has_value());
  CHECK(pong.value().size() == 2);
}

}  // namespace

TEST_CASE("shm refuses unsealed, resizable and non-memfd descriptors without leaking them", "[shm][hostile][fault]") {
  ServerProcess server;
  auto client = server.connect();
  const std::size_t baseline = count_fds(server.pid());

  SECTION("an unsealed memfd the client could truncate later") {
    UniqueFd memfd(::memfd_create("unsealed", MFD_CLOEXEC | MFD_ALLOW_SEALING));
    REQUIRE(::ftruncate(memfd.get(), 4096) == 0);
    auto attached = client.attach(std::move(memfd));
    REQUIRE_FALSE(attached.has_value());
    CHECK(attached.error().code == ErrorCode::kPermissionDenied);
  }
  SECTION("a memfd sealed against growing but not shrinking") {
    UniqueFd memfd(::memfd_create("half", MFD_CLOEXEC | MFD_ALLOW_SEALING));
    REQUIRE(::ftruncate(memfd.get(), 4096) == 0);
    REQUIRE(::fcntl(memfd.get(), F_ADD_SEALS, F_SEAL_GROW) == 0);
    CHECK(client.attach(std::move(memfd)).error().code == ErrorCode::kPermissionDenied);
  }
  SECTION("a regular file, an eventfd and a pipe") {
    TempDir dir;
    write_file(dir / "data", std::string(4096, 'x'));
    UniqueFd file(::open((dir / "data").c_str(), O_RDWR | O_CLOEXEC));
    CHECK(client.attach(std::move(file)).error().code == ErrorCode::kInvalidArgument);
    UniqueFd event(::eventfd(0, EFD_CLOEXEC));
    const int event_fds[] = {event.get()};
    const auto attach = shm::encode_frame(shm::MessageType::kAttachRegion, 7, size_payload(4096));
    CHECK(raw_exchange_error(client, attach, event_fds).code == ErrorCode::kInvalidArgument);
    int pipe_fds[2];
    REQUIRE(::pipe2(pipe_fds, O_CLOEXEC) == 0);
    UniqueFd read_end(pipe_fds[0]);
    UniqueFd write_end(pipe_fds[1]);
    const int pipe_fd[] = {read_end.get()};
    CHECK(raw_exchange_error(client, attach, pipe_fd).code == ErrorCode::kInvalidArgument);
  }
  SECTION("a sealed memfd whose size differs from the message") {
    auto memfd = kv_store::create_sealed_memfd("liar", 4096);
    REQUIRE(memfd.has_value());
    const int fds[] = {memfd.value().get()};
    const auto attach = shm::encode_frame(shm::MessageType::kAttachRegion, 8, size_payload(1 << 20));
    CHECK(raw_exchange_error(client, attach, fds).code == ErrorCode::kInvalidArgument);
  }
  SECTION("a region handed out by the sidecar cannot be truncated or grown") {
    auto region = client.allocate(1 << 16);
    REQUIRE(region.has_value());
    CHECK(::ftruncate(region.value().fd.get(), 10) != 0);
    CHECK(::ftruncate(region.value().fd.get(), 1 << 20) != 0);
    std::memset(region.value().mapping.data(), 1, 1 << 16);
    const auto checksum = shm::checksum_bytes(region.value().bytes());
    UniqueFd kept(::dup(region.value().fd.get()));
    REQUIRE(client.commit(std::move(region).value(), {4, 4}, KvLayout{}, checksum).has_value());
    // After commit the writer's own fd can no longer change a byte.
    CHECK(::fallocate(kept.get(), FALLOC_FL_PUNCH_HOLE | FALLOC_FL_KEEP_SIZE, 0, 4096) != 0);
    const char junk = 'x';
    CHECK(::pwrite(kept.get(), &junk, 1, 0) < 0);
    CHECK_FALSE(kv_store::Mapping::map(kept.get(), 1 << 16, true).has_value());
    auto entry = client.lookup({4, 4});
    REQUIRE(entry.has_value());
    CHECK(shm::checksum_bytes(entry.value().bytes()) == checksum);
  }
  expect_still_serving(client);
  CHECK(client.stats().value().pending_regions == 0);
  CHECK(count_fds(server.pid()) == baseline + client.stats().value().entries);
}

TEST_CASE("shm refuses malformed control messages and too many fds without leaking", "[shm][hostile][fault]") {
  ServerProcess server;
  auto client = server.connect();
  const std::size_t baseline = count_fds(server.pid());
  const auto valid_alloc = shm::encode_frame(shm::MessageType::kAllocRegion, 1, size_payload(4096));

  SECTION("shorter than a header") {
    const std::byte tiny[] = {std::byte{0x4B}, std::byte{0x56}, std::byte{0x52}};
    CHECK(raw_exchange_error(client, tiny).code == ErrorCode::kTruncated);
  }
  SECTION("bad magic, version, type and length fields") {
    auto bad_magic = valid_alloc;
    bad_magic[0] = std::byte{0};
    CHECK(raw_exchange_error(client, bad_magic).code == ErrorCode::kBadMagic);
    auto bad_version = valid_alloc;
    bad_version[4] = std::byte{9};
    CHECK(raw_exchange_error(client, bad_version).code == ErrorCode::kBadVersion);
    auto bad_type = valid_alloc;
    bad_type[6] = std::byte{0x42};
    CHECK(raw_exchange_error(client, bad_type).code == ErrorCode::kProtocol);
    auto long_length = valid_alloc;
    long_length[8] = std::byte{9};
    CHECK(raw_exchange_error(client, long_length).code == ErrorCode::kProtocol);
    auto huge_length = valid_alloc;
    huge_length[11] = std::byte{0xFF};
    CHECK(raw_exchange_error(client, huge_length).code == ErrorCode::kProtocol);
    auto reply_type = valid_alloc;
    reply_type[6] = std::byte{0x82};
    CHECK(raw_exchange_error(client, reply_type).code == ErrorCode::kProtocol);
  }
  SECTION("payloads that do not match their message type") {
    const std::byte four[] = {std::byte{1}, std::byte{2}, std::byte{3}, std::byte{4}};
    CHECK(raw_exchange_error(client, shm::encode_frame(shm::MessageType::kAllocRegion, 2, four)).code ==
          ErrorCode::kProtocol);
    CHECK(raw_exchange_error(client, shm::encode_frame(shm::MessageType::kCommit, 3, four)).code ==
          ErrorCode::kTruncated);
    CHECK(raw_exchange_error(client, shm::encode_frame(shm::MessageType::kLookup, 4, four)).code ==
          ErrorCode::kProtocol);
    CHECK(raw_exchange_error(client, shm::encode_frame(shm::MessageType::kAllocRegion, 5, size_payload(~0ULL))).code ==
          ErrorCode::kResourceExhausted);
  }
  SECTION("a datagram larger than any control message") {
    std::vector<std::byte> oversized(shm::kMaxMessageBytes + 100, std::byte{0});
    // send_message itself refuses this size, so use the raw socket.
    REQUIRE(::send(client.socket_fd(), oversized.data(), oversized.size(), 0) > 0);
    auto reply = shm::receive_message(client.socket_fd());
    REQUIRE(reply.has_value());
    CHECK(shm::decode_error(shm::decode_frame(reply.value().bytes).value().payload).code == ErrorCode::kProtocol);
  }
  SECTION("fds attached to a message that takes none, and too many fds") {
    std::vector<UniqueFd> owned;
    std::vector<int> fds;
    for (int index = 0; index < 4; ++index) {
      owned.emplace_back(::eventfd(0, EFD_CLOEXEC));
      fds.push_back(owned.back().get());
    }
    CHECK(raw_exchange_error(client, valid_alloc, std::span(fds).first(1)).code == ErrorCode::kProtocol);
    CHECK(raw_exchange_error(client, valid_alloc, fds).code == ErrorCode::kProtocol);
    // More than the receiver's control buffer holds: the kernel truncates, we close the rest.
    for (int index = 0; index < 60; ++index) {
      owned.emplace_back(::eventfd(0, EFD_CLOEXEC));
      fds.push_back(owned.back().get());
    }
    for (const std::size_t count : {std::size_t{5}, std::size_t{16}, std::size_t{64}}) {
      INFO(count << " fds");
      msghdr header{};
      iovec vector{const_cast<std::byte*>(valid_alloc.data()), valid_alloc.size()};
      header.msg_iov = &vector;
      header.msg_iovlen = 1;
      std::vector<char> control(CMSG_SPACE(sizeof(int) * count));
      header.msg_control = control.data();
      header.msg_controllen = control.size();
      cmsghdr* message = CMSG_FIRSTHDR(&header);
      message->cmsg_level = SOL_SOCKET;
      message->cmsg_type = SCM_RIGHTS;
      message->cmsg_len = CMSG_LEN(sizeof(int) * count);
      std::memcpy(CMSG_DATA(message), fds.data(), sizeof(int) * count);
      REQUIRE(::sendmsg(client.socket_fd(), &header, 0) > 0);
      auto reply = shm::receive_message(client.socket_fd());
      REQUIRE(reply.has_value());
      CHECK(shm::decode_error(shm::decode_frame(reply.value().bytes).value().payload).code == ErrorCode::kProtocol);
    }
  }
  expect_still_serving(client);
  CHECK(client.stats().value().pending_regions == 0);
  CHECK(count_fds(server.pid()) == baseline);
  CHECK(client.stats().value().rejected_messages > 0);
}

TEST_CASE("shm socket is mode 0600 and refuses a foreign uid unless the policy allows it", "[shm][hostile][fault]") {
  ServerProcess server;
  struct stat info {};
  REQUIRE(::stat(server.socket_path().c_str(), &info) == 0);
  CHECK((info.st_mode & 0777) == 0600);
  if (::geteuid() != 0) KVRELAY_SKIP("not root: cannot switch to a foreign uid; checked the socket mode only");
  // A directory the foreign uid can traverse, with a world-connectable socket, so that only
  // the SO_PEERCRED check stands between it and the sidecar.
  char dir_template[] = "/tmp/kvrelay-uid-XXXXXX";
  REQUIRE(::mkdtemp(dir_template) != nullptr);
  const std::string dir = dir_template;
  REQUIRE(::chmod(dir.c_str(), 0755) == 0);
  auto try_as_nobody = [](const std::string& path) {
    const pid_t child = ::fork();
    if (child == 0) {
      if (::setgid(65534) != 0 || ::setuid(65534) != 0) ::_exit(90);
      auto client = shm::ShmClient::connect(path);
      ::_exit(client ? 0 : static_cast<int>(client.error().code));
    }
    int status = 0;
    ::waitpid(child, &status, 0);
    return WIFEXITED(status) ? WEXITSTATUS(status) : -1;
  };
  {
    shm::ShmServerOptions options;
    options.socket_path = dir + "/strict.sock";
    ServerProcess strict(options);
    CHECK(try_as_nobody(options.socket_path) != 0);  // file mode alone keeps it out
    REQUIRE(::chmod(options.socket_path.c_str(), 0666) == 0);
    CHECK(try_as_nobody(options.socket_path) == static_cast<int>(ErrorCode::kPermissionDenied));
    auto owner = strict.connect();
    CHECK(owner.stats().value().refused_connections == 1);
  }
  {
    shm::ShmServerOptions options;
    options.socket_path = dir + "/open.sock";
    options.allowed_uids = {65534};
    ServerProcess allowing(options);
    REQUIRE(::chmod(options.socket_path.c_str(), 0666) == 0);
    CHECK(try_as_nobody(options.socket_path) == 0);
  }
  std::filesystem::remove_all(dir);
}

TEST_CASE("shm connect to a sidecar whose accept backlog is full gives up after its reply timeout",
          "[shm][hostile][fault]") {
  // A listener that never accepts: once its backlog is full, a further connect would wait.
  TempDir dir;
  const std::string path = (dir / "full.sock").string();
  UniqueFd listener(::socket(AF_UNIX, SOCK_SEQPACKET | SOCK_CLOEXEC, 0));
  sockaddr_un address{};
  address.sun_family = AF_UNIX;
  std::strncpy(address.sun_path, path.c_str(), sizeof(address.sun_path) - 1);
  REQUIRE(::bind(listener.get(), reinterpret_cast<const sockaddr*>(&address), sizeof(address)) == 0);
  REQUIRE(::listen(listener.get(), 0) == 0);
  std::vector<UniqueFd> queued;
  for (int attempt = 0; attempt < 8; ++attempt) {
    UniqueFd fd(::socket(AF_UNIX, SOCK_SEQPACKET | SOCK_CLOEXEC | SOCK_NONBLOCK, 0));
    if (::connect(fd.get(), reinterpret_cast<const sockaddr*>(&address), sizeof(address)) != 0) break;
    queued.push_back(std::move(fd));
  }
  REQUIRE_FALSE(queued.empty());
  const auto refused = shm::ShmClient::connect(path, shm::kDataPlaneVersion, std::chrono::milliseconds(200));
  REQUIRE_FALSE(refused.has_value());
  CHECK(refused.error().code == ErrorCode::kTimeout);
  CHECK_THAT(refused.error().message, Catch::Contains("full.sock"));
}

}  // namespace kvrelay::test
