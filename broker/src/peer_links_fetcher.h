#pragma once

// The daemon's Fetcher: its peer links, whose same-host peers' frames are encoded with `codecs`.

#include "kvrelay/broker/peer_links.h"
#include "kvrelay/codec_plugins/registry.h"

#include "fetcher.h"

namespace kvrelay::broker {

class PeerLinksFetcher final : public Fetcher {
 public:
  PeerLinksFetcher(PeerLinks& links, const codec::CodecRegistry& codecs) : links_(links), codecs_(codecs) {}
  [[nodiscard]] std::vector<std::string> candidates(std::uint64_t model_id,
                                                    std::span<const std::uint64_t> hashes) override {
    return links_.candidates(model_id, hashes);
  }
  [[nodiscard]] Result<std::optional<peer::PeerClient::FetchedFrame>> fetch(const std::string& source,
                                                                            const peer::FetchRequest& request,
                                                                            peer::Deadline deadline,
                                                                            std::uint64_t max_frame_bytes) override {
    return links_.fetch(source, request, deadline, max_frame_bytes, codecs_);
  }
  [[nodiscard]] WarmBufferPool& buffers() override { return links_.buffers(); }

 private:
  PeerLinks& links_;
  const codec::CodecRegistry& codecs_;
};

}  // namespace kvrelay::broker
