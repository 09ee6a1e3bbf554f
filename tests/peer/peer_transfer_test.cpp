// The peer plane's two KV exchanges, against a real daemon: a pushed frame is decoded and filed,
// a fetch returns what the store holds, both as windowed, checksummed chunk streams.
#include <catch2/catch.hpp>

#include "kvrelay/peer/link_estimator.h"

#include "support/peer_fixture.h"

namespace kvrelay::test {

namespace {

peer::FetchRequest raw_fetch(std::uint64_t id, const kv_store::EntryKey& key) {
  return peer::FetchRequest{id, key.model_id, "raw", {key.context_hash}};
}

// Pushes `frame` under its key for `model_id`, then checks that the store holds its KV and a
// fetch returns it with its token ids.
void push_then_fetch(peer::PeerClient& client, const PeerDaemon& daemon, std::uint64_t id, std::uint64_t model_id,
                     const KvFrame& frame) {
  const auto key = frame.key(model_id);
  REQUIRE(client.push_encoded(id, key, frame.chain, frame.bytes()).has_value());
  auto entry = daemon.data_plane().lookup(key);
  REQUIRE(entry.has_value());
  CHECK(entry.value().info.layout == frame.layout);
  CHECK(same_bytes(entry.value().bytes(), frame.kv));
  auto fetched = client.fetch(raw_fetch(id, key), std::uint64_t{1} << 32);
  REQUIRE(fetched.has_value());
  REQUIRE(fetched.value().has_value());
  CHECK(fetched.value()->key == key);
  CHECK(fetched.value()->chain == frame.chain);
  CHECK(same_bytes(decoded_kv(fetched.value()->frame()), frame.kv));
}

}  // namespace

TEST_CASE("pushed KV frames of one token to 256 MiB are filed byte for byte, and fetches return them", "[peer]") {
  PeerDaemon daemon;
  peer::PeerClientOptions options;
  options.link_estimator = std::make_shared<peer::LinkEstimator>();
  auto client = peer::PeerClient::connect(daemon.peer_address(), options);
  REQUIRE(client.has_value());
  CHECK(client.value().remote().node_id == "test-node");
  CHECK(client.value().remote().protocol_version == peer::kPeerVersion);
  std::uint64_t id = 100;
  for (const std::size_t size : {std::size_t{1}, std::size_t{(1U << 20) + 1}, std::size_t{256U << 20}}) {
    INFO("size " << size);
    const auto frame = kv_frame(size, id);
    push_then_fetch(client.value(), daemon, id, 7, frame);
    ++id;
  }
  // A miss: a chain the peer does not hold.
  auto missing = client.value().fetch(raw_fetch(1, {7, 999}), 1U << 20);
  REQUIRE(missing.has_value());
  CHECK_FALSE(missing.value().has_value());
  REQUIRE(client.value().ping().has_value());
  const auto estimate = options.link_estimator->estimate("test-node");
  REQUIRE(estimate.has_value());
  CHECK(estimate->rtt_samples == 1);
  CHECK(estimate->transfer_samples >= 2);  // the pushes and fetches large enough to measure bandwidth
  const auto stats = daemon.peer_stats();
  CHECK(stats.committed_transfers == 3);
  CHECK(stats.fetches_served == 3);
  CHECK(stats.failed_transfers == 0);
}

TEST_CASE("fp8 KV crosses between sidecars as raw and lossless frames, byte for byte, and never lossy", "[peer]") {
  PeerDaemon daemon;
  std::uint64_t id = 700;
  for (const DType dtype : {DType::kFp8E4M3, DType::kFp8E5M2}) {
    for (const char* codec : {"raw", "lossless"}) {
      INFO(dtype_name(dtype) << " pushed as " << codec);
      // A connection each: the refused lossy fetch below may end its session.
      auto client = peer::PeerClient::connect(daemon.peer_address(), {});
      REQUIRE(client.has_value());
      // Over 1 MiB: a lossless frame of more than one chunk.
      const auto frame = kv_frame((1U << 20) + 3, id, codec, KvLayout{4, 2, 64, dtype, 1});
      CHECK(frame.kv.size() == frame.layout.tokens * 4 * 2 * 2 * 64);  // 1 byte an element
      const auto key = frame.key(9);
      REQUIRE(client.value().push_encoded(id, key, frame.chain, frame.bytes()).has_value());
      auto entry = daemon.data_plane().lookup(key);
      REQUIRE(entry.has_value());
      CHECK(entry.value().info.layout == frame.layout);
      CHECK(same_bytes(entry.value().bytes(), frame.kv));
      for (const char* fetch_codec : {"raw", "lossless"}) {
        auto fetched = client.value().fetch(peer::FetchRequest{id, key.model_id, fetch_codec, {key.context_hash}},
                                            std::uint64_t{1} << 32);
        REQUIRE(fetched.has_value());
        REQUIRE(fetched.value().has_value());
        CHECK(same_bytes(decoded_kv(fetched.value()->frame()), frame.kv));
      }
      // A lossy fetch of fp8 KV is refused: its bytes are never converted.
      auto lossy = client.value().fetch(peer::FetchRequest{id, key.model_id, "int8", {key.context_hash}},
                                        std::uint64_t{1} << 32);
      CHECK_FALSE((lossy.has_value() && lossy.value().has_value()));
      ++id;
    }
  }
}

TEST_CASE("a fetch is answered from whole entries only: a held entry's first blocks are not served to peers",
          "[peer][prefix_index]") {
  PeerDaemon daemon;
  auto client = peer::PeerClient::connect(daemon.peer_address(), {});
  REQUIRE(client.has_value());
  auto frame = kv_frame(64U << 10, 31);
  REQUIRE(frame.layout.tokens == 64);
  frame.chain.block_tokens = 16;  // 4 blocks
  const auto keys = kv_store::chain_keys(9, frame.chain, kv_store::ChainScope::kUnscoped);
  const auto key = frame.key(9);
  REQUIRE(client.value().push_encoded(31, key, frame.chain, frame.bytes()).has_value());
  // The store indexes the entry's first blocks, but serve_fetch does not opt in (it would have to
  // encode only them and send their chain under the key asked for): a miss.
  auto prefix = client.value().fetch(peer::FetchRequest{31, 9, "raw", {keys[1], keys[0]}}, std::uint64_t{1} << 32);
  REQUIRE(prefix.has_value());
  CHECK_FALSE(prefix.value().has_value());
  // The whole chain (hashes longest first) is served as before.
  auto whole = client.value().fetch(peer::FetchRequest{32, 9, "raw", {keys[3], keys[2], keys[1], keys[0]}},
                                    std::uint64_t{1} << 32);
  REQUIRE(whole.has_value());
  REQUIRE(whole.value().has_value());
  CHECK(whole.value()->key == key);
  CHECK(whole.value()->chain == frame.chain);
  CHECK(same_bytes(decoded_kv(whole.value()->frame()), frame.kv));
}

TEST_CASE("a push that fits one chunk goes as two halves, kvrelay peer send splits unless told not to", "[peer]") {
  PeerDaemon daemon;
  std::uint64_t id = 300;
  // (frame bytes, split or not) -> the chunks the receiver counted.
  const auto push = [&](std::size_t size, bool split) {
    peer::PeerClientOptions options;
    options.split_single_chunk = split;
    auto client = peer::PeerClient::connect(daemon.peer_address(), options);
    REQUIRE(client.has_value());
    const auto before = daemon.peer_stats().chunks_received;
    const auto frame = kv_frame(size, id);
    REQUIRE(frame.frame.size() >= size);
    const kv_store::EntryKey key = frame.key(8);
    REQUIRE(client.value().push_encoded(id++, key, frame.chain, frame.bytes()).has_value());
    CHECK(same_bytes(daemon.data_plane().lookup(key).value().bytes(), frame.kv));
    return std::pair{daemon.peer_stats().chunks_received - before, frame.frame.size()};
  };
  for (const bool split : {true, false}) {
    INFO("split " << split);
    const auto [chunks, bytes] = push(700U << 10, split);
    CHECK(chunks == (split ? 2U : 1U));
    CHECK(bytes < (1U << 20));
  }
  CHECK(push(100U << 10, true).first == 1);  // below kSplitTransferMinBytes
  CHECK(push(3U << 20, true).first == 4);    // several chunks of the configured size anyway
  TempDir dir;
  const auto frame = kv_frame(700U << 10, 78);
  write_frame_file(dir / "kv.frame", frame);
  write_tokens_file(dir / "tokens.json", frame);
  for (const bool split : {true, false}) {
    INFO("peer send, split " << split);
    const auto before = daemon.peer_stats().chunks_received;
    std::vector<std::string> command{kvrelay_binary().string(),
                                     "peer",
                                     "send",
                                     "--to",
                                     daemon.peer_text(),
                                     "--transfer-id",
                                     std::to_string(id),
                                     "--tokens",
                                     (dir / "tokens.json").string(),
                                     "--block-tokens",
                                     std::to_string(frame.layout.tokens)};
    if (!split) command.emplace_back("--no-split");
    command.push_back((dir / "kv.frame").string());
    const auto sent = run_command(command, dir.path());
    REQUIRE(sent.exit_status == 0);
    CHECK(nlohmann::json::parse(sent.out)["outcome"] == "committed");
    CHECK(daemon.peer_stats().chunks_received - before == (split ? 2U : 1U));
    CHECK(same_bytes(daemon.data_plane().lookup(frame.key(1)).value().bytes(), frame.kv));
    ++id;
  }
}

// Staging (the default, above) and direct I/O must move the same bytes: with limits.peer_staging
// off the daemon writes fetch replies straight from its buffers, and the client writes pushes
// straight from the caller's memory.
TEST_CASE("pushes and fetches without staging, in many small chunks, arrive byte for byte", "[peer]") {
  PeerDaemon daemon(nlohmann::json{{"peer_staging", false}});
  peer::PeerClientOptions options;
  options.stage_chunks = false;
  options.chunk_bytes = 64 * 1024;  // many chunks, so every window and acknowledgement rule runs
  options.window_chunks = 3;
  auto client = peer::PeerClient::connect(daemon.peer_address(), options);
  REQUIRE(client.has_value());
  std::uint64_t id = 400;
  for (const std::size_t size : {std::size_t{1}, std::size_t{64 * 1024}, std::size_t{(3U << 20) + 7}}) {
    INFO("size " << size);
    push_then_fetch(client.value(), daemon, id, 9, kv_frame(size, id));
    ++id;
  }
  CHECK(daemon.peer_stats().committed_transfers == 3);
}

TEST_CASE("kvrelay peer send pushes a frame file to a policy's peer and refuses a file that is no frame", "[peer]") {
  PeerDaemon daemon;
  TempDir dir;
  const auto frame = kv_frame(3U << 20, 21);
  write_frame_file(dir / "kv.frame", frame);
  write_tokens_file(dir / "tokens.json", frame);
  nlohmann::json policy = basic_daemon_policy();
  policy["node"]["id"] = "sender";
  policy["peers"] = nlohmann::json::array({{{"id", "recv"}, {"address", daemon.peer_text()}}});
  write_file(dir / "sender.json", policy.dump());
  const auto sent = run_command({kvrelay_binary().string(), "peer", "send", "--config", (dir / "sender.json").string(),
                                 "--peer", "recv", "--transfer-id", "1", "--tokens", (dir / "tokens.json").string(),
                                 "--block-tokens", std::to_string(frame.layout.tokens), (dir / "kv.frame").string()},
                                dir.path());
  REQUIRE(sent.exit_status == 0);
  CHECK(nlohmann::json::parse(sent.out)["outcome"] == "committed");
  auto entry = daemon.data_plane().lookup(frame.key(1));
  REQUIRE(entry.has_value());
  CHECK(same_bytes(entry.value().bytes(), frame.kv));

  write_file(dir / "junk", std::string(4096, 'x'));
  const auto refused =
      run_command({kvrelay_binary().string(), "peer", "send", "--to", daemon.peer_text(), "--transfer-id", "2",
                   "--tokens", (dir / "tokens.json").string(), (dir / "junk").string()},
                  dir.path());
  CHECK(refused.exit_status == 1);
  CHECK_THAT(refused.err, Catch::Contains("is not a KV frame"));

  const auto probe = run_command({kvrelay_binary().string(), "peer", "probe", daemon.peer_text()}, dir.path());
  REQUIRE(probe.exit_status == 0);
  const auto report = nlohmann::json::parse(probe.out);
  CHECK(report["node"] == "test-node");
  CHECK(report["protocol_version"] == peer::kPeerVersion);
  CHECK(report["stats"]["committed_transfers"] == 1);
  CHECK(report["stats"]["bytes_received"] == frame.frame.size());
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
