// A generator only yields: co_await inside one is a compile error that says what to do instead.
// expect-error: stagewise::coro::generator: co_await is not allowed inside a generator
#include "stagewise/coro/generator.hpp"

#include <coroutine>

stagewise::coro::generator<int> waits() {
  co_await std::suspend_always{};
  co_yield 1;
}
