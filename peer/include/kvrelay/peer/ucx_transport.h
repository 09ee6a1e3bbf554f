#pragma once

// The UCX peer transport (issue #29): chunk streams over UCP active messages, beside the
// authenticated TCP/TLS peer connection that carries every control frame. One UCP context per
// process, one worker per I/O thread progressed from Asio through its event fd (never by
// spinning), one endpoint per peer connection, bound to it by a token that connection handed out.
// docs/transports.md says when to use it; built only where libucx-dev is (ucx_built()).

#include <boost/asio/any_io_executor.hpp>
#include <boost/asio/awaitable.hpp>

#include <array>
#include <cstddef>
#include <cstdint>
#include <functional>
#include <memory>
#include <span>
#include <string>
#include <vector>

#include "kvrelay/core/policy.h"
#include "kvrelay/core/result.h"
#include "kvrelay/peer/peer_protocol.h"

namespace kvrelay::peer {

// Whether this build has UCX (libucx-dev at configure time).
[[nodiscard]] bool ucx_built() noexcept;

using UcxToken = std::array<std::byte, kUcxTokenBytes>;

class UcxContext {
 public:
  // From the policy's `ucx` section (tls, net_devices, rndv_thresh_bytes): sets
  // UCX_POSIX_ERROR_HANDLING=y (peer error handling needs it on shared memory), then creates the
  // context with active messages and wake-up support.
  [[nodiscard]] static Result<std::shared_ptr<UcxContext>> create(const UcxPolicy& settings);
  ~UcxContext();
  UcxContext(const UcxContext&) = delete;
  UcxContext& operator=(const UcxContext&) = delete;
  // Registers `memory` once (ucp_mem_map) for the context's life: chunks sent from or received
  // into it pass that handle instead of UCX registering them per operation (the shm arena).
  [[nodiscard]] Status register_memory(std::span<std::byte> memory);

  struct Impl;
  [[nodiscard]] Impl& impl() const noexcept { return *impl_; }

 private:
  explicit UcxContext(std::unique_ptr<Impl> impl);
  std::unique_ptr<Impl> impl_;
};

class UcxLink;

// One UCP worker. Its progress runs as a coroutine on `executor` (a strand, or a single-threaded
// io_context), woken by the worker's event fd; sends and receives may come from other threads
// when made with kManyThreads.
enum class UcxThreading { kOneThread, kManyThreads };
class UcxWorker {
 public:
  // `on_refused`: called (on the worker's executor) for each active message refused.
  [[nodiscard]] static Result<std::shared_ptr<UcxWorker>> create(std::shared_ptr<UcxContext> context,
                                                                 boost::asio::any_io_executor executor,
                                                                 UcxThreading threading,
                                                                 std::function<void()> on_refused = {});
  ~UcxWorker();
  UcxWorker(const UcxWorker&) = delete;
  UcxWorker& operator=(const UcxWorker&) = delete;
  // What peers create endpoints from (sent over the TLS control connection only).
  [[nodiscard]] std::vector<std::byte> address() const;
  // Server side: a link with a fresh token and an endpoint of ours to the peer's worker at
  // `remote_address`. The first active message presenting the token binds the endpoint it came
  // from to the link and is answered on ours; the token is spent. Messages are taken only from
  // endpoints so bound (UCX's reply endpoints serve as their identities, never to send on).
  [[nodiscard]] Result<std::shared_ptr<UcxLink>> expect_link(std::span<const std::byte> remote_address);
  // Client side: an endpoint to `remote_address` with peer error handling, whose first active
  // message presents `token`. The link is usable once ready() (the peer answered the token).
  [[nodiscard]] Result<std::shared_ptr<UcxLink>> dial(std::span<const std::byte> remote_address, const UcxToken& token);
  // Active messages refused: from an endpoint that presented no valid token first (it is closed).
  [[nodiscard]] std::uint64_t refused_endpoints() const noexcept;
  // Ends the progress coroutine; links fail. Call before the executor's io_context stops.
  void stop();

  struct Impl;

 private:
  explicit UcxWorker(std::shared_ptr<Impl> impl);
  std::shared_ptr<Impl> impl_;
};

// A chunk that arrived on a link: its 20-byte chunk header and, still held by UCX, its body.
struct UcxArrival {
  std::array<std::byte, kChunkHeaderBytes> header{};
  std::size_t length = 0;
  std::shared_ptr<UcxWorker::Impl> worker;
  void* descriptor = nullptr;  // a rendezvous descriptor, or eager data UCX let us keep
  bool rendezvous = false;
  std::vector<std::byte> copied;  // eager data UCX would not let us keep
  UcxArrival() = default;
  UcxArrival(const UcxArrival&) = delete;
  UcxArrival& operator=(const UcxArrival&) = delete;
  ~UcxArrival();  // releases what UCX still holds
};

// What a link's callbacks report; consumed by one coroutine at a time (the connection's).
struct UcxEvent {
  // kSendsDone: sends_in_flight() reached 0. kFailed: the endpoint or an operation failed.
  enum class Kind : std::uint8_t { kArrival, kSendsDone, kReceiveDone, kReady, kFailed };
  Kind kind = Kind::kFailed;
  std::string message;                  // kFailed: what UCX said
  std::shared_ptr<UcxArrival> arrival;  // kArrival
};

// One peer connection's endpoint. Sends are posted without waiting (their bodies stay the
// caller's until sends_in_flight() is 0); everything UCX reports comes back as UcxEvents.
class UcxLink {
 public:
  ~UcxLink();
  UcxLink(const UcxLink&) = delete;
  UcxLink& operator=(const UcxLink&) = delete;
  [[nodiscard]] const UcxToken& token() const noexcept;
  // Posts one chunk. A send that UCX completes at once reports nothing; others kSendDone.
  [[nodiscard]] Status post_chunk(std::span<const std::byte, kChunkHeaderBytes> header,
                                  std::span<const std::byte> body);
  // Posts the receive of a rendezvous arrival's body into `into` (exactly its length); kReceiveDone
  // follows. An eager one is copied at once: returns true when the body is already there.
  [[nodiscard]] Result<bool> receive(UcxArrival& arrival, std::span<std::uint8_t> into);
  // The next event (error once the link is closed and none is left).
  [[nodiscard]] boost::asio::awaitable<Result<UcxEvent>> next_event();
  [[nodiscard]] std::size_t sends_in_flight() const noexcept;
  // The peer answered the token (kReady was reported).
  [[nodiscard]] bool ready() const noexcept;
  // UCX's lanes for this endpoint (ucp_ep_print_info), e.g. "tcp/lo" or "posix/memory".
  [[nodiscard]] std::vector<std::string> lanes() const;
  // Closes the endpoint (forcefully: pending operations fail) and ends next_event().
  void close();

  struct Impl;
  explicit UcxLink(std::shared_ptr<Impl> impl);
  [[nodiscard]] Impl& impl() const noexcept { return *impl_; }

 private:
  std::shared_ptr<Impl> impl_;
};

}  // namespace kvrelay::peer
