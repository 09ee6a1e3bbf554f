#pragma once

// Sealed memfd segments: the only kind of shared memory kvrelay accepts from or hands to
// another process. Seals make the size immutable, so a peer cannot SIGBUS us by truncating
// a file we have mapped; F_SEAL_WRITE (added at commit) makes the contents immutable too.

#include <atomic>
#include <cstddef>
#include <cstdint>
#include <span>
#include <string>

#include "kvrelay/core/result.h"
#include "kvrelay/core/unique_fd.h"

namespace kvrelay::kv_store {

// Seals every segment carries from creation: the size can never change again.
inline constexpr unsigned kSizeSeals = 0x0002U | 0x0004U;  // F_SEAL_SHRINK | F_SEAL_GROW

// Creates an anonymous memfd of `size` bytes (fallocate'd, so later page faults cannot fail
// with SIGBUS for lack of memory) and seals its size. F_SEAL_SEAL is left off on purpose:
// commit adds F_SEAL_WRITE and then F_SEAL_SEAL.
[[nodiscard]] Result<UniqueFd> create_sealed_memfd(const std::string& name, std::uint64_t size);

// Like create_sealed_memfd, but without fallocate: for segments this process fills completely
// with write_memfd before anyone maps them. The writes allocate the pages (and fail with
// ENOSPC rather than a later SIGBUS), so reserving them first would only cost a second pass.
[[nodiscard]] Result<UniqueFd> create_sealed_memfd_to_fill(const std::string& name, std::uint64_t size);

// Writes `bytes` at `offset` with pwrite. Filling a segment through the kernel instead of a
// new mapping matters on hosts that build page tables lazily (shadow/nested paging): there the
// first write through any new user mapping costs ~4 ms/MiB, while the kernel writes through
// its own permanent mapping at several GB/s (measured in bench/transport_bench).
[[nodiscard]] Status write_memfd(int fd, std::uint64_t offset, std::span<const std::byte> bytes);

// Reads `out.size()` bytes at `offset` with pread: the kernel copies from the segment's pages
// into memory the caller keeps warm, where mapping the segment would pay a first touch per
// page on every read.
[[nodiscard]] Status read_memfd(int fd, std::uint64_t offset, std::span<std::byte> out);

// xxh3_64 of the first `size` bytes of `fd`, read with pread through a small per-thread
// buffer that stays mapped (and warm) across calls, for the same reason.
[[nodiscard]] Result<std::uint64_t> checksum_memfd(int fd, std::uint64_t size);

// Validates an fd received from another process: a regular file created by memfd_create,
// of exactly `expected_size` bytes (when non-zero), carrying at least kSizeSeals.
// Returns the size. Never trusts anything the sender claimed.
[[nodiscard]] Result<std::uint64_t> check_sealed_memfd(int fd, std::uint64_t expected_size);

// Current seals (F_GET_SEALS) or an error for fds that do not support sealing.
[[nodiscard]] Result<unsigned> get_seals(int fd);

// Adds F_SEAL_WRITE (+ F_SEAL_SEAL). Fails with kPermissionDenied while anyone still holds a
// writable shared mapping of the file: the kernel checks that for us across processes.
[[nodiscard]] Status seal_contents(int fd);

// Touches each page of `bytes` once for writing without changing a byte (an atomic OR with 0:
// it never loses a concurrent write, from this process or another). On hosts that build page
// tables lazily the first write to a page through a mapping costs ~100x a later one; the arena
// pays that here, in the background. Checks `stop` every MiB; returns the bytes covered.
std::uint64_t touch_pages_for_write(std::span<std::byte> bytes, const std::atomic<bool>* stop) noexcept;

// The same from kernel mode: for each page a futex FUTEX_WAKE_OP whose operation is an atomic OR
// with 0, which the kernel performs on the user address (no byte changes, no concurrent write
// lost, nobody woken). Hypervisors that shadow the guest kernel's view of user memory apart from
// user mode's (PVM, which the CI VMs run under) charge the first kernel write to each page
// (recv's copy into an arena) ~5 us even after user space wrote it: 0.75 GB/s where a warm page
// takes 22. Elsewhere it costs one cheap system call per page. Returns the bytes covered; stops
// at the first failing call (a kernel without FUTEX_WAKE_OP, an address not mapped writable).
std::uint64_t touch_pages_for_kernel_write(std::span<std::byte> bytes, const std::atomic<bool>* stop) noexcept;

// Marks the calling thread as background work: its page-touch loops (above) sleep twice as long
// as each MiB took, so they use at most a third of a core, at normal priority so the thread
// still exits promptly when its process is killed (see the definition).
void run_as_background_work() noexcept;

// A mapping of a whole segment; unmapped on destruction.
class Mapping {
 public:
  Mapping() = default;
  ~Mapping() { reset(); }
  Mapping(Mapping&& other) noexcept;
  Mapping& operator=(Mapping&& other) noexcept;
  Mapping(const Mapping&) = delete;
  Mapping& operator=(const Mapping&) = delete;

  [[nodiscard]] static Result<Mapping> map(int fd, std::uint64_t size, bool writable);

  [[nodiscard]] std::byte* data() const noexcept { return data_; }
  [[nodiscard]] std::uint64_t size() const noexcept { return size_; }
  [[nodiscard]] std::span<std::byte> bytes() const noexcept { return {data_, static_cast<std::size_t>(size_)}; }
  void reset() noexcept;

 private:
  std::byte* data_ = nullptr;
  std::uint64_t size_ = 0;
  void* base_ = nullptr;  // mmap result; differs from data_ only for empty segments
};

}  // namespace kvrelay::kv_store
