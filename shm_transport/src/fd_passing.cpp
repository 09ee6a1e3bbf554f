#include "kvrelay/shm_transport/fd_passing.h"

#include <sys/socket.h>

#include <fmt/format.h>

#include <cerrno>
#include <cstring>

namespace kvrelay::shm {

namespace {

// Room for more fds than we accept, so an oversized batch shows up as "too many" rather than
// as silently dropped descriptors.
constexpr std::size_t kControlFdSlots = 32;

}  // namespace

Status send_message(int socket_fd, std::span<const std::byte> bytes, std::span<const int> fds) {
  if (bytes.size() > kMaxMessageBytes) return fail(ErrorCode::kInvalidArgument, "control message too large");
  if (fds.size() > kMaxFdsPerMessage) return fail(ErrorCode::kInvalidArgument, "too many fds for one message");
  iovec vector{const_cast<std::byte*>(bytes.data()), bytes.size()};
  msghdr header{};
  header.msg_iov = &vector;
  header.msg_iovlen = 1;
  alignas(cmsghdr) char control[CMSG_SPACE(sizeof(int) * kMaxFdsPerMessage)]{};
  if (!fds.empty()) {
    header.msg_control = control;
    header.msg_controllen = CMSG_SPACE(sizeof(int) * fds.size());
    cmsghdr* message = CMSG_FIRSTHDR(&header);
    message->cmsg_level = SOL_SOCKET;
    message->cmsg_type = SCM_RIGHTS;
    message->cmsg_len = CMSG_LEN(sizeof(int) * fds.size());
    std::memcpy(CMSG_DATA(message), fds.data(), sizeof(int) * fds.size());
  }
  while (true) {
    const ssize_t sent = ::sendmsg(socket_fd, &header, MSG_NOSIGNAL);
    if (sent >= 0) return ok();
    if (errno == EINTR) continue;
    return fail(ErrorCode::kIo, fmt::format("sendmsg: {}", std::strerror(errno)));
  }
}

Result<ReceivedMessage> receive_message(int socket_fd) {
  ReceivedMessage received;
  received.bytes.resize(kMaxMessageBytes + 1);
  iovec vector{received.bytes.data(), received.bytes.size()};
  msghdr header{};
  header.msg_iov = &vector;
  header.msg_iovlen = 1;
  alignas(cmsghdr) char control[CMSG_SPACE(sizeof(int) * kControlFdSlots)]{};
  header.msg_control = control;
  header.msg_controllen = sizeof(control);
  ssize_t got = 0;
  while (true) {
    got = ::recvmsg(socket_fd, &header, MSG_CMSG_CLOEXEC);
    if (got >= 0) break;
    if (errno == EINTR) continue;
    if (errno == ECONNRESET) {
      received.closed = true;
      received.bytes.clear();
      return received;
    }
    // SO_RCVTIMEO ran out (or a non-blocking socket had nothing).
    if (errno == EAGAIN || errno == EWOULDBLOCK) return fail(ErrorCode::kTimeout, "recvmsg: no reply in time");
    return fail(ErrorCode::kIo, fmt::format("recvmsg: {}", std::strerror(errno)));
  }
  // Take ownership of every descriptor first, whatever else is wrong with the message.
  bool foreign_control = false;
  for (cmsghdr* message = CMSG_FIRSTHDR(&header); message != nullptr; message = CMSG_NXTHDR(&header, message)) {
    if (message->cmsg_level == SOL_SOCKET && message->cmsg_type == SCM_RIGHTS) {
      const std::size_t count = (message->cmsg_len - CMSG_LEN(0)) / sizeof(int);
      for (std::size_t index = 0; index < count; ++index) {
        int fd = -1;
        std::memcpy(&fd, CMSG_DATA(message) + index * sizeof(int), sizeof(int));
        received.fds.emplace_back(fd);
      }
    } else {
      foreign_control = true;  // e.g. SCM_CREDENTIALS we never asked for
    }
  }
  if ((header.msg_flags & MSG_CTRUNC) != 0) {
    return fail(ErrorCode::kProtocol, "control data truncated: too many fds attached");
  }
  if (foreign_control) return fail(ErrorCode::kProtocol, "unexpected ancillary data");
  if ((header.msg_flags & MSG_TRUNC) != 0 || static_cast<std::size_t>(got) > kMaxMessageBytes) {
    return fail(ErrorCode::kProtocol, "control message exceeds the maximum size");
  }
  if (received.fds.size() > kMaxFdsPerMessage) {
    return fail(ErrorCode::kProtocol,
                fmt::format("{} fds attached, at most {}", received.fds.size(), kMaxFdsPerMessage));
  }
  if (got == 0 && received.fds.empty()) received.closed = true;
  received.bytes.resize(static_cast<std::size_t>(got));
  return received;
}

}  // namespace kvrelay::shm
