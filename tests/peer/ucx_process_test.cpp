// Issue #29 on the daemon's peer plane: a real `kvrelay serve` with a `ucx` section, and real
// clients (this process, `kvrelay peer send --transport ucx` and `kvrelay peer probe`) moving
// chunk streams over UCX with UCX_TLS=tcp and with UCX_TLS=posix: byte-exact from one token to
// 256 MiB both ways, and a sender, receiver or fetch source killed at 10, 50 and 90 percent gives
// a failure within the deadline with nothing partial filed. Counts and bytes only, no timings
// beyond the deadlines the product itself enforces.
#include <catch2/catch.hpp>
#include <nlohmann/json.hpp>

#include <chrono>
#include <csignal>
#include <cstring>
#include <string>
#include <vector>

#include "kvrelay/peer/ucx_transport.h"

#include "support/peer_fixture.h"
#include "support/skip.h"

namespace kvrelay::test {

namespace {

constexpr std::uint32_t kChunkBytes = 256U << 10;

nlohmann::json ucx_section(const std::string& tls) {
  return {{"ucx", {{"tls", tls}}}};
}

peer::PeerClientOptions ucx_client(const std::string& tls) {
  UcxPolicy settings;
  settings.tls = tls;
  auto context = peer::UcxContext::create(settings);
  if (!context) FAIL("UCX context: " << context.error().to_string());
  peer::PeerClientOptions options;
  options.node_id = "ucx-test";
  options.ucx = context.value();
  return options;
}

peer::FetchRequest raw_fetch(std::uint64_t id, const kv_store::EntryKey& key) {
  return peer::FetchRequest{id, key.model_id, "raw", {key.context_hash}};
}

std::vector<std::string> ucx_send_argv(const PeerDaemon& daemon, const std::string& tls, std::uint64_t transfer_id,
                                       const std::filesystem::path& file, const KvFrame& frame, bool paced) {
  return peer_send_argv(daemon, transfer_id, file, frame, kChunkBytes, paced, {"--transport", "ucx", "--ucx-tls", tls});
}

}  // namespace

TEST_CASE("ucx pushes and fetches of one token to 256 MiB through kvrelay serve are byte-exact over tcp and posix",
          "[ucx][process]") {
  if (!peer::ucx_built()) KVRELAY_SKIP("built without UCX (libucx-dev)");
  for (const std::string tls : {"tcp", "posix"}) {
    INFO("UCX_TLS=" << tls);
    PeerDaemon daemon({}, ucx_section(tls));
    auto client = peer::PeerClient::connect(daemon.peer_address(), ucx_client(tls));
    REQUIRE(client.has_value());
    CHECK(client.value().transport() == "ucx");
    CHECK((client.value().remote().capabilities & peer::kCapUcx) != 0);
    std::uint64_t id = 300;
    for (const std::size_t size : {std::size_t{1}, std::size_t{4097}, std::size_t{(1U << 20) + 1},
                                   std::size_t{16U << 20}, std::size_t{256U << 20}}) {
      INFO("size " << size);
      const auto frame = kv_frame(size, id);
      const auto key = frame.key(7);
      REQUIRE(client.value().push_encoded(id, key, frame.chain, frame.bytes()).has_value());
      auto entry = daemon.data_plane().lookup(key);
      REQUIRE(entry.has_value());
      CHECK(same_bytes(entry.value().bytes(), frame.kv));
      auto fetched = client.value().fetch(raw_fetch(id, key), std::uint64_t{1} << 32);
      REQUIRE(fetched.has_value());
      REQUIRE(fetched.value().has_value());
      CHECK(fetched.value()->transport == "ucx");
      CHECK(fetched.value()->chain == frame.chain);
      CHECK(same_bytes(decoded_kv(fetched.value()->frame()), frame.kv));
      ++id;
    }
    const auto stats = daemon.peer_stats();
    CHECK(stats.committed_transfers == 5);
    CHECK(stats.fetches_served == 5);
    CHECK(stats.failed_transfers == 0);
    // The operator's view of the same link: kvrelay peer probe names the transport and its lanes.
    TempDir here;
    const auto probe = run_command({kvrelay_binary().string(), "peer", "probe", daemon.peer_text(), "--transport",
                                    "ucx", "--ucx-tls", tls, "--count", "2"},
                                   here.path());
    REQUIRE(probe.exit_status == 0);
    const auto shown = nlohmann::json::parse(probe.out);
    CHECK(shown["transport"] == "ucx");
    REQUIRE(shown["ucx_lanes"].is_array());
    REQUIRE_FALSE(shown["ucx_lanes"].empty());
    const auto lane = shown["ucx_lanes"][0].get<std::string>();
    CHECK(lane.find(tls) != std::string::npos);
  }
}

TEST_CASE("ucx a push sender killed at 10 50 and 90 percent leaves nothing filed and a retry lands",
          "[ucx][process][fault]") {
  if (!peer::ucx_built()) KVRELAY_SKIP("built without UCX (libucx-dev)");
  for (const std::string tls : {"tcp", "posix"}) {
    INFO("UCX_TLS=" << tls);
    PeerDaemon daemon({}, ucx_section(tls));
    TempDir dir;
    const auto frame = kv_frame(16U << 20, 9);
    write_frame_file(dir / "kv.frame", frame);
    write_tokens_file(dir / "tokens.json", frame);
    auto local = daemon.data_plane();
    std::uint64_t failures_before = 0;
    std::uint64_t transfer_id = 500;
    for (const double percent : {0.10, 0.50, 0.90}) {
      INFO("killed at " << percent * 100 << "%");
      ++transfer_id;
      const auto arena_before = local.stats().value().arena_bytes_in_use;
      ChildProcess sender(ucx_send_argv(daemon, tls, transfer_id, dir / "kv.frame", frame, true), dir.path());
      REQUIRE(wait_until([&] { return printed_progress(sender) >= percent || !sender.running(); },
                         std::chrono::seconds(30)));
      INFO("sender said: " << sender.stderr_text() << " daemon said: " << daemon.process().stderr_text());
      REQUIRE(sender.running());
      sender.send_signal(SIGKILL);
      REQUIRE(sender.wait_for_exit(std::chrono::seconds(5)).has_value());
      INFO("daemon said: " << daemon.process().stderr_text());
      // The control connection closes with the process: the receiver fails the push at once,
      // well inside its read timeout.
      REQUIRE(wait_until([&] { return daemon.peer_stats().failed_transfers == failures_before + 1; },
                         std::chrono::seconds(2)));
      failures_before += 1;
      CHECK(daemon.peer_stats().active_transfers == 0);
      CHECK(local.lookup(KvFrame::key_for(1, frame.chain_at(transfer_id))).error().code == ErrorCode::kNotFound);
      CHECK(local.stats().value().arena_bytes_in_use == arena_before);

      const auto retry =
          run_command(ucx_send_argv(daemon, tls, transfer_id, dir / "kv.frame", frame, false), dir.path());
      INFO("retry said: " << retry.err << " daemon said: " << daemon.process().stderr_text());
      REQUIRE(retry.exit_status == 0);
      const auto outcome = nlohmann::json::parse(retry.out.substr(retry.out.rfind('{')));
      CHECK(outcome["outcome"] == "committed");
      CHECK(outcome["transport"] == "ucx");
      auto entry = local.lookup(KvFrame::key_for(1, frame.chain_at(transfer_id)));
      REQUIRE(entry.has_value());
      CHECK(same_bytes(entry.value().bytes(), frame.kv));
    }
    const auto stats = daemon.peer_stats();
    CHECK(stats.committed_transfers == 3);
    CHECK(stats.failed_transfers == 3);
    CHECK(local.stats().value().entries == 3);
  }
}

TEST_CASE("ucx a push receiver killed at 10 50 and 90 percent fails the sender within its timeout",
          "[ucx][process][fault]") {
  if (!peer::ucx_built()) KVRELAY_SKIP("built without UCX (libucx-dev)");
  for (const std::string tls : {"tcp", "posix"}) {
    INFO("UCX_TLS=" << tls);
    TempDir dir;
    const auto frame = kv_frame(16U << 20, 10);
    write_frame_file(dir / "kv.frame", frame);
    write_tokens_file(dir / "tokens.json", frame);
    for (const double percent : {0.10, 0.50, 0.90}) {
      INFO("receiver killed at " << percent * 100 << "%");
      PeerDaemon doomed({}, ucx_section(tls));
      ChildProcess sender(ucx_send_argv(doomed, tls, 900, dir / "kv.frame", frame, true), dir.path());
      REQUIRE(wait_until([&] { return printed_progress(sender) >= percent || !sender.running(); },
                         std::chrono::seconds(30)));
      REQUIRE(sender.running());
      doomed.process().send_signal(SIGKILL);
      // kvrelay's own deadline bounds it (read timeout 5 s), whatever UCX notices of the death.
      const auto status = sender.wait_for_exit(std::chrono::seconds(6));
      REQUIRE(status.has_value());
      CHECK(*status == 1);
      CHECK(sender.stderr_text().find("kvrelay peer:") != std::string::npos);
    }
  }
}

TEST_CASE("ucx a fetch source killed at 10 50 and 90 percent fails the fetch within its deadline",
          "[ucx][process][fault]") {
  if (!peer::ucx_built()) KVRELAY_SKIP("built without UCX (libucx-dev)");
  for (const std::string tls : {"tcp", "posix"}) {
    INFO("UCX_TLS=" << tls);
    const auto frame = kv_frame(32U << 20, 11);
    for (const double percent : {0.10, 0.50, 0.90}) {
      INFO("source killed at " << percent * 100 << "%");
      PeerDaemon doomed({}, ucx_section(tls));
      const auto key = frame.key(7);
      {
        auto pusher = peer::PeerClient::connect(doomed.peer_address(), {});
        REQUIRE(pusher.has_value());
        REQUIRE(pusher.value().push_encoded(1, key, frame.chain, frame.bytes()).has_value());
      }
      auto options = ucx_client(tls);
      options.chunk_bytes = kChunkBytes;
      bool killed = false;
      options.on_progress = [&](std::uint64_t done, std::uint64_t total) {
        if (!killed && static_cast<double>(done) >= percent * static_cast<double>(total)) {
          killed = true;
          doomed.process().send_signal(SIGKILL);
        }
      };
      auto client = peer::PeerClient::connect(doomed.peer_address(), options);
      REQUIRE(client.has_value());
      const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(3);
      auto fetched = client.value().fetch(raw_fetch(2, key), std::uint64_t{1} << 32, deadline);
      CHECK(killed);
      REQUIRE_FALSE(fetched.has_value());
      CHECK(std::chrono::steady_clock::now() <= deadline + std::chrono::milliseconds(500));
      CHECK(fetched.error().message.find("fetch transfer") != std::string::npos);
    }
  }
}

TEST_CASE("ucx a fetching peer killed at 10 50 and 90 percent leaves the source serving the next fetch",
          "[ucx][process][fault]") {
  if (!peer::ucx_built()) KVRELAY_SKIP("built without UCX (libucx-dev)");
  for (const std::string tls : {"tcp", "posix"}) {
    INFO("UCX_TLS=" << tls);
    // The source paces its link (issue #27's scheduler) so that the kill lands mid-stream.
    auto sections = ucx_section(tls);
    sections["scheduler"] = {{"link_bytes_per_s", 48.0 * (1U << 20)}};
    PeerDaemon source({}, sections);
    TempDir dir;
    const auto frame = kv_frame(32U << 20, 12);
    const auto key = frame.key(7);
    {
      auto pusher = peer::PeerClient::connect(source.peer_address(), {});
      REQUIRE(pusher.has_value());
      REQUIRE(pusher.value().push_encoded(1, key, frame.chain, frame.bytes()).has_value());
    }
    const auto fetch_argv = [&](const std::filesystem::path& out) {
      return std::vector<std::string>{kvrelay_binary().string(),
                                      "peer",
                                      "fetch",
                                      source.peer_text(),
                                      "--model-id",
                                      "7",
                                      "--key",
                                      block_hash_hex(key.context_hash),
                                      "--transport",
                                      "ucx",
                                      "--ucx-tls",
                                      tls,
                                      "--progress",
                                      "--out",
                                      out.string()};
    };
    // In flight at the source: its summaries' node state counts the replies it is sending.
    const auto queued = [&] {
      auto client = peer::PeerClient::connect(source.peer_address(), {});
      REQUIRE(client.has_value());
      auto summary = client.value().summary_reply();
      REQUIRE(summary.has_value());
      return summary.value().node.queued_transfers;
    };
    for (const double percent : {0.10, 0.50, 0.90}) {
      INFO("fetcher killed at " << percent * 100 << "%");
      ChildProcess fetcher(fetch_argv(dir / "partial.frame"), dir.path());
      REQUIRE(wait_until([&] { return printed_progress(fetcher) >= percent || !fetcher.running(); },
                         std::chrono::seconds(30)));
      INFO("fetcher said: " << fetcher.stderr_text() << " source said: " << source.process().stderr_text());
      REQUIRE(fetcher.running());
      fetcher.send_signal(SIGKILL);
      REQUIRE(fetcher.wait_for_exit(std::chrono::seconds(5)).has_value());
      // The source sees the control connection close and drops the reply, well inside its timeout.
      CHECK(wait_until([&] { return queued() == 0; }, std::chrono::seconds(2)));
      const auto whole = run_command(fetch_argv(dir / "whole.frame"), dir.path());
      REQUIRE(whole.exit_status == 0);
      const auto outcome = nlohmann::json::parse(whole.out.substr(whole.out.rfind('{')));
      CHECK(outcome["outcome"] == "fetched");
      CHECK(outcome["transport"] == "ucx");
      const auto written = read_file(dir / "whole.frame");
      CHECK(written.size() == frame.frame.size());
      CHECK(std::memcmp(written.data(), frame.frame.data(), frame.frame.size()) == 0);
    }
    CHECK(source.peer_stats().fetches_served == 3);
  }
}

TEST_CASE("ucx a client that asks for UCX of a peer that offers none is refused by name", "[ucx][process]") {
  if (!peer::ucx_built()) KVRELAY_SKIP("built without UCX (libucx-dev)");
  PeerDaemon plain;
  auto client = peer::PeerClient::connect(plain.peer_address(), ucx_client("tcp"));
  REQUIRE_FALSE(client.has_value());
  CHECK(client.error().code == ErrorCode::kUnsupported);
  CHECK(client.error().message.find("offers no UCX transport") != std::string::npos);
  // The same peer over TCP is fine.
  CHECK(peer::PeerClient::connect(plain.peer_address(), {}).has_value());
}

}  // namespace kvrelay::test
