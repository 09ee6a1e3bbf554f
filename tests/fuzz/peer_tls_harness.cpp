#include "peer_tls_harness.h"

#include <boost/asio/connect.hpp>
#include <boost/asio/write.hpp>
#include <spdlog/spdlog.h>

#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <string>

#include "kvrelay/codec_plugins/metrics.h"
#include "kvrelay/codec_plugins/registry.h"
#include "kvrelay/core/policy.h"

#include "peer_session_input.h"

namespace kvrelay::fuzz {

namespace {

namespace asio = boost::asio;
using tcp = asio::ip::tcp;

template <typename T>
T must(Result<T> result, const char* what) {
  if (!result) {
    std::fprintf(stderr, "fuzz_peer_tls_session: %s: %s\n", what, result.error().to_string().c_str());
    std::abort();
  }
  return std::move(result).value();
}

std::filesystem::path make_cert_dir() {
  const char* tmp = std::getenv("TMPDIR");
  std::string pattern = std::string(tmp != nullptr && *tmp != '\0' ? tmp : "/tmp") + "/kvrelay-tls-fuzz-XXXXXX";
  if (::mkdtemp(pattern.data()) == nullptr) {
    std::perror("fuzz_peer_tls_session: mkdtemp");
    std::abort();
  }
  // Once per process: a fuzz input costs two handshakes, never an openssl run.
  const std::string command = std::string("'") + KVRELAY_SOURCE_DIR + "/scripts/make-dev-certs.sh' '" + pattern + "' " +
                              std::string(kServerNode) + " " + std::string(kClientNode) + " >/dev/null";
  if (std::system(command.c_str()) != 0) {
    std::fprintf(stderr, "fuzz_peer_tls_session: %s failed\n", command.c_str());
    std::abort();
  }
  return pattern;
}

PeerTlsPolicy tls_files(const std::filesystem::path& dir, std::string_view node) {
  const std::string id(node);
  return {(dir / (id + ".pem")).string(), (dir / (id + "-key.pem")).string(), (dir / "ca.pem").string()};
}

// node-a's policy: peer node-b by its certificate's SPIFFE ID, an agent on each node with the
// held entry's model, and a route each way (node-b may push only on b-to-a).
std::shared_ptr<const Policy> node_a_policy() {
  const std::string model = R"({"architecture": "llama", "layers": 2, "kv_heads": 2, "head_dim": 8,
                                "dtype": "fp16", "weights": "fuzz"})";
  const std::string text = R"({"schema_version": 1, "node": {"id": "node-a"},
    "listen": {"http": "127.0.0.1:0"},
    "peers": [{"id": "node-b", "address": "127.0.0.1:1", "identity": "spiffe://kvrelay.dev/node/node-b"}],
    "agents": [{"id": "here", "upstream": "http://127.0.0.1:1", "model": )" +
                           model + R"(},
               {"id": "there", "node": "node-b", "upstream": "http://127.0.0.1:1", "model": )" +
                           model + R"(}],
    "routes": [{"id": "b-to-a", "from": "there", "to": "here"}, {"id": "a-to-b", "from": "here", "to": "there"}]})";
  return std::make_shared<const Policy>(must(parse_policy(text, "fuzz-policy.json"), "policy"));
}

// Runs `io` until `done` or `limit`; false when the limit came first.
bool run_until(asio::io_context& io, const bool& done, std::chrono::milliseconds limit) {
  io.restart();
  const auto deadline = std::chrono::steady_clock::now() + limit;
  while (!done && io.run_one_until(deadline) > 0) {
  }
  return done;
}

}  // namespace

TlsSessionServer& TlsSessionServer::instance() {
  static TlsSessionServer server;
  return server;
}

TlsSessionServer::TlsSessionServer() : cert_dir_(make_cert_dir()) {
  // A refused session logs a warning; thousands of inputs a second would drown the fuzzer's output.
  if (std::getenv("KVRELAY_FUZZ_LOG") == nullptr) spdlog::set_level(spdlog::level::off);
  client_tls_ = must(peer::PeerTls::load(tls_files(cert_dir_, kClientNode)), "client TLS");
  const auto kv = must(codec::synthetic_kv(held_layout(), 1), "synthetic KV");
  auto held = must(kv_store::make_stored_entry(held_layout(), std::as_bytes(std::span(kv))), "held entry");
  held->chain = std::make_shared<const kv_store::EntryChain>(held_chain());
  held_ = std::move(held);
  constexpr std::uint64_t kStoreBytes = 64ULL << 20;
  store_ = std::make_shared<kv_store::InMemoryEntryStore>(kStoreBytes);
  reset_store();

  peer::PeerServerOptions options;
  options.node_id = std::string(kServerNode);
  // As the daemon sets them (daemon.cpp), with a store of kStoreBytes; short chunks and a small
  // window so that a fetch reply is a stream of several chunks and acknowledgements.
  options.max_entry_bytes = kStoreBytes;
  options.warm_buffer_bytes = 1 << 20;
  options.chunk_bytes = 256;
  options.window_chunks = 2;
  // Never waited out: the client ends its stream as soon as it has written. Long enough that
  // a loaded ASan run never times out a handshake.
  options.handshake_timeout = std::chrono::seconds(10);
  options.read_timeout = std::chrono::seconds(10);
  options.idle_timeout = std::chrono::seconds(10);
  options.codecs = std::make_shared<const codec::CodecRegistry>(codec::CodecRegistry::with_builtins());
  options.tls = must(peer::PeerTls::load(tls_files(cert_dir_, kServerNode)), "server TLS");
  options.policy = [policy = node_a_policy()] { return policy; };
  server_ = std::make_unique<peer::PeerServer>(io_, std::move(options), store_);
  if (auto listening = server_->listen({"127.0.0.1", 0}); !listening) {
    std::fprintf(stderr, "fuzz_peer_tls_session: listen: %s\n", listening.error().to_string().c_str());
    std::abort();
  }
  thread_ = std::thread([this] { io_.run(); });
}

TlsSessionServer::~TlsSessionServer() {
  server_->stop();  // the accept loop and every session end, and with them io_.run()
  thread_.join();
  server_.reset();
  std::error_code ignored;
  std::filesystem::remove_all(cert_dir_, ignored);
}

void TlsSessionServer::reset_store() {
  store_->clear();
  if (auto put = store_->put(held_key(), held_); !put) {
    std::fprintf(stderr, "fuzz_peer_tls_session: held entry: %s\n", put.error().to_string().c_str());
    std::abort();
  }
}

TlsSessionClient::TlsSessionClient(const TlsSessionServer& server)
    : endpoint_(server.endpoint()), context_(server.client_context()), stream_(io_, *context_) {}

bool TlsSessionClient::handshake(std::chrono::milliseconds limit) {
  bool done = false;
  boost::system::error_code result;
  stream_.lowest_layer().async_connect(endpoint_, [&](const boost::system::error_code& connected) {
    if (connected) {
      result = connected;
      done = true;
      return;
    }
    stream_.async_handshake(asio::ssl::stream_base::client, [&](const boost::system::error_code& shaken) {
      result = shaken;
      done = true;
    });
  });
  const bool finished = run_until(io_, done, limit);
  if (!finished) {  // the pending handlers refer to this frame: let them finish before it goes
    boost::system::error_code ignored;
    stream_.lowest_layer().close(ignored);
    io_.restart();
    io_.run();
  }
  return finished && !result;
}

void TlsSessionClient::read_more() {
  stream_.async_read_some(asio::buffer(buffer_), [this](const boost::system::error_code& ec, std::size_t n) {
    received_.insert(received_.end(), buffer_.begin(), buffer_.begin() + static_cast<std::ptrdiff_t>(n));
    if (ec) {
      closed_ = true;  // the server closed (or reset) the connection
      return;
    }
    read_more();
  });
}

bool TlsSessionClient::exchange(std::span<const std::byte> bytes, std::chrono::milliseconds limit) {
  // Writes and reads at once: a server answering while the input is still being written must
  // never wait on a client that is not reading.
  asio::async_write(stream_, asio::buffer(bytes.data(), bytes.size()),
                    [this](const boost::system::error_code&, std::size_t) {
                      boost::system::error_code ignored;
                      stream_.lowest_layer().shutdown(tcp::socket::shutdown_send, ignored);
                    });
  read_more();
  const bool closed = run_until(io_, closed_, limit);
  boost::system::error_code ignored;
  stream_.lowest_layer().close(ignored);
  io_.restart();
  io_.run();  // a write still pending completes (aborted) before `bytes` may go
  return closed;
}

}  // namespace kvrelay::fuzz
