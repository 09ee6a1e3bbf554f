// Fuzzes what an authenticated peer can send (issue #25): every input is one session of a real
// PeerServer (peer_server.cpp's session_body, serve_fetch, receive_pushed) behind a completed
// TLS 1.3 mutual handshake, its bytes made by peer_session_input.h's modes. The server must end
// each session within a bound after the peer's end of stream, and then still accept a fresh
// session that says hello and is answered a ping: the daemon never stops serving on input.
#include <algorithm>
#include <chrono>
#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <span>
#include <vector>

#include "kvrelay/peer/peer_protocol.h"

#include "peer_session_input.h"
#include "peer_tls_harness.h"

namespace {

using namespace kvrelay;
using namespace kvrelay::peer;

// Past the server's own timeouts (10 s): a session whose peer ended its stream has nothing left
// to wait for, so one still open then is stuck.
constexpr std::chrono::seconds kSessionLimit{30};

void require(bool condition, const char* what) {
  if (!condition) {
    std::fprintf(stderr, "fuzz_peer_tls_session: %s\n", what);
    std::abort();
  }
}

// The frame at `offset` of `bytes`: its header, and its payload's position.
struct Framed {
  PeerHeader header;
  std::size_t payload = 0;
};
Framed frame_at(const std::vector<std::byte>& bytes, std::size_t offset) {
  require(bytes.size() >= offset + kPeerHeaderBytes, "a fresh session got a short answer");
  const auto header =
      decode_peer_header(std::span<const std::byte, kPeerHeaderBytes>(bytes.data() + offset, kPeerHeaderBytes));
  require(header.has_value(), "a fresh session got an answer that is not a frame");
  require(bytes.size() >= offset + kPeerHeaderBytes + header.value().length, "a fresh session got a cut frame");
  return {header.value(), offset + kPeerHeaderBytes};
}

void require_fresh_session(const fuzz::TlsSessionServer& server) {
  fuzz::TlsSessionClient client(server);
  require(client.handshake(kSessionLimit), "the server no longer completes a TLS handshake");
  const std::vector<std::byte> ping_payload{std::byte{'o'}, std::byte{'k'}};
  const std::vector<std::uint8_t> empty;
  auto bytes = fuzz::session_bytes(fuzz::session_input(fuzz::SessionMode::kStream, true, empty, {}));
  const auto ping = encode_peer_frame(PeerMessage::kPing, ping_payload);
  bytes.insert(bytes.end(), ping.begin(), ping.end());
  require(client.exchange(bytes, kSessionLimit), "a fresh session did not end after its peer's end of stream");
  const auto& answer = client.received();
  const auto hello_ok = frame_at(answer, 0);
  require(hello_ok.header.type == PeerMessage::kHelloOk, "a fresh session's hello was not answered");
  const auto pong = frame_at(answer, hello_ok.payload + hello_ok.header.length);
  require(pong.header.type == PeerMessage::kPong && pong.header.length == ping_payload.size() &&
              std::equal(ping_payload.begin(), ping_payload.end(),
                         answer.begin() + static_cast<std::ptrdiff_t>(pong.payload)),
          "a fresh session's ping was not answered");
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
  auto& server = fuzz::TlsSessionServer::instance();
  server.reset_store();
  {
    fuzz::TlsSessionClient client(server);
    require(client.handshake(kSessionLimit), "the TLS handshake failed");
    const auto bytes = fuzz::session_bytes(std::span(data, size));
    require(client.exchange(bytes, kSessionLimit), "a session did not end after its peer's end of stream");
  }
  require_fresh_session(server);
  return 0;
}
