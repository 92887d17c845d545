#include "stagewise/core/phony.hpp"

#include <doctest/doctest.h>

namespace sw = stagewise;

TEST_SUITE("phony") {
  TEST_CASE("a phony has shape (0) and holds no data") {
    auto p = sw::phony(torch::kCPU, false);
    CHECK(p.sizes() == torch::IntArrayRef{0});
    CHECK(p.numel() == 0);
    CHECK(p.device() == torch::Device(torch::kCPU));
  }

  TEST_CASE("requires_grad is honoured") {
    CHECK(sw::phony(torch::kCPU, true).requires_grad());
    CHECK_FALSE(sw::phony(torch::kCPU, false).requires_grad());
  }

  TEST_CASE("the same key returns the same cached tensor, another key another") {
    auto a = sw::phony(torch::kCPU, true);
    auto b = sw::phony(torch::kCPU, true);
    auto c = sw::phony(torch::kCPU, false);
    CHECK(a.is_same(b));
    CHECK_FALSE(a.is_same(c));
    CHECK(c.is_same(sw::phony(torch::kCPU, false)));
  }

  TEST_CASE("a cached phony has no grad_fn (it is a leaf)") {
    CHECK_FALSE(sw::phony(torch::kCPU, true).grad_fn());
  }
}
