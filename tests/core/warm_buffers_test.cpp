#include "kvrelay/core/warm_buffers.h"

#include <catch2/catch.hpp>

#include <utility>

using kvrelay::WarmBufferPool;

TEST_CASE("a returned buffer is handed out again, pages and contents intact", "[core][warm_buffers]") {
  WarmBufferPool pool(2, 1 << 20);
  const std::byte* first = nullptr;
  {
    auto lease = pool.take(4096);
    REQUIRE(lease.size() == 4096);
    lease.bytes()[4095] = std::byte{0x5a};
    first = lease.bytes().data();
  }
  CHECK(pool.retained_buffers() == 1);
  CHECK(pool.retained_bytes() == 4096);
  auto again = pool.take(1000);  // a smaller request reuses the larger kept buffer
  CHECK(again.bytes().data() == first);
  CHECK(again.size() == 1000);
  CHECK(pool.retained_buffers() == 0);
}

TEST_CASE("the smallest buffer that fits is taken", "[core][warm_buffers]") {
  WarmBufferPool pool(4, 1 << 20);
  const std::byte* small = nullptr;
  const std::byte* large = nullptr;
  {
    auto a = pool.take(1000);
    auto b = pool.take(8000);
    small = a.bytes().data();
    large = b.bytes().data();
  }
  REQUIRE(pool.retained_buffers() == 2);
  auto mid = pool.take(2000);
  CHECK(mid.bytes().data() == large);
  auto tiny = pool.take(10);
  CHECK(tiny.bytes().data() == small);
}

TEST_CASE("the pool keeps at most its bounds, dropping the smallest buffers", "[core][warm_buffers]") {
  WarmBufferPool pool(2, 10'000);
  {
    auto a = pool.take(1000);
    auto b = pool.take(3000);
    auto c = pool.take(5000);
  }
  CHECK(pool.retained_buffers() == 2);  // the 1000-byte one went
  CHECK(pool.retained_bytes() == 8000);
  { auto big = pool.take(9000); }  // kept alone: 9000 + 5000 > 10000, 3000 and 5000 dropped
  CHECK(pool.retained_buffers() == 1);
  CHECK(pool.retained_bytes() == 9000);
  { auto huge = pool.take(20'000); }  // above the byte bound: never kept
  CHECK(pool.retained_bytes() <= 10'000);
  CHECK(pool.retained_buffers() == 0);
}

TEST_CASE("a moved lease returns its buffer once, and may outlive the pool", "[core][warm_buffers]") {
  WarmBufferPool::Lease outliving;
  {
    WarmBufferPool pool(4, 1 << 20);
    auto lease = pool.take(100);
    WarmBufferPool::Lease moved = std::move(lease);
    CHECK(lease.size() == 0);  // NOLINT(bugprone-use-after-move): the moved-from state is the point
    outliving = std::move(moved);
    { auto other = pool.take(100); }
    CHECK(pool.retained_buffers() == 1);
  }
  CHECK(outliving.size() == 100);
  outliving.bytes()[99] = std::byte{1};  // still valid memory after the pool is gone
}
