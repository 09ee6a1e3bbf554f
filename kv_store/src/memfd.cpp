#include "kvrelay/kv_store/memfd.h"

#include <fcntl.h>
#include <linux/magic.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <sys/vfs.h>
#include <unistd.h>

#include <fmt/format.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <memory>
#include <utility>
#include <vector>

#include "kvrelay/core/bulk_hash.h"

namespace kvrelay::kv_store {

namespace {

std::string errno_text(int error) {
  return std::strerror(error);
}

}  // namespace

Result<UniqueFd> create_sealed_memfd(const std::string& name, std::uint64_t size) {
  if (size > static_cast<std::uint64_t>(INT64_MAX)) return fail(ErrorCode::kOverflow, "segment size too large");
  UniqueFd fd(::memfd_create(name.c_str(), MFD_CLOEXEC | MFD_ALLOW_SEALING));
  if (!fd) return fail(ErrorCode::kResourceExhausted, fmt::format("memfd_create: {}", errno_text(errno)));
  if (size > 0) {
    const int rc = ::posix_fallocate(fd.get(), 0, static_cast<off_t>(size));
    if (rc != 0) {
      return fail(ErrorCode::kResourceExhausted, fmt::format("fallocate {} bytes: {}", size, errno_text(rc)));
    }
  }
  if (::fcntl(fd.get(), F_ADD_SEALS, F_SEAL_SHRINK | F_SEAL_GROW) != 0) {
    return fail(ErrorCode::kIo, fmt::format("F_ADD_SEALS: {}", errno_text(errno)));
  }
  return fd;
}

Result<UniqueFd> create_sealed_memfd_to_fill(const std::string& name, std::uint64_t size) {
  if (size > static_cast<std::uint64_t>(INT64_MAX)) return fail(ErrorCode::kOverflow, "segment size too large");
  UniqueFd fd(::memfd_create(name.c_str(), MFD_CLOEXEC | MFD_ALLOW_SEALING));
  if (!fd) return fail(ErrorCode::kResourceExhausted, fmt::format("memfd_create: {}", errno_text(errno)));
  if (::ftruncate(fd.get(), static_cast<off_t>(size)) != 0) {
    return fail(ErrorCode::kResourceExhausted, fmt::format("ftruncate {} bytes: {}", size, errno_text(errno)));
  }
  if (::fcntl(fd.get(), F_ADD_SEALS, F_SEAL_SHRINK | F_SEAL_GROW) != 0) {
    return fail(ErrorCode::kIo, fmt::format("F_ADD_SEALS: {}", errno_text(errno)));
  }
  return fd;
}

Status write_memfd(int fd, std::uint64_t offset, std::span<const std::byte> bytes) {
  std::size_t done = 0;
  while (done < bytes.size()) {
    const auto written = ::pwrite(fd, bytes.data() + done, bytes.size() - done, static_cast<off_t>(offset + done));
    if (written < 0) {
      if (errno == EINTR) continue;
      const ErrorCode code = errno == ENOSPC || errno == ENOMEM ? ErrorCode::kResourceExhausted : ErrorCode::kIo;
      return fail(
          code, fmt::format("write {} bytes at offset {}: {}", bytes.size() - done, offset + done, errno_text(errno)));
    }
    if (written == 0) return fail(ErrorCode::kIo, fmt::format("write at offset {} made no progress", offset + done));
    done += static_cast<std::size_t>(written);
  }
  return ok();
}

Status read_memfd(int fd, std::uint64_t offset, std::span<std::byte> out) {
  std::size_t done = 0;
  while (done < out.size()) {
    const auto got = ::pread(fd, out.data() + done, out.size() - done, static_cast<off_t>(offset + done));
    if (got < 0) {
      if (errno == EINTR) continue;
      return fail(ErrorCode::kIo, fmt::format("read at offset {}: {}", offset + done, errno_text(errno)));
    }
    if (got == 0) {
      return fail(ErrorCode::kTruncated,
                  fmt::format("segment ends at {}, {} bytes wanted", offset + done, offset + out.size()));
    }
    done += static_cast<std::size_t>(got);
  }
  return ok();
}

Result<std::uint64_t> checksum_memfd(int fd, std::uint64_t size) {
  // Small enough to stay in cache between the read and the hash; one per thread, kept for the
  // thread's lifetime so its pages are mapped once.
  constexpr std::size_t kPieceBytes = 256 * 1024;
  thread_local std::vector<std::byte> piece(kPieceBytes);
  const std::unique_ptr<XXH3_state_t, decltype(&XXH3_freeState)> state(XXH3_createState(), &XXH3_freeState);
  if (!state) return fail(ErrorCode::kResourceExhausted, "XXH3_createState");
  XXH3_64bits_reset(state.get());
  std::uint64_t offset = 0;
  while (offset < size) {
    const auto wanted = static_cast<std::size_t>(std::min<std::uint64_t>(kPieceBytes, size - offset));
    const auto got = ::pread(fd, piece.data(), wanted, static_cast<off_t>(offset));
    if (got < 0) {
      if (errno == EINTR) continue;
      return fail(ErrorCode::kIo, fmt::format("read at offset {}: {}", offset, errno_text(errno)));
    }
    if (got == 0) return fail(ErrorCode::kTruncated, fmt::format("segment ends at {} of {} bytes", offset, size));
    XXH3_64bits_update(state.get(), piece.data(), static_cast<std::size_t>(got));
    offset += static_cast<std::uint64_t>(got);
  }
  return XXH3_64bits_digest(state.get());
}

Result<unsigned> get_seals(int fd) {
  const int seals = ::fcntl(fd, F_GET_SEALS);
  if (seals < 0) return fail(ErrorCode::kPermissionDenied, "fd does not support seals (not a memfd)");
  return static_cast<unsigned>(seals);
}

Result<std::uint64_t> check_sealed_memfd(int fd, std::uint64_t expected_size) {
  struct stat info {};
  if (::fstat(fd, &info) != 0) return fail(ErrorCode::kInvalidArgument, "fstat failed on received fd");
  if (!S_ISREG(info.st_mode)) return fail(ErrorCode::kInvalidArgument, "received fd is not a regular file");
  struct statfs fs {};
  // memfds live on an internal tmpfs (or hugetlbfs); anything else is a real file we refuse.
  if (::fstatfs(fd, &fs) != 0 || (fs.f_type != TMPFS_MAGIC && fs.f_type != HUGETLBFS_MAGIC)) {
    return fail(ErrorCode::kInvalidArgument, "received fd is not a memfd");
  }
  KVRELAY_TRY(const unsigned seals, get_seals(fd));
  if ((seals & kSizeSeals) != kSizeSeals) {
    return fail(ErrorCode::kPermissionDenied, "received memfd is not sealed against shrink and grow");
  }
  if (info.st_size < 0) return fail(ErrorCode::kInvalidArgument, "negative file size");
  const auto size = static_cast<std::uint64_t>(info.st_size);
  if (expected_size != 0 && size != expected_size) {
    return fail(ErrorCode::kInvalidArgument, fmt::format("memfd holds {} bytes, message says {}", size, expected_size));
  }
  return size;
}

Status seal_contents(int fd) {
  if (::fcntl(fd, F_ADD_SEALS, F_SEAL_WRITE) != 0) {
    if (errno == EBUSY) {
      return fail(ErrorCode::kPermissionDenied, "segment is still mapped writable; unmap it before commit");
    }
    return fail(ErrorCode::kPermissionDenied, fmt::format("cannot seal segment contents: {}", errno_text(errno)));
  }
  if (::fcntl(fd, F_ADD_SEALS, F_SEAL_SEAL) != 0) {
    return fail(ErrorCode::kIo, fmt::format("F_SEAL_SEAL: {}", errno_text(errno)));
  }
  return ok();
}

Mapping::Mapping(Mapping&& other) noexcept
    : data_(std::exchange(other.data_, nullptr)),
      size_(std::exchange(other.size_, 0)),
      base_(std::exchange(other.base_, nullptr)) {}

Mapping& Mapping::operator=(Mapping&& other) noexcept {
  if (this != &other) {
    reset();
    data_ = std::exchange(other.data_, nullptr);
    size_ = std::exchange(other.size_, 0);
    base_ = std::exchange(other.base_, nullptr);
  }
  return *this;
}

Result<Mapping> Mapping::map(int fd, std::uint64_t size, bool writable) {
  Mapping mapping;
  if (size == 0) return mapping;  // mmap of 0 bytes is EINVAL; an empty view needs no memory
  if (size > static_cast<std::uint64_t>(SIZE_MAX / 2)) return fail(ErrorCode::kOverflow, "mapping too large");
  const int protection = writable ? (PROT_READ | PROT_WRITE) : PROT_READ;
  // MAP_POPULATE maps every page in one call instead of taking one fault per page later.
  void* base = ::mmap(nullptr, static_cast<std::size_t>(size), protection, MAP_SHARED | MAP_POPULATE, fd, 0);
  if (base == MAP_FAILED) return fail(ErrorCode::kIo, fmt::format("mmap {} bytes: {}", size, errno_text(errno)));
  mapping.base_ = base;
  mapping.data_ = static_cast<std::byte*>(base);
  mapping.size_ = size;
  return mapping;
}

void Mapping::reset() noexcept {
  if (base_ != nullptr) ::munmap(base_, static_cast<std::size_t>(size_));
  base_ = nullptr;
  data_ = nullptr;
  size_ = 0;
}

}  // namespace kvrelay::kv_store
