// Fuzzes the worker <-> sidecar control protocol's parsers on one datagram, as the sidecar
// receives it from a worker: the frame header, then the payload decoders of the messages that
// carry structured payloads. A decoded message must encode back to the same payload; anything
// else must be a clean error.
#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <cstdlib>
#include <span>
#include <vector>

#include "kvrelay/kv_store/entry.h"
#include "kvrelay/shm_transport/control_protocol.h"

namespace {

using namespace kvrelay::shm;

void require(bool condition) {
  if (!condition) std::abort();
}

bool same(std::span<const std::byte> a, std::span<const std::byte> b) {
  return std::equal(a.begin(), a.end(), b.begin(), b.end());
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
  const auto datagram = std::as_bytes(std::span(data, size));
  const auto frame = decode_frame(datagram);
  if (!frame) return 0;
  const auto payload = frame.value().payload;
  require(payload.size() + kControlHeaderBytes == size);
  require(same(encode_frame(frame.value().type, frame.value().request_id, payload), datagram));
  switch (frame.value().type) {
    case MessageType::kResolve:
      if (auto request = decode_resolve(payload)) require(same(encode_resolve(request.value()), payload));
      break;
    case MessageType::kPrefillReport:
      if (auto report = decode_prefill_report(payload)) require(same(encode_prefill_report(report.value()), payload));
      break;
    case MessageType::kStatsReply:
      if (auto stats = decode_stats(payload)) (void)encode_stats(stats.value());
      break;
    case MessageType::kError:
      (void)decode_error(payload);
      break;
    case MessageType::kLookup: {
      kvrelay::ByteReader reader(payload);
      (void)kvrelay::kv_store::decode_key(reader);
      break;
    }
    case MessageType::kCommit:
    case MessageType::kCommitContext: {
      const bool with_context = frame.value().type == MessageType::kCommitContext;
      for (const std::uint32_t version : {kFidelityDataPlaneVersion, kChainDataPlaneVersion, kSpanDataPlaneVersion}) {
        if (auto commit = decode_commit(payload, with_context, version)) {
          require(same(encode_commit(commit.value(), with_context, version), payload));
        }
      }
      break;
    }
    default:
      break;
  }
  return 0;
}
