#include "kvrelay/kv_store/memory_strategy.h"

#include <linux/futex.h>
#include <pthread.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <spdlog/spdlog.h>

#include <algorithm>
#include <chrono>
#include <system_error>
#include <utility>

namespace kvrelay::kv_store {

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

std::uint64_t prefault_pages(std::span<std::byte> bytes, PrefaultViews views, const std::atomic<bool>* stop) noexcept {
  // User mode first (copies and hashes), then kernel mode over the same pages.
  const std::uint64_t user = touch_pages_for_write(bytes, stop);
  if (views == PrefaultViews::kUser) return user;
  return std::min(user, touch_pages_for_kernel_write(bytes.first(static_cast<std::size_t>(user)), stop));
}

void run_as_background_work() noexcept {
  // Paced, not lowered in priority: the kernel closes a killed process's sockets only after each
  // of its threads has run to its exit, which an idle-priority thread beside busy cores delays
  // by seconds. A thread at normal priority that mostly sleeps gets the CPU at once.
  t_paced = true;
}

bool PageWarmer::start(MemoryStrategy strategy, std::span<std::byte> bytes, PrefaultViews views,
                       std::shared_ptr<const void> owner, std::string label) {
  if (strategy != MemoryStrategy::kPrefault || bytes.empty() || thread_.joinable()) return false;
  try {
    thread_ = std::thread([this, bytes, views, owner = std::move(owner), label = std::move(label)] {
      run_as_background_work();
      const std::uint64_t warmed = prefault_pages(bytes, views, &stop_);
      spdlog::debug("{}: prefaulted {} of {} bytes", label, warmed, bytes.size());
    });
    // Named before start() returns, so that whoever lists the process's threads can tell it.
    ::pthread_setname_np(thread_.native_handle(), kPageWarmerThreadName);
  } catch (const std::system_error& error) {
    // Prefaulting only saves time later; without a thread the memory still works.
    spdlog::warn("{}: no prefault thread: {}", label, error.what());
    return false;
  }
  return true;
}

void PageWarmer::stop() noexcept {
  stop_ = true;
  if (thread_.joinable()) thread_.join();
}

}  // namespace kvrelay::kv_store
