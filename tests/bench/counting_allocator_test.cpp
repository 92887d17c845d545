#include "benchmarks/common/memory.hpp"

#include <torch/torch.h>

#include <doctest/doctest.h>

#include <thread>

TEST_CASE("the counting allocator sees tensors allocated and freed, and their peak") {
  auto& mem = stagewise::bench::counting_allocator();
  const long long before = mem.current();
  mem.reset_peak();
  {
    auto a = torch::empty({1024}, torch::kFloat);  // 4096 bytes
    CHECK(mem.current() - before == 4096);
    {
      auto b = torch::empty({256}, torch::kDouble);  // 2048 bytes
      CHECK(mem.current() - before == 6144);
    }
    CHECK(mem.current() - before == 4096);
  }
  CHECK(mem.current() == before);
  CHECK(mem.peak() - before == 6144);
}

TEST_CASE("each thread's allocations count on that thread, wherever they are freed") {
  auto& mem = stagewise::bench::counting_allocator();
  const auto before = mem.thread_current();
  mem.reset_peak();
  torch::Tensor kept;
  std::thread([&] {
    auto a = torch::empty({2048}, torch::kFloat);  // 8192 bytes, handed over
    auto b = torch::empty({1024}, torch::kFloat);  // 4096 bytes, freed here
    kept = a;
  }).join();
  const auto after = mem.thread_current();
  REQUIRE(after.size() == before.size() + 1);  // a new thread, a new counter
  CHECK(after.back() == 8192);
  CHECK(mem.max_thread_rise(before) == 12288);
  kept = torch::Tensor();  // freed by this thread, counted off the one that allocated it
  CHECK(mem.thread_current().back() == 0);
  CHECK(mem.max_thread_rise(before) == 12288);  // the peak stays until the next reset
  mem.reset_peak();
  CHECK(mem.max_thread_rise(mem.thread_current()) == 0);
}
