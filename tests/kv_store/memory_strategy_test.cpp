// The memory-strategy module: page touching from user and kernel mode, its pacing, and
// PageWarmer, which starts a thread only under MemoryStrategy::kPrefault.

#include "kvrelay/kv_store/memory_strategy.h"

#include <time.h>

#include <catch2/catch.hpp>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <filesystem>
#include <fstream>
#include <memory>
#include <span>
#include <string>
#include <thread>
#include <vector>

#include "kvrelay/kv_store/memfd.h"

namespace kvrelay::test {

namespace {

// Threads of this process named `name`.
std::size_t threads_named(const std::string& name) {
  std::size_t count = 0;
  for (const auto& task : std::filesystem::directory_iterator("/proc/self/task")) {
    std::ifstream comm(task.path() / "comm");
    std::string line;
    if (std::getline(comm, line) && line == name) ++count;
  }
  return count;
}

}  // namespace

TEST_CASE("a page warmer starts no thread under the portable strategy", "[kv_store][memory_strategy]") {
  std::vector<std::byte> pages(1U << 20, std::byte{9});
  kv_store::PageWarmer warmer;
  CHECK_FALSE(warmer.start(MemoryStrategy::kPortable, pages, kv_store::PrefaultViews::kUserAndKernel, nullptr, "test"));
  CHECK_FALSE(warmer.started());
  CHECK(threads_named(kv_store::kPageWarmerThreadName) == 0);
}

TEST_CASE("a page warmer under prefault runs one named thread that changes no byte and stops on request",
          "[kv_store][memory_strategy]") {
  // Large enough that the paced pass is still running when it is stopped.
  auto pages = std::make_shared<std::vector<std::byte>>(std::size_t{256} << 20, std::byte{5});
  {
    kv_store::PageWarmer warmer;
    REQUIRE(warmer.start(MemoryStrategy::kPrefault, *pages, kv_store::PrefaultViews::kUserAndKernel, pages, "test"));
    CHECK(warmer.started());
    CHECK(threads_named(kv_store::kPageWarmerThreadName) == 1);
    CHECK_FALSE(warmer.start(MemoryStrategy::kPrefault, *pages, kv_store::PrefaultViews::kUser, pages, "again"));
    warmer.stop();
    CHECK_FALSE(warmer.started());
  }
  CHECK(threads_named(kv_store::kPageWarmerThreadName) == 0);
  CHECK(std::all_of(pages->begin(), pages->end(), [](std::byte value) { return value == std::byte{5}; }));
  // Nothing to touch, nothing started.
  kv_store::PageWarmer idle;
  CHECK_FALSE(idle.start(MemoryStrategy::kPrefault, {}, kv_store::PrefaultViews::kUser, nullptr, "empty"));
}

TEST_CASE("a prefault pass covers every page in the views asked for, and stops when told",
          "[kv_store][memory_strategy]") {
  std::vector<std::byte> pages(std::size_t{4} << 20, std::byte{7});
  CHECK(kv_store::prefault_pages(pages, kv_store::PrefaultViews::kUser, nullptr) == pages.size());
  CHECK(kv_store::prefault_pages(pages, kv_store::PrefaultViews::kUserAndKernel, nullptr) == pages.size());
  std::atomic<bool> stop{true};
  CHECK(kv_store::prefault_pages(pages, kv_store::PrefaultViews::kUserAndKernel, &stop) == 0);
  CHECK(std::all_of(pages.begin(), pages.end(), [](std::byte value) { return value == std::byte{7}; }));
}

TEST_CASE("touching pages from kernel mode loses no concurrent write and stops at memory it cannot write",
          "[kv_store][memory_strategy]") {
  constexpr std::size_t kPages = 64;
  constexpr std::size_t kPage = 4096;
  std::vector<std::uint32_t> words(kPages * kPage / sizeof(std::uint32_t), 0x5A5A5A5AU);
  const auto bytes = std::as_writable_bytes(std::span(words));
  // A writer bumps the very words the kernel ORs with zero: an OR that was a load and a store
  // would sooner or later put an old value back.
  std::atomic<bool> done{false};
  std::uint64_t bumps = 0;
  std::thread writer([&] {
    while (!done.load(std::memory_order_relaxed)) {
      for (std::size_t page = 0; page < kPages; ++page) {
        __atomic_fetch_add(&words[page * kPage / sizeof(std::uint32_t)], 1U, __ATOMIC_RELAXED);
      }
      ++bumps;
    }
  });
  std::uint64_t covered = 0;
  for (int round = 0; round < 200; ++round)
    covered = kv_store::touch_pages_for_kernel_write(bytes, nullptr);
  done = true;
  writer.join();
  CHECK(covered == bytes.size());
  for (std::size_t page = 0; page < kPages; ++page) {
    CHECK(words[page * kPage / sizeof(std::uint32_t)] == static_cast<std::uint32_t>(0x5A5A5A5AU + bumps));
    CHECK(words[page * kPage / sizeof(std::uint32_t) + 1] == 0x5A5A5A5AU);
  }
  std::atomic<bool> stop{true};
  CHECK(kv_store::touch_pages_for_kernel_write(bytes, &stop) == 0);

  // A read-only mapping: the first page's write fails, and nothing past it is claimed.
  auto memfd = kv_store::create_sealed_memfd_to_fill("kernel-touch", kPage * 2);
  REQUIRE(memfd);
  auto read_only = kv_store::Mapping::map(memfd.value().get(), kPage * 2, false);
  REQUIRE(read_only);
  CHECK(kv_store::touch_pages_for_kernel_write(read_only.value().bytes(), nullptr) == 0);
}

TEST_CASE("background warming sleeps at least twice its working time between MiB", "[kv_store][memory_strategy]") {
  // Paced work at normal priority, not a lowered priority: see run_as_background_work. Sleeping
  // twice as long as each MiB took means wall time >= 2x the thread's CPU time (less the last MiB).
  constexpr std::size_t kBytes = 32U << 20;
  std::vector<std::byte> pages(kBytes, std::byte{3});
  double cpu_seconds = 0;
  double wall_seconds = 0;
  std::uint64_t covered = 0;
  std::thread warmer([&] {
    kv_store::run_as_background_work();
    timespec cpu_start{};
    ::clock_gettime(CLOCK_THREAD_CPUTIME_ID, &cpu_start);
    const auto wall_start = std::chrono::steady_clock::now();
    covered = kv_store::touch_pages_for_kernel_write(pages, nullptr);
    wall_seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - wall_start).count();
    timespec cpu_end{};
    ::clock_gettime(CLOCK_THREAD_CPUTIME_ID, &cpu_end);
    cpu_seconds = static_cast<double>(cpu_end.tv_sec - cpu_start.tv_sec) +
                  static_cast<double>(cpu_end.tv_nsec - cpu_start.tv_nsec) * 1e-9;
  });
  warmer.join();
  CHECK(covered == kBytes);
  CHECK(wall_seconds >= 1.8 * cpu_seconds);
  CHECK(std::all_of(pages.begin(), pages.end(), [](std::byte value) { return value == std::byte{3}; }));
}

}  // namespace kvrelay::test
