#pragma once

// Stage two of a lookup: getting KV this node lacks from elsewhere, by a deadline. The KV path
// asks only this interface; PeerLinksFetcher puts the peers (TCP, or a same-host peer's shared
// memory) behind it, and tests put a fake.

#include <cstdint>
#include <optional>
#include <span>
#include <string>
#include <vector>

#include "kvrelay/core/result.h"
#include "kvrelay/core/warm_buffers.h"
#include "kvrelay/peer/peer_client.h"
#include "kvrelay/peer/peer_protocol.h"

namespace kvrelay::broker {

class Fetcher {
 public:
  virtual ~Fetcher() = default;
  // Sources to ask for a chain, most promising first.
  [[nodiscard]] virtual std::vector<std::string> candidates(std::uint64_t model_id,
                                                            std::span<const std::uint64_t> hashes) = 0;
  // The longest prefix of the chain `request` names that `source` holds, less
  // request.skip_tokens, as a frame of request.codec (nullopt: it holds none), all by
  // `deadline`; past it a kTimeout names the stage.
  [[nodiscard]] virtual Result<std::optional<peer::PeerClient::FetchedFrame>> fetch(const std::string& source,
                                                                                    const peer::FetchRequest& request,
                                                                                    peer::Deadline deadline,
                                                                                    std::uint64_t max_frame_bytes) = 0;
  // Where fetched frames are decoded and joined: kept warm between fetches.
  [[nodiscard]] virtual WarmBufferPool& buffers() = 0;
};

}  // namespace kvrelay::broker
