#pragma once

// Sealed memfd segments: the only kind of shared memory kvrelay accepts from or hands to
// another process. Seals make the size immutable, so a peer cannot SIGBUS us by truncating
// a file we have mapped; F_SEAL_WRITE (added at commit) makes the contents immutable too.

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

// Writes `bytes` at `offset` with pwrite. Segments are filled through the kernel, never through
// a new mapping: the kernel's copy costs the same on every host, a first write through a fresh
// mapping does not (bench/results/memory_strategy-notes.md).
[[nodiscard]] Status write_memfd(int fd, std::uint64_t offset, std::span<const std::byte> bytes);

// Reads `out.size()` bytes at `offset` with pread, into memory the caller reuses, for the same
// reason: no read maps the segment anew.
[[nodiscard]] Status read_memfd(int fd, std::uint64_t offset, std::span<std::byte> out);

// xxh3_64 of the first `size` bytes of `fd`, read with pread through a small per-thread
// buffer that stays mapped across calls, for the same reason.
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
