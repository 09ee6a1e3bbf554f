// Resolves run on the server's pool: a lookup that waits (on a peer, in the daemon) must not hold
// up another worker's lookup on the same sidecar. Real server thread, real socket, real memfds;
// the hooks are the data plane's plug-in point, gated so the test controls when the slow one ends.
#include <catch2/catch.hpp>

#include <chrono>
#include <condition_variable>
#include <future>
#include <mutex>

#include "kvrelay/shm_transport/client.h"
#include "kvrelay/shm_transport/server.h"

#include "support/child_process.h"
#include "support/test_paths.h"

using namespace kvrelay;
using namespace std::chrono_literals;

namespace {

constexpr const char* kGated = R"({"gate":true})";

class GatedHooks final : public shm::DataPlaneHooks {
 public:
  Result<shm::ResolvedEntry> resolve(const shm::ResolveRequest& request) override {
    if (request.params_json == kGated) {
      std::unique_lock lock(mutex_);
      ++waiting_;
      changed_.notify_all();
      changed_.wait(lock, [&] { return open_; });
    }
    return fail(ErrorCode::kNotFound, "nothing stored for " + request.params_json);
  }
  void published(const kv_store::EntryKey&, const std::shared_ptr<const kv_store::StoredEntry>&, std::string_view) override {}
  void prefill_observed(const shm::PrefillReport&) override {}

  bool wait_for_gated(std::chrono::milliseconds timeout) {
    std::unique_lock lock(mutex_);
    return changed_.wait_for(lock, timeout, [&] { return waiting_ > 0; });
  }
  void open() {
    std::lock_guard lock(mutex_);
    open_ = true;
    changed_.notify_all();
  }

 private:
  std::mutex mutex_;
  std::condition_variable changed_;
  int waiting_ = 0;
  bool open_ = false;
};

// Opens the gate on every exit path, so a failed check never leaves a resolve parked.
struct GateOpener {
  GatedHooks& hooks;
  ~GateOpener() { hooks.open(); }
};

shm::ResolveRequest request_with(std::string params) {
  return shm::ResolveRequest{1, 16, 40, {11, 12}, std::move(params), shm::kDataPlaneVersion};
}

}  // namespace

TEST_CASE("a resolve that waits does not hold up another client's resolve", "[shm][resolve][process]") {
  test::TempDir dir;
  shm::ShmServerOptions options;
  options.socket_path = (dir.path() / "kvrelay.sock").string();
  auto listening = shm::ShmServer::listen(options, std::make_shared<kv_store::InMemoryEntryStore>(1ULL << 20));
  REQUIRE(listening);
  auto server = std::move(listening).value();
  auto hooks = std::make_shared<GatedHooks>();
  server->set_hooks(hooks);
  server->start();

  auto slow_client = shm::ShmClient::connect(options.socket_path);
  auto fast_client = shm::ShmClient::connect(options.socket_path);
  REQUIRE(slow_client);
  REQUIRE(fast_client);

  auto slow = std::async(std::launch::async, [&] { return slow_client.value().resolve(request_with(kGated)); });
  auto fast = std::future<Result<shm::ResolvedPrefix>>();
  {
    GateOpener opener{*hooks};
    REQUIRE(hooks->wait_for_gated(10s));
    fast = std::async(std::launch::async, [&] { return fast_client.value().resolve(request_with("{}")); });
    // With resolves on the poll thread this answer would wait for the gate.
    REQUIRE(fast.wait_for(10s) == std::future_status::ready);
    CHECK(slow.wait_for(0s) == std::future_status::timeout);
  }
  const auto fast_answer = fast.get();
  REQUIRE_FALSE(fast_answer);
  CHECK(fast_answer.error().code == ErrorCode::kNotFound);
  CHECK(fast_answer.error().message.find("nothing stored for {}") != std::string::npos);
  const auto slow_answer = slow.get();  // the gate is open: the parked resolve is answered too
  REQUIRE_FALSE(slow_answer);
  CHECK(slow_answer.error().message.find("nothing stored for {\"gate\":true}") != std::string::npos);

  // The connection that waited is polled again: it keeps working.
  const auto again = slow_client.value().resolve(request_with("{\"again\":1}"));
  REQUIRE_FALSE(again);
  CHECK(again.error().message.find("again") != std::string::npos);
  server->stop();
}
