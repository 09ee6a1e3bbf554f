#pragma once

// A same-host peer's KV over shared memory: its sidecar's data plane (the Unix socket its peer
// hello names) looks the chain up by key and hands over the sealed entry, which is read here
// and encoded with the fetch's codec, so a lossy medium delivers exactly what the codec
// delivers over TCP, and the KV path decodes both the same way.

#include <chrono>
#include <cstdint>
#include <optional>
#include <string>

#include "kvrelay/codec_plugins/registry.h"
#include "kvrelay/core/result.h"
#include "kvrelay/core/warm_buffers.h"
#include "kvrelay/peer/peer_client.h"
#include "kvrelay/shm_transport/client.h"

namespace kvrelay::broker {

// What a shared-memory fetch may use: the peer's socket, a client kept between fetches
// (connected on first use, dropped on any error), and buffers kept warm.
struct ShmFetchContext {
  std::optional<shm::ShmClient>& client;
  const std::string& socket_path;
  const codec::CodecRegistry& codecs;
  WarmBufferPool& buffers;
  std::chrono::milliseconds call_timeout;  // per data-plane call, further bounded by the deadline
};

// The longest prefix of `request.hashes` the peer holds, less `request.skip_tokens`, as a frame
// of `request.codec` (nullopt: it holds none), all by `deadline`: past it a kTimeout names the
// stage. FetchedFrame::transport is "shm".
[[nodiscard]] Result<std::optional<peer::PeerClient::FetchedFrame>> fetch_over_shm(const ShmFetchContext& context,
                                                                                   const peer::FetchRequest& request,
                                                                                   peer::Deadline deadline,
                                                                                   std::uint64_t max_frame_bytes);

}  // namespace kvrelay::broker
