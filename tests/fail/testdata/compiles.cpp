// A file that compiles: the must-not-compile rule must fail on it.
// expect-error: this text never appears
#include "stagewise/coro/generator.hpp"
stagewise::coro::generator<int> ok() { co_yield 1; }
