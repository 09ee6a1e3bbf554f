#include <catch2/catch.hpp>

#include "kvrelay/peer/link_estimator.h"

#include "support/peer_fixture.h"

namespace kvrelay::test {

using peer::TransferOutcome;

TEST_CASE("peer transfers of 0 B, 1 B, 1 MiB + 1 and 256 MiB arrive byte for byte", "[peer]") {
  PeerDaemon daemon;
  peer::PeerClientOptions options;
  options.link_estimator = std::make_shared<peer::LinkEstimator>();
  auto client = peer::PeerClient::connect(daemon.peer_address(), options);
  REQUIRE(client.has_value());
  CHECK(client.value().remote().node_id == "test-node");
  auto local = daemon.data_plane();
  std::uint64_t transfer_id = 100;
  for (const std::size_t size :
       {std::size_t{0}, std::size_t{1}, std::size_t{(1U << 20) + 1}, std::size_t{256U << 20}}) {
    INFO("size " << size);
    const auto bytes = peer_pattern(size, transfer_id);
    const kv_store::EntryKey key{7, transfer_id};
    auto sent = client.value().send(transfer_id, key, KvLayout{}, bytes);
    REQUIRE(sent.has_value());
    CHECK(sent.value() == TransferOutcome::kCommitted);
    auto entry = local.lookup(key);
    REQUIRE(entry.has_value());
    CHECK(same_bytes(entry.value().bytes(), bytes));
    // The receiver lands transfers in its shared-memory arena (256 MiB by default) while they
    // fit; the 256 MiB one no longer does and goes into a sealed segment of its own.
    CHECK(entry.value().in_arena() == (size < (256U << 20)));
    ++transfer_id;
  }
  REQUIRE(client.value().ping().has_value());
  const auto estimate = options.link_estimator->estimate("test-node");
  REQUIRE(estimate.has_value());
  CHECK(estimate->rtt_samples == 1);
  CHECK(estimate->transfer_samples == 2);  // the two transfers large enough to measure bandwidth
  CHECK(estimate->throughput_bytes_per_s > 0);
  const auto stats = daemon.peer_stats();
  CHECK(stats.committed_transfers == 4);
  CHECK(stats.bytes_received == 1 + (1U << 20) + 1 + (256U << 20));
}

TEST_CASE("a transfer that fits one chunk goes as two halves and lands byte for byte", "[peer]") {
  PeerDaemon daemon;
  auto local = daemon.data_plane();
  std::uint64_t transfer_id = 300;
  // (size, split or not) -> the chunks the receiver should count.
  const auto send = [&](std::size_t size, bool split) {
    peer::PeerClientOptions options;
    options.split_single_chunk = split;
    auto client = peer::PeerClient::connect(daemon.peer_address(), options);
    REQUIRE(client.has_value());
    const auto before = daemon.peer_stats().chunks_received;
    const auto bytes = peer_pattern(size, transfer_id);
    const kv_store::EntryKey key{8, transfer_id};
    auto sent = client.value().send(transfer_id++, key, KvLayout{}, bytes);
    REQUIRE(sent.has_value());
    CHECK(sent.value() == TransferOutcome::kCommitted);
    auto entry = local.lookup(key);
    REQUIRE(entry.has_value());
    CHECK(same_bytes(entry.value().bytes(), bytes));
    return daemon.peer_stats().chunks_received - before;
  };
  CHECK(send(1U << 20, true) == 2);
  CHECK(send((700U << 10) + 3, true) == 2);
  CHECK(send(100U << 10, true) == 1);      // below kSplitTransferMinBytes
  CHECK(send((1U << 20) + 1, true) == 2);  // two chunks of the configured size anyway
  CHECK(send((3U << 20) + 5, true) == 4);
  CHECK(send(1U << 20, false) == 1);
  // The command line: `peer send` splits unless told not to; `peer probe` reports the count.
  TempDir dir;
  const auto file_bytes = peer_pattern(1U << 20, 78);
  write_file(dir / "payload", std::string(reinterpret_cast<const char*>(file_bytes.data()), file_bytes.size()));
  const auto chunks_received = [&] {
    const auto probe = run_command({kvrelay_binary().string(), "peer", "probe", daemon.peer_text()}, dir.path());
    REQUIRE(probe.exit_status == 0);
    return nlohmann::json::parse(probe.out)["stats"]["chunks_received"].get<std::uint64_t>();
  };
  for (const bool split : {true, false}) {
    INFO("split " << split);
    const auto before = chunks_received();
    std::vector<std::string> command{
        kvrelay_binary().string(),    "peer", "send", "--to", daemon.peer_text(), "--transfer-id",
        std::to_string(transfer_id++)};
    if (!split) command.emplace_back("--no-split");
    command.push_back((dir / "payload").string());
    const auto sent = run_command(command, dir.path());
    REQUIRE(sent.exit_status == 0);
    CHECK(nlohmann::json::parse(sent.out)["outcome"] == "committed");
    CHECK(chunks_received() - before == (split ? 2U : 1U));
  }
}

// Staging (the default, above) and direct I/O must land the same bytes: with limits.peer_staging
// off the receiver reads chunks straight into its arena block and the sender writes them straight
// from the caller's memory.
TEST_CASE("peer transfers without staging arrive byte for byte in the arena", "[peer]") {
  PeerDaemon daemon(nlohmann::json{{"peer_staging", false}});
  peer::PeerClientOptions options;
  options.stage_chunks = false;
  options.chunk_bytes = 64 * 1024;  // many chunks, so every window and acknowledgement rule runs
  auto client = peer::PeerClient::connect(daemon.peer_address(), options);
  REQUIRE(client.has_value());
  auto local = daemon.data_plane();
  std::uint64_t transfer_id = 300;
  for (const std::size_t size : {std::size_t{1}, std::size_t{64 * 1024}, std::size_t{(3U << 20) + 7}}) {
    INFO("size " << size);
    const auto bytes = peer_pattern(size, transfer_id);
    const kv_store::EntryKey key{9, transfer_id};
    auto sent = client.value().send(transfer_id, key, KvLayout{}, bytes);
    REQUIRE(sent.has_value());
    CHECK(sent.value() == TransferOutcome::kCommitted);
    auto entry = local.lookup(key);
    REQUIRE(entry.has_value());
    CHECK(entry.value().in_arena());
    CHECK(same_bytes(entry.value().bytes(), bytes));
    ++transfer_id;
  }
  // The command line's switch for the same thing, from a file's mapping.
  TempDir dir;
  const auto file_bytes = peer_pattern((2U << 20) + 3, 77);
  write_file(dir / "payload", std::string(reinterpret_cast<const char*>(file_bytes.data()), file_bytes.size()));
  const auto sent = run_command({kvrelay_binary().string(), "peer", "send", "--to", daemon.peer_text(), "--transfer-id",
                                 "77", "--no-staging", (dir / "payload").string()},
                                dir.path());
  REQUIRE(sent.exit_status == 0);
  CHECK(nlohmann::json::parse(sent.out)["outcome"] == "committed");
  auto entry = local.lookup({1, 77});
  REQUIRE(entry.has_value());
  CHECK(same_bytes(entry.value().bytes(), file_bytes));
  CHECK(daemon.peer_stats().committed_transfers == 4);
}

TEST_CASE("peer KV transfers keep their layout, same-host peers may use shared memory", "[peer]") {
  PeerDaemon daemon;
  const KvLayout layout{3, 2, 16, DType::kBFloat16, 50};
  const auto bytes = peer_pattern(layout.total_bytes().value(), 5);
  {
    auto client = peer::PeerClient::connect(daemon.peer_address(), {});
    REQUIRE(client.has_value());
    REQUIRE(client.value().send(1, {3, 1}, layout, bytes).value() == TransferOutcome::kCommitted);
  }
  peer::PeerClientOptions same_host;
  same_host.allow_shared_memory = true;
  auto client = peer::PeerClient::connect(daemon.peer_address(), same_host);
  REQUIRE(client.has_value());
  CHECK_FALSE(client.value().remote().shm_socket.empty());
  REQUIRE(client.value().send(2, {3, 2}, layout, bytes).value() == TransferOutcome::kCommittedViaSharedMemory);
  auto local = daemon.data_plane();
  for (const std::uint64_t context : {std::uint64_t{1}, std::uint64_t{2}}) {
    auto entry = local.lookup({3, context});
    REQUIRE(entry.has_value());
    CHECK(entry.value().info.layout == layout);
    CHECK(same_bytes(entry.value().bytes(), bytes));
  }
  CHECK(daemon.peer_stats().committed_transfers == 1);  // the second went through shared memory
  CHECK(local.stats().value().commits == 1);
}

TEST_CASE("kvrelay peer send follows the policy: shared memory only for same_host peers", "[peer]") {
  PeerDaemon daemon;
  TempDir dir;
  const auto bytes = peer_pattern(3 << 20, 21);
  write_file(dir / "payload", std::string(reinterpret_cast<const char*>(bytes.data()), bytes.size()));
  for (const bool same_host : {false, true}) {
    INFO("same_host " << same_host);
    nlohmann::json policy = basic_daemon_policy();
    policy["node"]["id"] = "sender";
    policy["peers"] =
        nlohmann::json::array({{{"id", "recv"}, {"address", daemon.peer_text()}, {"same_host", same_host}}});
    write_file(dir / "sender.json", policy.dump());
    const std::uint64_t transfer_id = same_host ? 2 : 1;
    const auto sent =
        run_command({kvrelay_binary().string(), "peer", "send", "--config", (dir / "sender.json").string(), "--peer",
                     "recv", "--transfer-id", std::to_string(transfer_id), (dir / "payload").string()},
                    dir.path());
    REQUIRE(sent.exit_status == 0);
    CHECK(nlohmann::json::parse(sent.out)["outcome"] == (same_host ? "committed_shm" : "committed"));
    auto entry = daemon.data_plane().lookup({1, transfer_id});
    REQUIRE(entry.has_value());
    CHECK(same_bytes(entry.value().bytes(), bytes));
  }
  const auto probe = run_command({kvrelay_binary().string(), "peer", "probe", daemon.peer_text()}, dir.path());
  REQUIRE(probe.exit_status == 0);
  const auto report = nlohmann::json::parse(probe.out);
  CHECK(report["node"] == "test-node");
  CHECK(report["stats"]["committed_transfers"] == 1);
  CHECK(report["stats"]["bytes_received"] == 3 << 20);
}

TEST_CASE("link estimates are windowed: median RTT and throughput of the recent transfers", "[peer][unit]") {
  peer::LinkEstimator estimator(4);
  CHECK_FALSE(estimator.estimate("b").has_value());
  for (const int rtt : {1000, 10, 20, 30, 40})
    estimator.add_rtt("b", std::chrono::microseconds(rtt));
  // The window holds the last four samples (10, 20, 30, 40): the 1000 us outlier has left.
  estimator.add_transfer("b", 1, std::chrono::microseconds(1));  // too small to say anything
  estimator.add_transfer("b", 1 << 20, std::chrono::microseconds(1000));
  estimator.add_transfer("b", 3 << 20, std::chrono::microseconds(1000));
  const auto estimate = estimator.estimate("b").value();
  CHECK(estimate.rtt_samples == 4);
  CHECK(estimate.rtt >= std::chrono::microseconds(20));
  CHECK(estimate.rtt <= std::chrono::microseconds(30));
  CHECK(estimate.transfer_samples == 2);
  CHECK(estimate.throughput_bytes_per_s == Approx(double(4 << 20) / 0.002));
}

}  // namespace kvrelay::test
