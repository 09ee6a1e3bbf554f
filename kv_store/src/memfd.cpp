#include "kvrelay/kv_store/memfd.h"

#include <fcntl.h>
#include <linux/futex.h>
#include <linux/magic.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <sys/syscall.h>
#include <sys/vfs.h>
#include <unistd.h>

#include <fmt/format.h>

#include <algorithm>
#include <cerrno>
#include <chrono>
#include <cstring>
#include <memory>
#include <thread>
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

namespace {

// Set by run_as_background_work(): this thread's page-touch loops rest between MiB.
thread_local bool t_paced = false;

// Called every MiB of a touch loop: on a paced thread, sleeps twice as long as the MiB took since
// the last call, so the loop uses at most a third of a core while running at normal priority.
class BackgroundPace {
 public:
  void after_piece() noexcept {
    if (!t_paced) return;
    const auto now = std::chrono::steady_clock::now();
    if (started_) std::this_thread::sleep_for(2 * (now - last_));
    started_ = true;
    last_ = std::chrono::steady_clock::now();
  }

 private:
  bool started_ = false;
  std::chrono::steady_clock::time_point last_{};
};

// Calls `touch(offset)` for each page start from `first` on that has `word_bytes` left, checking
// `stop` and pacing every MiB; stops early when `touch` fails. Returns the bytes covered.
template <typename TouchPage>
std::uint64_t touch_each_page(std::span<std::byte> bytes, std::uint64_t first, std::uint64_t word_bytes,
                              const std::atomic<bool>* stop, TouchPage touch) noexcept {
  const long page_size = ::sysconf(_SC_PAGESIZE);
  const std::uint64_t step = page_size > 0 ? static_cast<std::uint64_t>(page_size) : 4096;
  BackgroundPace pace;
  std::uint64_t offset = first;
  for (; offset + word_bytes <= bytes.size(); offset += step) {
    if (((offset - first) & 0xFFFFF) == 0) {
      if (stop != nullptr && stop->load(std::memory_order_relaxed)) break;
      pace.after_piece();
    }
    if (!touch(offset)) break;
  }
  return std::min<std::uint64_t>(offset, bytes.size());
}

}  // namespace

std::uint64_t touch_pages_for_write(std::span<std::byte> bytes, const std::atomic<bool>* stop) noexcept {
  return touch_each_page(bytes, 0, 1, stop, [&](std::uint64_t offset) {
    __atomic_fetch_or(reinterpret_cast<unsigned char*>(bytes.data() + offset), 0, __ATOMIC_RELAXED);
    return true;
  });
}

std::uint64_t touch_pages_for_kernel_write(std::span<std::byte> bytes, const std::atomic<bool>* stop) noexcept {
  // futex words are 4-byte aligned; mappings start on a page, so every page start qualifies.
  const auto misalignment = reinterpret_cast<std::uintptr_t>(bytes.data()) % alignof(std::uint32_t);
  const std::uint64_t first = misalignment == 0 ? 0 : alignof(std::uint32_t) - misalignment;
  std::uint32_t unused_futex = 0;  // FUTEX_WAKE_OP wakes waiters on it: there are none
  constexpr int kOrWithZero = FUTEX_OP(FUTEX_OP_OR, 0, FUTEX_OP_CMP_EQ, 0);
  return touch_each_page(bytes, first, sizeof(std::uint32_t), stop, [&](std::uint64_t offset) {
    return ::syscall(SYS_futex, &unused_futex, FUTEX_WAKE_OP | FUTEX_PRIVATE_FLAG, 0, 0, bytes.data() + offset,
                     kOrWithZero) >= 0;
  });
}

void run_as_background_work() noexcept {
  // Paced, not lowered in priority. The kernel closes a killed process's sockets only after each
  // of its threads has run to its exit, and the last one out also tears down the address space.
  // Beside busy cores a SCHED_IDLE warmer held a dead sidecar's connections open for 3-5 s (the
  // peers noticed only at their read timeouts), nice 19 as well, and nice 10 still missed 1 s
  // under ASan. A thread at normal priority that mostly sleeps gets the CPU at once when killed.
  t_paced = true;
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
  // MAP_POPULATE maps every page in one call instead of one fault per 4 KiB page, which is
  // most of the cost of touching a fresh segment (especially in VMs).
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
