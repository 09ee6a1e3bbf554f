#pragma once

// One datagram on a SOCK_SEQPACKET Unix socket, with up to kMaxFdsPerMessage descriptors
// attached (SCM_RIGHTS). SEQPACKET keeps message boundaries, so fds always arrive with the
// frame that explains them.

#include <cstddef>
#include <cstdint>
#include <span>
#include <vector>

#include "kvrelay/core/result.h"
#include "kvrelay/core/unique_fd.h"

namespace kvrelay::shm {

inline constexpr std::size_t kMaxFdsPerMessage = 4;
inline constexpr std::size_t kMaxMessageBytes = 64 * 1024;

struct ReceivedMessage {
  std::vector<std::byte> bytes;
  std::vector<UniqueFd> fds;  // owned: dropping the message closes them
  bool closed = false;        // orderly shutdown by the peer
};

[[nodiscard]] Status send_message(int socket_fd, std::span<const std::byte> bytes, std::span<const int> fds = {});

// Receives one message. Every descriptor the kernel installed is closed again when the
// message is refused (truncated payload, control data truncated, too many fds), so a hostile
// sender cannot make us leak.
[[nodiscard]] Result<ReceivedMessage> receive_message(int socket_fd);

}  // namespace kvrelay::shm
