#include "benchmarks/common/memory.hpp"

#include <torch/torch.h>

#include <doctest/doctest.h>

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
