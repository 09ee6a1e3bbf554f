#pragma once

// Everything kvrelay does to memory only because some hosts build page tables lazily (shadow or
// nested paging, e.g. PVM guests): page touching, its pacing, and the background warmers. The
// rest of the code calls this with the policy's MemoryStrategy (limits.memory_strategy) and never
// touches pages itself. Under MemoryStrategy::kPortable nothing here starts a thread.
// Rationale and figures: bench/results/memory_strategy-notes.md.

#include <atomic>
#include <cstddef>
#include <cstdint>
#include <memory>
#include <span>
#include <string>
#include <thread>

#include "kvrelay/core/memory_strategy.h"

namespace kvrelay::kv_store {

// Which views of a mapping a prefault pass touches. Some hypervisors fault the kernel's view of
// user pages in apart from user mode's, so memory the kernel will copy into needs both.
enum class PrefaultViews {
  kUser,           // what this process's copies write
  kUserAndKernel,  // also what recv/read copy into from kernel mode
};

// Touches each page of `bytes` once for writing without changing a byte (an atomic OR with 0: it
// never loses a concurrent write, from this process or another). Checks `stop` every MiB;
// returns the bytes covered.
std::uint64_t touch_pages_for_write(std::span<std::byte> bytes, const std::atomic<bool>* stop) noexcept;

// The same from kernel mode: per page a futex FUTEX_WAKE_OP whose operation is an atomic OR with 0
// on the user address (no byte changes, no concurrent write lost, nobody woken). Returns the
// bytes covered; stops at the first failing call (no FUTEX_WAKE_OP, memory not mapped writable).
std::uint64_t touch_pages_for_kernel_write(std::span<std::byte> bytes, const std::atomic<bool>* stop) noexcept;

// Both passes as `views` asks, the kernel one over what the user one covered. Returns the bytes
// covered by every pass made.
std::uint64_t prefault_pages(std::span<std::byte> bytes, PrefaultViews views, const std::atomic<bool>* stop) noexcept;

// Marks the calling thread as background work: its touch loops sleep twice as long as each MiB
// took (at most a third of a core), at normal priority so that a killed process exits promptly.
void run_as_background_work() noexcept;

// The name (/proc/<pid>/task/<tid>/comm) of every PageWarmer thread.
inline constexpr const char* kPageWarmerThreadName = "kvrelay-warm";

// One paced background prefault of a long-lived mapping. start() under kPrefault runs
// prefault_pages on a thread of its own; under kPortable it does nothing. stop() (and the
// destructor) ends the pass early and joins the thread.
class PageWarmer {
 public:
  PageWarmer() = default;
  ~PageWarmer() { stop(); }
  PageWarmer(const PageWarmer&) = delete;
  PageWarmer& operator=(const PageWarmer&) = delete;

  // `owner` keeps `bytes` mapped while the thread runs; `label` names the mapping in the log.
  // Returns whether a thread was started (never twice, never for an empty mapping).
  bool start(MemoryStrategy strategy, std::span<std::byte> bytes, PrefaultViews views,
             std::shared_ptr<const void> owner, std::string label);
  void stop() noexcept;
  [[nodiscard]] bool started() const noexcept { return thread_.joinable(); }

 private:
  std::atomic<bool> stop_{false};
  std::thread thread_;
};

}  // namespace kvrelay::kv_store
