#include "stagewise/coro/generator.hpp"

#include <doctest/doctest.h>

#include <stdexcept>
#include <string>
#include <type_traits>
#include <vector>

namespace coro = stagewise::coro;

static_assert(!std::is_copy_constructible_v<coro::generator<int>>);
static_assert(std::is_nothrow_move_constructible_v<coro::generator<int>>);

namespace {
coro::generator<int> count(int n, int* started) {
  ++*started;
  for (int i = 0; i < n; ++i) co_yield i;
}

coro::generator<std::string> throws_after(int n) {
  for (int i = 0; i < n; ++i) co_yield std::to_string(i);
  throw std::runtime_error("schedule broke");
}
}  // namespace

TEST_SUITE("coro::generator") {
  TEST_CASE("it is lazy: the body starts at begin()") {
    int started = 0;
    auto g = count(3, &started);
    CHECK(started == 0);
    auto it = g.begin();
    CHECK(started == 1);
    CHECK(*it == 0);
  }

  TEST_CASE("it yields every value in order, then ends") {
    int started = 0;
    std::vector<int> seen;
    for (int v : count(4, &started)) seen.push_back(v);
    CHECK(seen == std::vector<int>{0, 1, 2, 3});
    int none = 0;
    auto empty = count(0, &none);
    CHECK(empty.begin() == empty.end());
  }

  TEST_CASE("it is move-only and the moved-from generator is empty") {
    int started = 0;
    auto a = count(2, &started);
    auto b = std::move(a);
    std::vector<int> seen;
    for (int v : b) seen.push_back(v);
    CHECK(seen == std::vector<int>{0, 1});
    CHECK(a.begin() == a.end());  // NOLINT(bugprone-use-after-move): defined as empty
  }

  TEST_CASE("an exception in the body reaches the consumer after the values before it") {
    std::vector<std::string> seen;
    auto g = throws_after(2);
    CHECK_THROWS_WITH_AS(
        [&] {
          for (const auto& s : g) seen.push_back(s);
        }(),
        "schedule broke", std::runtime_error);
    CHECK(seen == std::vector<std::string>{"0", "1"});
  }

  TEST_CASE("a generator destroyed before the end frees its frame") {
    struct Flag {
      bool* alive;
      ~Flag() { *alive = false; }
    };
    bool alive = true;
    {
      auto g = [](bool* a) -> coro::generator<int> {
        Flag f{a};
        co_yield 1;
        co_yield 2;
      }(&alive);
      CHECK(*g.begin() == 1);
      CHECK(alive);
    }
    CHECK_FALSE(alive);
  }
}
