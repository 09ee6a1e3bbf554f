#pragma once

// What every chunk a peer sends asks first (issue #27, "Scheduler on every peer transfer"). The
// peer library only asks; the broker's LinkQueues answers with the decision library's
// LinkScheduler, so peer never depends on decision. A gate that withholds the next grant pauses a
// stream at a chunk boundary with its connection open: that is preemption, and the stream resumes
// at its next chunk, so no committed chunk is sent twice.

#include <chrono>
#include <cstdint>
#include <functional>
#include <optional>
#include <string>

namespace kvrelay::peer {

// Why bytes cross a link; the gate maps it to a scheduling class.
enum class TransferPurpose : std::uint8_t { kFetchReply, kPush, kPrefetch, kSpill, kProbe };

struct TransferTag {
  std::string peer;   // the node on the other end of the link
  std::string route;  // the policy route the transfer serves ("" names none)
  TransferPurpose purpose = TransferPurpose::kFetchReply;
  std::uint64_t bytes = 0;  // the whole stream
  std::optional<std::chrono::steady_clock::time_point> deadline;
};

// Thread-safe. `granted` may run on any thread, also inside request() itself.
class LinkGate {
 public:
  LinkGate() = default;
  LinkGate(const LinkGate&) = delete;
  LinkGate& operator=(const LinkGate&) = delete;
  virtual ~LinkGate() = default;

  // A ticket for one stream; 0: the stream is not gated (its chunks go as they are ready).
  [[nodiscard]] virtual std::uint64_t open(const TransferTag& tag) = 0;
  // Asks to send the ticket's next `bytes`; `granted` runs once when they may go.
  virtual void request(std::uint64_t ticket, std::uint64_t bytes, std::function<void()> granted) = 0;
  // The receiver acknowledged `bytes` more of the ticket's stream.
  virtual void acknowledged(std::uint64_t ticket, std::uint64_t bytes) = 0;
  // The stream ended (completed, or failed or abandoned); a pending request is dropped.
  virtual void close(std::uint64_t ticket, bool completed) = 0;
  // The chunk size gated streams use, so a grant is one chunk.
  [[nodiscard]] virtual std::uint32_t chunk_bytes() const = 0;
};

}  // namespace kvrelay::peer
