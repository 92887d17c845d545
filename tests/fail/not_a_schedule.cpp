// A lambda that returns a vector of actions is not a schedule: a schedule returns a
// coro::generator<Action>. verify (and train_step, simulate, plan) must say which concept failed.
// expect-error: pipeline_schedule
// expect-error: does not satisfy return-type-requirement
#include "stagewise/schedule/verify.hpp"

#include <vector>

int main() {
  auto not_a_schedule = [](int, int) { return std::vector<stagewise::schedule::Action>{}; };
  stagewise::schedule::verify(not_a_schedule, 2, 4);
}
